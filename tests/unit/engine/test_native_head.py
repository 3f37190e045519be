"""The LM head tiles' element-wise work by C++ loops (engine/native_head.py, head_tile.h):
the fused head's logprobs and gradients as its torch code makes them, to a few fp32 ulps and,
at bf16, a bf16 step; every tile shape, repeated targets, the thread count blind. Each width
is skipped where the CPU lacks its features (bf16: AVX512-BF16, fp32: AVX512F or AVX2; the torch
code runs there, tested in test_fused_head.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine import fused_head, native_head  # noqa: E402


def _built(dtype: torch.dtype) -> bool:
    return (
        native_head.forward_kernel(dtype) is not None
        and native_head.backward_kernel(dtype) is not None
    )


_WIDTHS = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPES = [
    pytest.param(
        dtype,
        id=name,
        marks=pytest.mark.skipif(not _built(dtype), reason=f"no {name} loops built here"),
    )
    for name, dtype in _WIDTHS.items()
]


def _run(rows: int, vocab: int, k: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Logprobs of k targets a row through a head of `dtype` with one LoRA segment, and the
    gradients of hidden, low and B for a random upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    d, r = 64, 8
    weight = (torch.randn(vocab, d, generator=gen) * 0.6).to(dtype)
    hidden = torch.randn(rows, d, generator=gen).to(dtype).requires_grad_(True)
    low = (torch.randn(rows, r, generator=gen) * 0.1).to(dtype).requires_grad_(True)
    b = (torch.randn(vocab, r, generator=gen) * 0.1).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (rows, k), generator=gen)
    if k > 1:
        targets[::3, 1] = targets[::3, 0]  # a target twice in a row: both gradients land
    targets[rows // 2, 0] = vocab - 1  # the last column of the last tile
    parts = fused_head.HeadParts(weight, None, [fused_head.Segment(0, rows, low, b)])
    out = fused_head.fused_target_logprobs(parts, hidden, targets, None)
    grad = torch.randn(out.shape, generator=gen)
    return (out, *torch.autograd.grad(out, (hidden, low, b), grad))


# (rows, vocabulary, targets a row): tiles of 512 x 1024 and their tails (rows past 512,
# vocabulary past 1024 and off 16), one row, several targets
SHAPES = [(700, 3000, 2), (1, 1024, 1), (513, 1040, 1), (37, 517, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab", "k"), SHAPES)
def test_the_loops_give_the_torch_codes_logprobs_and_gradients(
    rows: int, vocab: int, k: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[torch.dtype] = []
    tile = native_head.forward_tile
    monkeypatch.setattr(
        native_head, "forward_tile", lambda raw, *a: (calls.append(raw.dtype), tile(raw, *a))
    )
    got = _run(rows, vocab, k, seed=rows + vocab, dtype=dtype)
    assert set(calls) == {dtype}  # (the loops ran, on tiles of this width alone)
    monkeypatch.setattr(native_head, "takes", lambda raw, softcap: False)
    want = _run(rows, vocab, k, seed=rows + vocab, dtype=dtype)
    # logprobs: the same logsumexp but for the order of the sums (a few fp32 ulps)
    torch.testing.assert_close(got[0], want[0], rtol=4e-7, atol=1e-6)
    if dtype == torch.float32:
        # each logit's gradient within an ulp or two of its exp; the input gradients sum a
        # row's or a column's over the vocabulary or the rows, where terms cancel: measured
        # within 1.6e-6 of the largest value (13 ulps of it), bounded at 2^-18
        for a, b in zip(got[1:], want[1:], strict=True):
            assert a.dtype == b.dtype == torch.float32
            assert float((a - b).abs().max()) <= float(b.abs().max()) * 2.0**-18
        return
    for a, b in zip(got[1:], want[1:], strict=True):
        assert a.dtype == b.dtype == torch.bfloat16
        # each tile's gradient rounds to bf16, where an ulp of its exp may move the rounding by
        # a step; the gradients sum those rounded tiles: a few steps of the largest value
        step = b.float().abs().max() * 2.0**-8
        assert bool(((a.float() - b.float()).abs() <= step).all())
        assert (a != b).float().mean() <= 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_loops_take_cpu_tiles_of_their_widths_without_softcap_alone(
    dtype: torch.dtype,
) -> None:
    tile = torch.randn(4, 32).to(dtype)
    assert native_head.takes(tile, None)
    assert not native_head.takes(tile, 30.0)
    assert not native_head.takes(tile.double(), None)
    assert not native_head.takes(tile.half(), None)
    assert not native_head.takes(tile.t(), None)
    stats = torch.zeros(4), torch.zeros(4), torch.zeros(4, 1)
    targets = torch.zeros(4, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64"):
        native_head.forward_tile(tile, (0, 4, 0, 32), targets.int(), *stats)
    with pytest.raises(ValueError, match="fp32"):
        native_head.forward_tile(tile, (0, 4, 0, 32), targets, stats[0].double(), *stats[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_the_rows_beside_it_or_on_the_thread_count(
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(9)
    raw = (torch.randn(300, 1024, generator=gen) * 8).to(dtype)
    targets = torch.randint(0, 1024, (300, 1), generator=gen)
    lse = torch.randn(300, generator=gen) + 12
    g_sum, g = torch.randn(300, generator=gen), torch.randn(300, 1, generator=gen)
    tile = (0, 300, 0, 1024)

    def both(rows: slice) -> tuple[torch.Tensor, ...]:
        n = rows.stop - rows.start
        high = torch.full((n,), float("-inf"))
        total, picked = torch.zeros(n), torch.zeros(n, 1)
        part = (0, n, 0, 1024)
        native_head.forward_tile(raw[rows], part, targets[rows], high, total, picked)
        d = native_head.backward_tile(
            raw[rows], part, targets[rows], lse[rows], g_sum[rows], g[rows]
        )
        return high, total, picked, d

    whole = both(slice(0, 300))
    alone = both(slice(150, 151))
    for a, b in zip(alone, whole, strict=True):
        assert torch.equal(a, b[150:151])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = both(slice(0, 300))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(single, whole, strict=True):
        assert torch.equal(a, b)
    assert tile[1] == whole[3].shape[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_statistics_merge_over_tiles_as_one_logsumexp(dtype: torch.dtype) -> None:
    """Tiles of one row taken one after another: the running maximum and sum give the row's
    logsumexp (fp64 reference), including logits far below the row's maximum."""
    gen = torch.Generator().manual_seed(2)
    row = (torch.randn(1, 4096, generator=gen) * 20).to(dtype)
    row[0, 7] = -3.0e38  # exp underflows to zero
    high, total = torch.full((1,), float("-inf")), torch.zeros(1)
    picked, targets = torch.zeros(1, 1), torch.tensor([[4000]])
    for v0 in range(0, 4096, 1024):
        native_head.forward_tile(
            row[:, v0 : v0 + 1024].contiguous(), (0, 1, v0, v0 + 1024), targets, high, total, picked
        )
    want = torch.logsumexp(row.double(), -1)
    got = high.double() + total.double().log()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    assert picked.item() == row[0, 4000].float().item()


