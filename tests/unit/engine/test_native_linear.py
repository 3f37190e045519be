"""The native linear kernel (native_linear.py, linear_avx512.cpp): bf16 x @ W.T + b on its own
weight layout, each output summed in fp32 and rounded once, on the AVX-512 loops or the AMX
tile unit; chosen for decode copies on CPUs with AVX512-BF16, unless TUNELOOP_NATIVE_LINEAR=0."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine import native_linear, packed  # noqa: E402
from tuneloop.server.engine.lora.fused import FusedLinear  # noqa: E402
from tuneloop.server.engine.native_linear import NativeWeight  # noqa: E402

BUILT = native_linear.native_kernel() is not None
pytestmark = pytest.mark.skipif(not BUILT, reason="needs the AVX512-BF16 kernels")


@pytest.mark.parametrize(
    ("n", "k", "rows", "bias"),
    [
        (960, 672, 128, False),  # q/k/v with LoRA columns, a decode step's rows
        (576, 608, 1, True),  # one row, a bias
        (77, 33, 13, True),  # outputs past the last whole block, an odd input width
        (130, 64, 50, False),  # more rows than a unit
        (64, 2, 7, False),
        (100, 96, 300, True),  # several row chunks on the tiles, a short last pass
        (130, 64, 520, False),  # three even chunks (192, 192, 136), a short last pass
        (40, 64, 17, True),  # fewer outputs than a tile pass's 32 + 16
    ],
)
def test_the_product_is_each_output_summed_in_fp32_and_rounded_once(
    n: int, k: int, rows: int, bias: bool, two_threads: None, linear_form: str
) -> None:
    gen = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    got = native_linear.linear(x, native_linear.pack(w, b))
    exact = x.double() @ w.double().t() + (b.double() if b is not None else 0.0)
    want = exact.bfloat16()
    # (fp32 sums in another order than the exact one: a bf16 step in a few outputs at most)
    step = exact.abs().clamp(min=1e-6) * 2.0**-7
    assert got.shape == (rows, n)
    assert ((got.double() - exact).abs() <= step).all()
    assert (got == want).double().mean() > 0.99
    rows_alone = native_linear.linear(x[rows // 2 :], native_linear.pack(w, b))
    assert torch.equal(rows_alone, got[rows // 2 :])  # a row's values depend on itself alone


def test_a_rows_values_do_not_depend_on_how_many_rows_came_with_it(
    two_threads: None, linear_form: str
) -> None:
    """Calls of 16 rows or fewer take the tile unit's narrow passes, longer ones its 32-row
    passes (a short last one padded): every row gets the bits it gets in any other call, so a
    sampled sequence does not depend on the batch it ran in."""
    gen = torch.Generator().manual_seed(5)
    w = native_linear.pack(
        torch.randn(130, 96, generator=gen).bfloat16(), torch.randn(130, generator=gen).bfloat16()
    )
    x = torch.randn(300, 96, generator=gen).bfloat16()
    every = native_linear.linear(x, w)
    for rows in (1, 3, 15, 16, 17, 31, 32, 33, 64, 257):
        assert torch.equal(native_linear.linear(x[:rows], w), every[:rows]), rows
        assert torch.equal(native_linear.linear(x[-rows:], w), every[-rows:]), rows


def test_strided_rows_and_bad_shapes(linear_form: str) -> None:
    w = torch.randn(64, 64).bfloat16()
    packed_w = native_linear.pack(w)
    wide = torch.randn(37, 80).bfloat16()
    assert torch.equal(
        native_linear.linear(wide[:, :64], packed_w),
        native_linear.linear(wide[:, :64].clone(), packed_w),
    )
    with pytest.raises(ValueError, match="64"):
        native_linear.linear(torch.randn(3, 41).bfloat16(), packed_w)
    with pytest.raises(ValueError, match="bf16"):
        native_linear.linear(torch.randn(3, 40), packed_w)
    with pytest.raises(ValueError, match="bf16"):
        native_linear.pack(torch.randn(8, 8, dtype=torch.float64))


def test_decode_copies_take_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group of siblings with a bias: the kernel's layout (the bias in its sums), oneDNN's
    packed weight with TUNELOOP_NATIVE_LINEAR=0; the same outputs to a bf16 step."""
    bases = [torch.nn.Linear(48, n, bias=True).to(torch.bfloat16) for n in (64, 32, 32)]
    for base in bases:
        base.requires_grad_(False)
    x = torch.randn(6, 48).bfloat16()
    group = FusedLinear.build(bases, [None, None, None])
    assert isinstance(group.weight, NativeWeight)
    monkeypatch.setenv("TUNELOOP_NATIVE_LINEAR", "0")
    onednn = FusedLinear.build(bases, [None, None, None])
    assert not isinstance(onednn.weight, NativeWeight)
    assert onednn.weight.is_mkldnn == packed.packable(bases[0].weight)
    ours = torch.cat([group.output(i, x) for i in range(3)], dim=1)
    theirs = torch.cat([onednn.output(i, x) for i in range(3)], dim=1)
    plain = torch.cat([base(x) for base in bases], dim=1)
    for got in (ours, theirs):
        assert torch.allclose(got.float(), plain.float(), rtol=2**-7, atol=1e-2)


