"""The LM head fused over vocabulary tiles (fused_head.py) against plain torch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from tuneloop.server.engine import cpu_fp32_matmul, fused_head  # noqa: E402
from tuneloop.server.engine.fused_head import HeadParts, Segment  # noqa: E402


def _reference(x, weight, bias, segments):  # type: ignore[no-untyped-def]
    out = x @ weight.t() + (0 if bias is None else bias)
    for seg in segments:
        out[seg.start : seg.end] += seg.low @ seg.b.t()
    return out


def _small_tiles(monkeypatch: pytest.MonkeyPatch, kept: bool) -> None:
    """Tiles of 64 rows by 300 columns; the logits recomputed in the backward pass where not
    kept."""
    monkeypatch.setattr(fused_head, "ROWS", 64)
    monkeypatch.setattr(fused_head, "COLUMNS", 300)
    if not kept:
        monkeypatch.setattr(fused_head, "SAVED_LOGITS_BYTES", 0)


def _one_adapter_case(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A head [1000, 64] of `dtype`, hidden [170, 64] and one adapter's low [130, 8] (rows
    20-150) and B [1000, 8], each a leaf that wants its gradient; one target a row and the
    logprobs' gradient [170, 1]."""
    gen = torch.Generator().manual_seed(seed)
    rows, vocab, width, rank = 170, 1000, 64, 8
    weight = (torch.randn(vocab, width, generator=gen) * 0.3).to(dtype)
    hidden = torch.randn(rows, width, generator=gen).to(dtype).requires_grad_()
    low = torch.randn(130, rank, generator=gen).to(dtype).requires_grad_()
    b = (torch.randn(vocab, rank, generator=gen) * 0.1).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows, 1), generator=gen)
    grad = torch.randn(rows, 1, generator=gen)
    return weight, hidden, low, b, targets, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("onednn", [False, True])
def test_decode_logits_equal_the_matmul_plus_each_segment_delta(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, with_bias: bool, onednn: bool
) -> None:
    """Tiles of 128 rows by 700 columns (ragged at both ends), rows 100-220 adapted, the rest
    base only: the same logits as one matmul plus the segment's product (fp32's tiles by
    either kernel, cpu_fp32_matmul.py)."""
    monkeypatch.setattr(cpu_fp32_matmul, "_forced", onednn)
    monkeypatch.setattr(fused_head, "ROWS", 128)
    monkeypatch.setattr(fused_head, "COLUMNS", 700)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(5000, 64, generator=gen).to(dtype)
    bias = torch.randn(5000, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(300, 64, generator=gen).to(dtype)
    segments = [
        Segment(
            100, 220, torch.randn(120, 4, generator=gen).to(dtype), torch.randn(5000, 4).to(dtype)
        )
    ]
    got = fused_head.chunked_logits(HeadParts(weight, bias, segments), x)
    assert got.dtype == torch.float32
    want = _reference(
        x.float(),
        weight.float(),
        None if bias is None else bias.float(),
        [Segment(s.start, s.end, s.low.float(), s.b.float()) for s in segments],
    )
    tol = 0 if dtype == torch.float32 else 0.25  # bf16: the rounding of values ~10
    assert (got - want).abs().max().item() <= tol + 1e-4


@pytest.mark.parametrize("exact", [True, False])
def test_bf16_tiles_of_one_adapter_keep_a_delta_below_the_logits_last_bit(
    monkeypatch: pytest.MonkeyPatch, exact: bool
) -> None:
    """A tile whose rows all use one adapter sums the delta with the base before its logits are
    rounded (the one-adapter node's way); a sampling step's parts (`exact_delta` off) add it to
    the rounded logits, where a young adapter's delta is mostly lost."""
    monkeypatch.setattr(fused_head, "ROWS", 64)
    monkeypatch.setattr(fused_head, "COLUMNS", 300)
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(1000, 64, generator=gen) * 0.5).bfloat16()
    x = torch.randn(128, 64, generator=gen).bfloat16()
    low = torch.randn(128, 4, generator=gen).bfloat16()
    b = (torch.randn(1000, 4, generator=gen) * 2e-3).bfloat16()
    parts = HeadParts(weight, None, [Segment(0, 128, low, b)], exact_delta=exact)
    got = fused_head.chunked_logits(parts, x).double()
    base = x.double() @ weight.double().t()
    delta = low.double() @ b.double().t()
    kept = float(((got - base) * delta).sum() / (delta * delta).sum())
    if exact:
        assert kept == pytest.approx(1.0, abs=0.05)
    else:
        assert kept < 0.8


