"""A training pass's adapted-layer products on the native kernel's entry of several operands
(lora/native_summed.py, linear_avx512.cpp's linear_bf16_operands): the forward's [x | low] @
[W | B].T and the input gradient's [dy_1 | ... | d_low] @ [W_1; ...; A] without joining
anything, the same sums as the one-operand kernel on the joined tensors."""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine import native, native_linear  # noqa: E402
from tuneloop.server.engine.lora import native_summed, ops, siblings  # noqa: E402

BUILT = native_summed.operands_kernel() is not None
pytestmark = pytest.mark.skipif(not BUILT, reason="needs the AVX512-BF16 kernels")


def _group(
    sizes: tuple[int, ...], ranks: tuple[int, ...], k: int, rows: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    ws = [(torch.randn(s, k, generator=gen) * 0.1).bfloat16() for s in sizes]
    downs = [(torch.randn(r, k, generator=gen) * 0.1).bfloat16() for r in ranks]
    ups = [
        (torch.randn(s, r, generator=gen) * 0.1).bfloat16()
        for s, r in zip(sizes, ranks, strict=True)
    ]
    return x, ws, downs, ups


def _joined(ws: list[torch.Tensor], ups: list[torch.Tensor], scales: list[float]) -> torch.Tensor:
    """[W_all | B blocks], each member's scale * B in its own rank's columns."""
    k, r = ws[0].shape[1], sum(b.shape[1] for b in ups)
    wide = torch.zeros(sum(w.shape[0] for w in ws), k + r, dtype=torch.bfloat16)
    wide[:, :k] = torch.cat(ws)
    row = column = 0
    for b, scale in zip(ups, scales, strict=True):
        wide[row : row + b.shape[0], k + column : k + column + b.shape[1]] = b * scale
        row, column = row + b.shape[0], column + b.shape[1]
    return wide


@pytest.mark.parametrize(
    ("sizes", "ranks", "k", "rows", "bias"),
    [
        ((96, 32, 32), (8, 8, 8), 64, 37, False),  # q/k/v-like, blocks across members
        ((128, 128), (16, 16), 48, 300, True),  # gate/up-like, a bias
        ((70,), (6,), 30, 1, True),  # one member (no spans), one row
        ((40, 50), (4, 5), 20, 19, False),  # an odd rank: a pair across two members, no spans
        ((64,), (3,), 16, 7, False),  # an odd LoRA width: the last input alone
        ((64,), (2,), 16, 5, False),  # one block, one pair of LoRA columns (any strides)
        # whole tile steps (32 inputs) in every operand: an AMX CPU's tile unit takes these
        ((128, 64, 64), (32, 32, 32), 64, 300, True),  # q/k/v-like, spans, chunks, a short pass
        ((96, 96), (16, 16), 96, 5, False),  # narrow passes (16 rows or fewer)
        ((64,), (32,), 64, 40, True),  # one member, a short last pass
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_pair_entry_makes_the_joined_kernels_bits(
    sizes: tuple[int, ...],
    ranks: tuple[int, ...],
    k: int,
    rows: int,
    bias: bool,
    threads: int,
    linear_form: str,
) -> None:
    x, ws, downs, ups = _group(sizes, ranks, k, rows, sum(sizes) + k + rows)
    scales = [2.0, 0.5, 1.0][: len(sizes)]
    gen = torch.Generator().manual_seed(rows)
    b = torch.randn(sum(sizes), generator=gen).bfloat16() if bias else None
    low = x @ torch.cat(downs).t()
    wide = _joined(ws, ups, scales)
    spans = native_summed.spans_of(sizes, ranks, k // 2)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native_summed.summed(
            x, low, native_summed.frozen(ws), native_summed.b_blocks(ups, scales), b, spans
        )
        joined = native_linear.pack(wide, b)
        joined = native_linear.NativeWeight(
            joined.blocks, joined.bias, joined.out_features, joined.in_features, spans
        )
        want = native_linear.linear(torch.cat([x, low], dim=1), joined)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got, want)
    exact = torch.cat([x, low], dim=1).double() @ wide.double().t()
    if b is not None:
        exact += b.double()
    # a bf16 step, or the fp32 sums' own error where terms nearly cancel
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-7 + 1e-4).all()


def test_spans_leave_out_the_other_members_columns() -> None:
    # q 128 rows (two blocks), k and v 64 each; a block of 64 straddling k and v
    spans = native_summed.spans_of((128, 64, 64), (4, 4, 4), 10)
    assert spans is not None
    assert spans.tolist() == [[0, 10, 10, 12], [0, 10, 10, 12], [0, 10, 12, 14], [0, 10, 14, 16]]
    straddle = native_summed.spans_of((96, 32), (4, 4), 10)
    assert straddle is not None
    assert straddle.tolist() == [[0, 10, 10, 12], [0, 10, 10, 14]]
    assert native_summed.spans_of((64,), (4,), 10) is None
    assert native_summed.spans_of((64, 64), (3, 5), 10) is None


def test_strided_inputs_and_bad_shapes() -> None:
    x, ws, _, ups = _group((64,), (4,), 32, 9, 3)
    wide_x = torch.randn(9, 40).bfloat16()
    low = wide_x[:, 32:36]
    packed = native_summed.frozen(ws)
    blocks = native_summed.b_blocks(ups, [1.0])
    assert torch.equal(
        native_summed.summed(wide_x[:, :32], low, packed, blocks),
        native_summed.summed(wide_x[:, :32].clone(), low.clone(), packed, blocks),
    )
    with pytest.raises(ValueError, match="features"):
        native_summed.summed(torch.randn(9, 30).bfloat16(), low, packed, blocks)
    with pytest.raises(ValueError, match="operand 1 does not match"):
        native_summed.summed(wide_x[:, :32], low[:5], packed, blocks)
    with pytest.raises(ValueError, match="odd width"):
        native_summed.product([x[:, :31], low], [packed.blocks, blocks], 64)
    with pytest.raises(ValueError, match="operands"):
        native_summed.product([x] * 9, [packed.blocks] * 9, 64)
    kernel = native_summed.operands_kernel()
    y = torch.empty(9, 64, dtype=torch.bfloat16)

    def call(*widths: int) -> int:
        count = len(widths)
        pointers = (ctypes.c_void_p * count)(*[x.data_ptr()] * count)
        numbers = (ctypes.c_int64 * count)(*widths)
        weights = (ctypes.c_void_p * count)(*[packed.blocks.data_ptr()] * count)
        return int(
            kernel(
                count,
                pointers,
                numbers,
                numbers,
                weights,
                numbers,
                9,
                None,
                64,
                y.data_ptr(),
                64,
                1,
                None,
            )
        )

    assert call(32, 4) == 0
    assert call(31, 4) == 1  # the next operand starts at a whole pair: refused
    assert call(32, 3) == 0  # (the last may be odd)
    assert call(*[2] * 9) == 1  # more operands than a call takes


def test_the_frozen_copy_is_kept_until_a_weight_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    _, ws, _, _ = _group((64, 32), (4, 4), 32, 1, 4)
    first = native_summed.frozen(ws)
    assert first is not None
    assert native_summed.frozen(ws) is first
    with torch.no_grad():
        ws[1].add_(1.0)  # in place: a new version
    second = native_summed.frozen(ws)
    assert second is not None
    assert second is not first
    assert torch.equal(second.blocks, native_linear.pack(torch.cat(ws)).blocks)
    monkeypatch.setattr(native_summed, "free_bytes", lambda device: 1000)
    assert native_summed.frozen([w.clone() for w in ws]) is None  # too large for free memory


def _node_pass(grouped: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    sizes, ranks = (64, 32, 32), (4, 4, 4)
    x, ws, _, _ = _group(sizes, ranks, 32, 0, 5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 11, 32, generator=gen).bfloat16().requires_grad_()
    masters = [
        (
            (torch.randn(r, 32, generator=gen) * 0.1).requires_grad_(),
            (torch.randn(s, r, generator=gen) * 0.1).requires_grad_(),
            2.0,
        )
        for s, r in zip(sizes, ranks, strict=True)
    ]
    factors = [(a.bfloat16(), b.bfloat16(), s) for a, b, s in masters]
    biases = [torch.randn(s, generator=gen).bfloat16() for s in sizes]
    if grouped:
        outs = list(siblings.sibling_linears(x, ws, factors, biases))
    else:
        outs = [
            ops.one_adapter_linear(x, w, bias, f)
            for w, bias, f in zip(ws, biases, factors, strict=True)
        ]
    probe = torch.Generator().manual_seed(7)
    sum((o.float() * torch.randn(o.shape, generator=probe)).sum() for o in outs).backward()
    found = [x.grad] + [t.grad for a, b, _ in masters for t in (a, b)]
    return [o.detach() for o in outs], [g for g in found if g is not None]


@pytest.mark.parametrize("grouped", [False, True])
def test_the_nodes_take_the_kernel_with_torchs_sums_to_rounding(
    grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-adapter node and the sibling group on the kernel against the same nodes by
    torch's products: the outputs a bf16 step apart at most, the gradients (the input's by the
    kernel too, rounded once) as close as their inputs allow."""
    calls: list[int] = []
    grad_calls: list[int] = []
    summed, input_grad = native_summed.summed, native_summed.input_grad
    monkeypatch.setattr(native_summed, "available", lambda *a: True)
    monkeypatch.setattr(native_summed, "summed", lambda *a: calls.append(1) or summed(*a))
    monkeypatch.setattr(
        native_summed, "input_grad", lambda *a: grad_calls.append(1) or input_grad(*a)
    )
    outs, grads = _node_pass(grouped)
    assert len(calls) == len(grad_calls) == (1 if grouped else 3)
    monkeypatch.setattr(native_summed, "_NATIVE", False)
    monkeypatch.setattr(native_summed, "available", lambda *a: False)
    torch_outs, torch_grads = _node_pass(grouped)
    assert len(calls) == len(grad_calls) == (1 if grouped else 3)
    for got, want in zip(outs, torch_outs, strict=True):
        step = want.float().abs().clamp(min=1e-3) * 2.0**-7
        assert ((got.float() - want.float()).abs() <= step).all()
        assert (got == want).float().mean() > 0.9
    for got, want in zip(grads, torch_grads, strict=True):
        assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("sizes", "rank", "rows", "k"),
    [
        ((96, 32, 32), 8, 37, 48),
        ((128, 128), 16, 300, 48),
        ((70,), 6, 5, 48),
        ((96, 32, 32), 32, 300, 64),  # whole tile steps: an AMX CPU's tile unit
        ((64,), 32, 9, 96),  # whole tile steps, narrow passes
    ],
)
def test_the_input_gradient_is_the_joined_kernels_bits(
    sizes: tuple[int, ...], rank: int, rows: int, k: int, two_threads: None, linear_form: str
) -> None:
    gen = torch.Generator().manual_seed(rows)
    ws = [(torch.randn(s, k, generator=gen) * 0.1).bfloat16() for s in sizes]
    dys = [torch.randn(rows, s, generator=gen).bfloat16() for s in sizes]
    a = (torch.randn(rank * len(sizes), k, generator=gen) * 0.1).bfloat16()
    d_low = torch.randn(rows, rank * len(sizes), generator=gen).bfloat16()
    got = native_summed.input_grad(dys, d_low, ws, a)
    assert got is not None
    joined = native_linear.pack(torch.cat([*ws, a]).t().contiguous())
    want = native_linear.linear(torch.cat([*dys, d_low], dim=1), joined)
    assert torch.equal(got, want)
    exact = sum(dy.double() @ w.double() for dy, w in zip(dys, ws, strict=True))
    exact = exact + d_low.double() @ a.double()
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-7 + 1e-4).all()
    assert native_summed.transposed(ws) is native_summed.transposed(ws)  # kept
    many = [dys[0]] * native_summed.OPERANDS  # one more operand (d_low) than a call takes
    assert native_summed.input_grad(many, d_low, [ws[0]] * len(many), a) is None
    odd = torch.randn(5, k, generator=gen).bfloat16()  # a member of odd width: not first
    assert native_summed.input_grad([dys[0][:, :5], d_low], d_low, [odd, a], a) is None


def test_a_product_is_taken_where_the_cpus_form_of_the_kernel_takes_its_widths() -> None:
    """Every width but the last even; on an AMX CPU only whole tile steps of 32 inputs, the
    tile unit's (the AVX-512 loops run there far below oneDNN's rate on the tiles)."""
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    ws = [torch.zeros(64, 64, dtype=torch.bfloat16)]
    amx = "amx_bf16" in native.cpu_flags() and native_linear.tiles(None)
    assert native_summed.available(x, ws, (64, 32))
    assert not native_summed.available(x, ws, (63, 32))  # an odd width before the last
    assert native_summed.available(x, ws, (64, 8)) is not amx  # not whole tile steps
    assert not native_summed.available(x.float(), ws, (64, 32))
    if amx:
        try:
            native_linear.tiles(False)  # the loops only: left to torch on this CPU
            assert not native_summed.available(x, ws, (64, 32))
        finally:
            native_linear.tiles(True)