def test_the_layout_holds_the_weights_once(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(100, 30).bfloat16()
    held: Any = native_linear.pack(w, torch.zeros(100).bfloat16())
    # 2 blocks of 64 outputs x 15 input pairs x 2 bf16, and a padded fp32 bias
    assert held.nbytes == 2 * 64 * 30 * 2 + 128 * 4


def test_a_blocks_zero_pairs_are_left_out_and_its_sums_keep_their_bits(
    two_threads: None, linear_form: str
) -> None:
    """A lone key's q/k/v group holds each member's up-projection in its own rank's extra
    columns, zeros in the others': each block multiplies only the pairs that hold weights
    (`zero_spans`), and the outputs are bit for bit those of every pair multiplied."""
    gen = torch.Generator().manual_seed(11)
    # (160 inputs with the columns: whole tiles, so an AMX CPU runs this on its tile unit too)
    sizes, k, rank = (128, 64, 64), 64, 32
    bases = [torch.nn.Linear(k, n, bias=False).to(torch.bfloat16) for n in sizes]
    for base in bases:
        base.requires_grad_(False)
    factors = [
        (
            torch.randn(rank, k, generator=gen).bfloat16(),
            torch.randn(n, rank, generator=gen).bfloat16(),
            0.5,
        )
        for n in sizes
    ]
    group = FusedLinear.build(bases, factors)
    weight = group.weight
    assert isinstance(weight, NativeWeight)
    assert weight.spans is not None
    # pairs: 32 of the input, then 16 per member's rank; q's blocks (0, 1) keep the first 48,
    # k's (2) leave out q's 16 between, v's (3) q's and k's 32
    assert weight.spans.tolist() == [[0, 48, 48, 48]] * 2 + [[0, 32, 48, 64], [0, 32, 64, 80]]
    every = dataclasses.replace(weight, spans=None)
    x = torch.randn(37, k, generator=gen).bfloat16()
    low = torch.cat([x @ a.t() for a, _, _ in factors], dim=1)
    extended = torch.cat([x, low], dim=1)
    for rows in (1, 5, 17, 37):  # (more than 16 rows: the zero pairs left out)
        got = native_linear.linear(extended[:rows], weight)
        assert torch.equal(got, native_linear.linear(extended[:rows], every)), rows
    got = native_linear.linear(extended, weight)
    exact = torch.cat(
        [x.double() @ base.weight.double().t() for base in bases], dim=1
    ) + torch.cat(
        [0.5 * low.double()[:, rank * i : rank * (i + 1)] @ b.double().t()
         for i, (_, b, _) in enumerate(factors)],
        dim=1,
    )  # fmt: skip
    step = exact.abs().clamp(min=1e-6) * 2.0**-7
    assert ((got.double() - exact).abs() <= step).all()


def test_zero_spans_leave_out_runs_before_after_and_the_longest_between() -> None:
    w = torch.randn(256, 20).bfloat16()
    w[:64, :6] = 0  # block 0: its first 3 pairs
    w[64:128, 14:] = 0  # block 1: its last 3
    w[128:192, 4:8] = 0  # block 2: two runs between, the longer one left out
    w[128:192, 10:16] = 0
    w[192:] = 0  # block 3: nothing to multiply
    spans = native_linear.zero_spans(native_linear.pack(w).blocks)
    assert spans is not None
    assert spans.tolist() == [[3, 10, 10, 10], [0, 7, 7, 7], [0, 5, 8, 10], [0, 0, 0, 0]]
    # (calls of more than 16 rows skip; fewer multiply every pair, the same bits)
    x = torch.randn(23, 20).bfloat16()
    packed_w = native_linear.pack(w)
    every = dataclasses.replace(packed_w, spans=None)
    for rows in (9, 23):
        got = native_linear.linear(x[:rows], packed_w)
        assert torch.equal(got, native_linear.linear(x[:rows], every)), rows
        assert torch.equal(got[:, 192:], torch.zeros(rows, 64).bfloat16())
    assert (
        native_linear.zero_spans(native_linear.pack(torch.randn(64, 8).bfloat16()).blocks) is None
    )


def test_spans_out_of_order_are_refused() -> None:
    weight = native_linear.pack(torch.randn(64, 8).bfloat16())
    x = torch.randn(2, 8).bfloat16()
    for bad in ([0, 5, 5, 5], [2, 1, 4, 4], [0, 1, 0, 4], [-1, 1, 1, 1]):
        spans = torch.tensor([bad], dtype=torch.int32)
        with pytest.raises(ValueError, match="refused"):
            native_linear.linear(x, dataclasses.replace(weight, spans=spans))