class _Hooked(nn.Linear):
    pass


def test_only_a_plain_linear_head_is_fused() -> None:
    x = torch.randn(3, 8)
    plain = nn.Linear(8, 20, bias=False)
    parts = fused_head.head_parts(plain, x)
    assert parts is not None
    assert parts.weight is plain.weight
    assert not parts.segments
    hooked = nn.Linear(8, 20)
    hooked.register_forward_hook(lambda *a: None)
    assert fused_head.head_parts(hooked, x) is None  # a hook would be skipped
    assert fused_head.head_parts(_Hooked(8, 20), x) is None  # a subclass may compute otherwise
    assert fused_head.head_parts(nn.Sequential(nn.Linear(8, 20)), x) is None


@pytest.mark.parametrize("softcap", [30.0, None])
@pytest.mark.parametrize("kept", [True, False])
@pytest.mark.parametrize("onednn", [False, True])
def test_target_logprobs_and_gradients_equal_autograd_through_log_softmax(
    monkeypatch: pytest.MonkeyPatch, kept: bool, softcap: float | None, onednn: bool
) -> None:
    """Two adapted segments and base rows, a bias, a softcap or none and two targets per row,
    in tiles of 64 rows by 300 columns, the logits kept for the backward pass or recomputed
    there: logprobs and the gradients of hidden, low and B as autograd's through log_softmax.
    The tiles' products by the head's weight by either fp32 kernel (cpu_fp32_matmul.py)."""
    monkeypatch.setattr(cpu_fp32_matmul, "_forced", onednn)
    _small_tiles(monkeypatch, kept)
    gen = torch.Generator().manual_seed(1)
    rows, vocab, width, rank = 150, 1000, 16, 4
    weight = torch.randn(vocab, width, generator=gen) * 0.3
    bias = torch.randn(vocab, generator=gen)
    hidden = torch.randn(rows, width, generator=gen, requires_grad=True)
    factors = [
        (
            torch.randn(50, rank, generator=gen, requires_grad=True),
            torch.randn(vocab, rank, generator=gen, requires_grad=True),
        )
        for _ in range(2)
    ]
    inputs = [hidden, *[t for pair in factors for t in pair]]
    targets = torch.randint(0, vocab, (rows, 2), generator=gen)
    grad = torch.randn(rows, 2, generator=gen)
    spans = [(0, 50), (90, 140)]
    segments = [Segment(s, e, low, b) for (s, e), (low, b) in zip(spans, factors, strict=True)]
    z = _reference(hidden, weight, bias, segments)
    capped = torch.tanh(z / softcap) * softcap if softcap else z
    want = torch.log_softmax(capped, -1).gather(-1, targets)
    want_grads = torch.autograd.grad((want * grad).sum(), inputs)
    parts = HeadParts(weight, bias, segments)
    got = fused_head.fused_target_logprobs(parts, hidden, targets, softcap)
    got_grads = torch.autograd.grad((got * grad).sum(), inputs)
    assert (got - want).abs().max().item() < 1e-5
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g - w).abs().max().item() < 1e-5 * max(1.0, w.abs().max().item())


