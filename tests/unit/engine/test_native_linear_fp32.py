"""The fp32 native linear kernel (native_linear.py, linear_fp32.cpp): x @ W.T + b on blocks of 16
outputs, each output's sum made in input order from its bias, in tiles of AVX2 or (where the CPU
has it) AVX-512 vectors; chosen for fp32 decode copies (`TUNELOOP_CPU_ISA=avx2` runs the AVX2
tiles on a CPU with AVX-512)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine import native, native_linear, packed  # noqa: E402
from tuneloop.server.engine.lora.fused import FusedLinear  # noqa: E402
from tuneloop.server.engine.native_linear import NativeWeight  # noqa: E402

pytestmark = pytest.mark.skipif(
    not {"avx2", "fma"} <= native.cpu_flags(), reason="needs a CPU with AVX2 and FMA"
)


@pytest.fixture(autouse=True)
def built() -> None:
    if native_linear.fp32_kernel() is None:
        pytest.skip("the fp32 kernel could not be built here")


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The textbook bound of an fp32 sum's rounding, (K + 1) eps sum |terms|, per output."""
    terms = x.double().abs() @ w.double().abs().t() + (0.0 if b is None else b.double().abs())
    return (x.shape[1] + 1) * torch.finfo(torch.float32).eps * terms


@pytest.mark.parametrize(
    ("n", "k", "rows", "bias"),
    [
        (960, 576, 128, False),  # q/k/v, a decode step's rows
        (576, 1536, 1, True),  # one row, a bias
        (77, 33, 13, True),  # outputs past the last whole block, tiles of 6 and a short one
        (80, 20, 25, True),  # 5 blocks (AVX-512: a tile of three blocks and one of two)
        (16, 1, 7, False),  # one input
        (5, 40, 6, True),  # fewer outputs than a block
        (130, 64, 50, False),
    ],
)
def test_the_product_is_within_fp32_rounding(
    n: int, k: int, rows: int, bias: bool, two_threads: None
) -> None:
    gen = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    got = native_linear.linear(x, native_linear.pack(w, b))
    exact = x.double() @ w.double().t() + (b.double() if b is not None else 0.0)
    assert got.shape == (rows, n)
    assert got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= _bound(x, w, b)).all()


def test_a_rows_values_do_not_depend_on_its_batch_or_the_threads() -> None:
    """Every output is summed in input order from its bias, whatever tile, row count or thread
    made it: a sampled sequence does not depend on the batch it ran in."""
    gen = torch.Generator().manual_seed(5)
    w = native_linear.pack(torch.randn(130, 96, generator=gen), torch.randn(130, generator=gen))
    x = torch.randn(300, 96, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = native_linear.linear(x, w)
        torch.set_num_threads(2)
        every = native_linear.linear(x, w)
        assert torch.equal(alone, every)
        for rows in (1, 5, 6, 7, 11, 12, 13, 24, 25, 257):  # (tiles of 6 or 8 rows)
            assert torch.equal(native_linear.linear(x[:rows], w), every[:rows]), rows
            assert torch.equal(native_linear.linear(x[-rows:], w), every[-rows:]), rows
    finally:
        torch.set_num_threads(threads)


def test_the_sums_are_in_input_order_from_the_bias() -> None:
    """Each output is fma(x_K, w_K, ... fma(x_1, w_1, b)): compared bit for bit with that
    sequence made in fp64-exact steps rounded to fp32 at each one (an fma rounds once)."""
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(20, 37, generator=gen)
    b = torch.randn(20, generator=gen)
    x = torch.randn(3, 37, generator=gen)
    got = native_linear.linear(x, native_linear.pack(w, b))
    want = b.double().expand(3, 20).clone().float()
    for p in range(37):  # fp32 x fp32 is exact in fp64; + one fp32 sum rounds once as fma does
        exact = want.double() + x[:, p : p + 1].double() * w[:, p].double()
        want = exact.float()
    assert torch.equal(got, want)


def test_strided_rows_and_bad_inputs() -> None:
    packed_w = native_linear.pack(torch.randn(64, 64))
    wide = torch.randn(37, 80)
    assert torch.equal(
        native_linear.linear(wide[:, :64], packed_w),
        native_linear.linear(wide[:, :64].clone(), packed_w),
    )
    with pytest.raises(ValueError, match="64"):
        native_linear.linear(torch.randn(3, 41), packed_w)
    with pytest.raises(ValueError, match="fp32"):
        native_linear.linear(torch.randn(3, 64).bfloat16(), packed_w)
    with pytest.raises(ValueError, match="fp32"):
        native_linear.pack(torch.randn(8, 8, dtype=torch.float64))


def test_the_layout_holds_the_weights_once() -> None:
    held = native_linear.pack(torch.randn(100, 30), torch.zeros(100))
    # 7 blocks of 16 outputs x 30 inputs, fp32, and a padded fp32 bias
    assert held.blocks.shape == (7, 30, 16)
    assert held.nbytes == 7 * 16 * 30 * 4 + 112 * 4


def test_fp32_decode_copies_take_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group of siblings with a bias, merged with a LoRA delta as a lone fp32 key's copy is:
    the kernel's layout, oneDNN's packed weight with TUNELOOP_NATIVE_LINEAR=0; both within
    fp32 rounding of the modules' own forward."""
    gen = torch.Generator().manual_seed(3)
    bases = [torch.nn.Linear(48, n, bias=True) for n in (64, 32, 32)]
    for base in bases:
        base.requires_grad_(False)
    factors = [(torch.randn(4, 48, generator=gen), torch.randn(n, 4, generator=gen), 0.5)
               for n in (64, 32, 32)]  # fmt: skip
    x = torch.randn(6, 48, generator=gen)
    group = FusedLinear.build(bases, factors, merge=True)
    assert isinstance(group.weight, NativeWeight)
    monkeypatch.setenv("TUNELOOP_NATIVE_LINEAR", "0")
    onednn = FusedLinear.build(bases, factors, merge=True)
    assert not isinstance(onednn.weight, NativeWeight)
    assert onednn.weight.is_mkldnn == packed.packable(bases[0].weight)
    ours = torch.cat([group.output(i, x) for i in range(3)], dim=1)
    theirs = torch.cat([onednn.output(i, x) for i in range(3)], dim=1)
    merged = torch.cat(
        [b.weight + s * up @ a for b, (a, up, s) in zip(bases, factors, strict=True)]
    )
    bias = torch.cat([base.bias for base in bases])
    plain = torch.nn.functional.linear(x, merged, bias)
    for got in (ours, theirs):
        assert ((got.double() - plain.double()).abs() <= 2 * _bound(x, merged, bias)).all()