@pytest.mark.skipif(not _built(torch.float32), reason="no fp32 loops built here")
def test_the_loops_exp_is_within_an_ulp_down_to_the_subnormals_and_zero() -> None:
    """The fp32 gradient of a logit with no target in its tile, at g_sum = -1, is its exp(z -
    lse) itself: within one ulp of the correctly rounded exp over z - lse <= 0, through the
    subnormals (below -87.3, where an AVX2 build applies 2^q in two steps) to zero (below
    -103.97, and -inf), at every tail length of a row."""
    gen = torch.Generator().manual_seed(3)
    d = torch.cat(
        [
            -torch.rand(20_000, generator=gen) * 110,
            -torch.rand(20_000, generator=gen) * 2,
            -87.0 - torch.rand(20_000, generator=gen) * 17,
            torch.tensor([0.0, -0.0, -float("inf"), -103.3, -103.97, -104.0, -150.0, -3.0e38]),
        ]
    )
    for width in (d.numel(), 1001, 9, 7):  # whole vectors and every tail
        raw = d[:width].view(1, -1).contiguous()
        targets = torch.full((1, 1), -1, dtype=torch.int64)  # in no tile
        got = native_head.backward_tile(
            raw,
            (0, 1, 0, width),
            targets,
            torch.zeros(1),
            torch.full((1,), -1.0),
            torch.zeros(1, 1),
        )[0]
        want = torch.exp(raw[0].double()).float()
        apart = (got.view(torch.int32).long() - want.view(torch.int32).long()).abs()
        assert int(apart.max()) <= 1
        assert bool((got[raw[0] < -104.0] == 0).all())