@pytest.mark.parametrize("kept", [True, False])
def test_joined_inputs_give_the_bits_of_per_tile_copies(
    monkeypatch: pytest.MonkeyPatch, kept: bool
) -> None:
    """bf16, one adapter over rows 20-150 and base rows around it, tiles of 64 rows by 300
    columns: [x | low] joined once a pass and [W | B] once a vocabulary chunk give the logprobs
    and gradients that copying both for each tile gives, bit for bit."""
    _small_tiles(monkeypatch, kept)
    weight, hidden, low, b, targets, grad = _one_adapter_case(2, torch.bfloat16)

    def run() -> list[torch.Tensor]:
        parts = HeadParts(weight, None, [Segment(20, 150, low, b)])
        got = fused_head.fused_target_logprobs(parts, hidden, targets, None)
        return [got, *torch.autograd.grad((got * grad).sum(), (hidden, low, b))]

    joined = run()
    monkeypatch.setattr(fused_head, "_Joined", lambda *args: None)
    copied = run()
    for j, c in zip(joined, copied, strict=True):
        assert torch.equal(j, c)


def test_live_runs_are_the_rows_with_a_gradient() -> None:
    g = torch.zeros(10, 2)
    g[2:4, 0] = 1.0
    g[6, 1] = float("nan")  # (a NaN gradient is a gradient: it must reach the weights)
    g[9] = -2.0
    assert fused_head._live_runs(g, torch.device("cpu")) == [(2, 4), (6, 7), (9, 10)]
    assert fused_head._live_runs(torch.ones(5, 1), torch.device("cpu")) is None
    assert fused_head._live_runs(torch.zeros(5, 1), torch.device("cpu")) == []
    assert list(fused_head._within([(2, 4), (6, 12)], 3, 8)) == [(3, 4), (6, 8)]
    assert list(fused_head._within(None, 3, 8)) == [(3, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kept", [True, False])
def test_rows_without_a_gradient_are_left_out_of_the_backward_pass(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, kept: bool
) -> None:
    """Prompt-like runs of rows whose logprobs get no gradient (across tile bounds, within an
    adapted segment and outside it), tiles of 64 rows by 300 columns: the backward pass runs
    only the rows with a gradient (none where there is none); the logprobs, d hidden and d
    low as with every row run, bit for bit, the left-out rows' d hidden zero; d B (a sum
    over rows) bit for bit at fp32, within a bf16 rounding at bf16; a pass with no gradient at
    all gives zeros."""
    _small_tiles(monkeypatch, kept)
    weight, hidden, low, b, targets, grad = _one_adapter_case(3, dtype)
    grad[:40] = 0  # a prompt before the adapted rows
    grad[60:75] = 0  # one across the first tile's end, inside the segment
    grad[160:] = 0  # padding at the end

    def run(g: torch.Tensor) -> list[torch.Tensor]:
        parts = HeadParts(weight, None, [Segment(20, 150, low, b)])
        got = fused_head.fused_target_logprobs(parts, hidden, targets, None)
        return [got, *torch.autograd.grad((got * g).sum(), (hidden, low, b))]

    ran: list[int] = []  # the rows of each tile the backward pass ran
    real = fused_head._backward_tile
    monkeypatch.setattr(
        fused_head,
        "_backward_tile",
        lambda raw, tile, *a: ran.append(tile[1] - tile[0]) or real(raw, tile, *a),
    )
    chunks = -(-1000 // 300)
    skipped = run(grad)
    assert sum(ran) == (170 - 40 - 15 - 10) * chunks  # only the rows with a gradient
    assert not skipped[1][:40].any()
    assert not skipped[1][60:75].any()
    ran.clear()
    assert not run(torch.zeros_like(grad))[1].any()
    assert not ran
    monkeypatch.setattr(fused_head, "_live_runs", lambda g, device: None)
    every = run(grad)
    assert sum(ran) == 170 * chunks
    for s, e in zip(skipped[:3], every[:3], strict=True):  # logprobs, d hidden, d low: by row
        assert torch.equal(s, e)
    # d B sums over rows: at bf16 each run's part of a tile is its own product, rounded
    bound = 0.0 if dtype == torch.float32 else 2**-7 * every[3].float().abs().max().item()
    assert (skipped[3].float() - every[3].float()).abs().max().item() <= bound
