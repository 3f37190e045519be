"""The LoRA factors' gradients S^T @ G by the native kernel (lora/native_grads.py): as exact as
torch's bf16 matmul against fp64, any shape (odd row counts, column tails, narrow sides of
1-97 columns), strided operands, either orientation, the same bits at any thread count, and
the adapted layers' backward passes through it. The kernel's tests run wherever it builds
(AVX512-BF16); the dispatch's where it is used (no AMX)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine.lora import native_grads, ops, siblings  # noqa: E402

BUILT = native_grads.native_kernel() is not None
built = pytest.mark.skipif(not BUILT, reason="no AVX512-BF16 or no C++ compiler here")


def _operands(k: int, m: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(k, m, generator=gen).bfloat16()
    g = torch.randn(k, n, generator=gen).mul(0.1).bfloat16()
    return s, g


def _worst_ulps(value: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest error against `exact` in units of bf16's step at each entry's magnitude."""
    step = exact.abs().clamp_min(1e-30).log2().floor().exp2() * 2.0**-7
    return float(((value.double() - exact) / step).abs().max())


# (rows K, narrow M, wide N): SmolLM2's dA and dB shapes at a 736-row training part; odd K (a
# pair with one row), N off 32 (masked strips), M off 12 (short blocks), one row, no rows
SHAPES = [
    (736, 96, 576),
    (736, 32, 1536),
    (736, 64, 576),
    (737, 32, 192),
    (5, 7, 33),
    (1, 3, 40),
    (29, 13, 1001),
    (300, 97, 70),
    (0, 4, 20),
]


@built
@pytest.mark.parametrize(("k", "m", "n"), SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_products_are_as_exact_as_torch(k: int, m: int, n: int, transposed: bool) -> None:
    s, g = _operands(k, m, n, seed=k + m + n)
    got = native_grads.kernel_product(s, g, transposed=transposed)
    exact = s.double().t() @ g.double()
    if transposed:
        exact = exact.t()
    assert got.shape == exact.shape
    assert got.dtype == torch.bfloat16
    assert got.is_contiguous()
    if k == 0:
        assert torch.equal(got, torch.zeros_like(got))
        return
    reference = (g.t() @ s) if transposed else (s.t() @ g)
    # each entry is summed in fp32 and rounded once, as torch's bf16 matmul does: within a
    # rounding step of the exact sum, or no worse than torch's, or within an fp32 sum's own
    # error bound (K fp32 roundings of the terms' magnitudes: where terms nearly cancel, a
    # sum in another order than torch's lands some bf16 steps from a small exact value, and
    # torch's own error there differs by CPU: oneDNN's tile kernel on AMX sums in its order)
    magnitudes = s.double().abs().t() @ g.double().abs()
    if transposed:
        magnitudes = magnitudes.t()
    step = exact.abs().clamp_min(1e-30).log2().floor().exp2() * 2.0**-7
    fp32_sum = step + k * 2.0**-24 * magnitudes
    within = ((got.double() - exact).abs() <= fp32_sum).all()
    assert within or _worst_ulps(got, exact) <= max(1.0, _worst_ulps(reference, exact))


@built
def test_strided_operands_read_where_they_lie() -> None:
    """A sibling's columns of a group's low-rank activations and a gradient with padded rows
    are read through their row strides, as their contiguous copies."""
    s_all, g_wide = _operands(300, 96, 640, seed=3)
    s, g = s_all[:, 32:64], g_wide[:, :576]
    assert not s.is_contiguous()
    assert not g.is_contiguous()
    for transposed in (False, True):
        got = native_grads.kernel_product(s, g, transposed=transposed)
        again = native_grads.kernel_product(s.contiguous(), g.contiguous(), transposed=transposed)
        assert torch.equal(got, again)


@built
def test_threads_change_no_bit() -> None:
    s, g = _operands(517, 40, 1000, seed=5)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(native_grads.kernel_product(s, g))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@built
def test_non_finite_inputs_reach_their_entries_only() -> None:
    """An inf in one row of G makes its column's entries non-finite and no other."""
    s, g = _operands(64, 8, 96, seed=7)
    g[10, 40] = float("inf")
    got = native_grads.kernel_product(s, g).float()
    finite = torch.isfinite(got)
    assert not finite[:, 40].any()
    assert finite[:, [c for c in range(96) if c != 40]].all()


def test_products_fall_back_to_torch_off_bf16() -> None:
    """fp32 operands (and any CPU without the kernel) take torch's product, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    s, g = torch.randn(50, 8, generator=gen), torch.randn(50, 70, generator=gen)
    assert torch.equal(native_grads.transposed_product(s, g), s.t() @ g)
    assert torch.equal(native_grads.transposed_product(s, g, transposed=True), g.t() @ s)


def test_mismatched_operands_are_refused() -> None:
    s, g = torch.zeros(5, 3, dtype=torch.bfloat16), torch.zeros(6, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K, M"):
        native_grads.transposed_product(s, g)


def _layer_grads(native: bool, grouped: bool) -> list[torch.Tensor]:
    """The factors' and the input's gradients of an adapted layer (one adapter, or q/k/v as a
    sibling group) at bf16, the kernel on or off."""
    gen = torch.Generator().manual_seed(13)
    rows, width = 300, 96
    x = torch.randn(rows, width, generator=gen).bfloat16().requires_grad_()
    outs = (96, 32, 32) if grouped else (64,)
    weights = [torch.randn(o, width, generator=gen).mul(0.1).bfloat16() for o in outs]
    factors = [
        (
            torch.randn(8, width, generator=gen).mul(0.1).bfloat16().requires_grad_(),
            torch.randn(o, 8, generator=gen).mul(0.1).bfloat16().requires_grad_(),
            2.0,
        )
        for o in outs
    ]
    previous = native_grads._NATIVE
    native_grads._NATIVE = native
    try:
        if grouped:
            ys = siblings.sibling_linears(x, weights, factors)
        else:
            ys = (ops.one_adapter_linear(x, weights[0], None, factors[0]),)
        loss = sum((y.float() * torch.linspace(-1, 1, y.shape[1])).sum() for y in ys)
        loss.backward()
    finally:
        native_grads._NATIVE = previous
    grads = [x.grad]
    for a, b, _ in factors:
        grads += [a.grad, b.grad]
    return [g.clone() for g in grads if g is not None]


@pytest.mark.skipif(
    not native_grads.available(torch.zeros(1, dtype=torch.bfloat16)),
    reason="the adapted layers take torch's products here (no kernel, or AMX)",
)
@pytest.mark.parametrize("grouped", [False, True])
def test_adapted_layers_backward_through_the_kernel(grouped: bool) -> None:
    """The layers' gradients with the kernel match torch's products': the input's bit for bit
    (the kernel makes none of it), the factors' to a bf16 rounding step."""
    native, torch_made = _layer_grads(True, grouped), _layer_grads(False, grouped)
    assert len(native) == len(torch_made) == 1 + 2 * (3 if grouped else 1)
    assert torch.equal(native[0], torch_made[0])
    for got, want in zip(native[1:], torch_made[1:], strict=True):
        step = want.float().abs().max() * 2.0**-7
        assert (got.float() - want.float()).abs().max() <= step
