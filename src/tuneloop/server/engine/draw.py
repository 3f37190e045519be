"""The batched, on-device draw of one decode step: every row's token in one set of tensor ops.

A row's randomness is counter-based: its uniform for the draw at position `p` is a hash of
(the row's 64-bit seed, p), computed on the device. A row's token therefore depends on its seed,
its position and its own logits only, never on which rows share the step or in which order, and
the step needs no per-row random generator on the host (the draw used to call `torch.rand` once
per row per step, a host round trip each on an accelerator).

The draw is the inverse CDF of the row's tempered (and top-k/top-p filtered) distribution at
that uniform, one uniform per row. Unfiltered rows search it in two levels: the sums of blocks
of `_BLOCK` tokens locate the block, and only that block is summed token by token, so a step
makes no cumulative sum over the whole vocabulary. Filtered rows are drawn in sorted order, the
filters being prefixes of it; they are sorted apart, so rows without filters (the common case)
never pay for a sort of the vocabulary.

A step reads the [R, V] logits a few times only (on an AVX2 CPU each full pass over 128 x
49,152 fp32 costs about as much as the rest of the draw): the block maxima (the row's max, its
argmax, and with the row's minimum whether it is finite), one softmax (the probabilities, and
at the argmax the normaliser 1 / sum(exp(logits - max)), hence the row's logsumexp), the block
sums. A token's logprob is its logit minus the logsumexp, never a [R, V] log-softmax; rows
with a temperature other than 1 cost a second exp pass, of the tempered logits. The logsumexp
comes from the softmax rather than from a sum of our own: log_softmax adds its exponentials in
the same order, so the two agree to ~1e-7 where an fp32 sum in another order (the block sums)
differs from theirs by up to ~1e-5 at 49,152 tokens.

On a CPU the rows are drawn by C++ calls instead (native_draw.py): the same two-level inverse
CDF and logsumexp in two passes over the logits, and for rows with top-k or top-p the same
filters over a sort of the row's candidates only (tied probabilities in ascending token order,
which torch's sort leaves unspecified).

Everything the host needs from a step (token, its logprob, whether the row's logits were
finite, whether the token is one of the row's stop tokens, the top-k logprobs asked for) is
packed into one tensor and copied once (`StepDraw.fetch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tuneloop.server.engine import native_draw

__all__ = ["GREEDY_BELOW", "DrawParams", "StepDraw", "draw", "uniforms"]

# Temperatures this close to 0 are greedy: dividing fp32 logits by them overflows to inf (NaN
# probabilities).
GREEDY_BELOW = 1e-5
_M32 = 0xFFFFFFFF
# Tokens per block of the two-level inverse CDF, argmax and top-k: 192 blocks of SmolLM2's 49,152
# tokens, so both levels ([R, 192] and [R, 256]) are small next to a pass over [R, V], and at 128
# rows each stays under torch's 32,768-element grain (one thread: no fork on a busy CPU).
_BLOCK = 256


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without int64 overflow: c is split
    in 16-bit halves, so every product stays below 2**48."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (full avalanche) on int64 tensors holding uint32."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1] per row from (seed halves, position), all int64 in [0, 2**32).

    24 bits: the float32 CDF it is compared with resolves no finer. (0, 1], not [0, 1): the
    first index whose CDF reaches u * total then always has a probability above 0.
    """
    h = _fmix32(seed_lo ^ _mul32(position & _M32, 0x9E3779B1))
    h = _fmix32(h ^ seed_hi)
    h = _fmix32(h ^ ((position >> 32) & _M32) ^ 0x68E31DA4)
    return ((h >> 8) + 1).to(torch.float32) / float(1 << 24)


@dataclass
class DrawParams:
    """The sampling parameters of a step's rows as device tensors, built when the rows change
    (a decode batch keeps its rows for many steps)."""

    seed_lo: torch.Tensor  # [R] int64
    seed_hi: torch.Tensor  # [R] int64
    temperature: torch.Tensor  # [R] fp32 (1 where greedy)
    greedy: torch.Tensor  # [R] bool
    stop_ids: torch.Tensor  # [R, S] int64, padded with -1
    # The rows with top-k or top-p ([F] int64), their k ([F] int64, the vocabulary where 0)
    # and their p ([F] fp32); None where no row filters.
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    any_greedy: bool
    any_tempered: bool  # a row draws at a temperature other than 1 (a second softmax)
    topk_width: int  # the most top-k logprobs a row asks for (0: none)

    @classmethod
    def build(
        cls,
        seeds: Sequence[int],
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        stop_ids: Sequence[Sequence[int]],
        topk_width: int,
        vocab: int,
        device: torch.device,
    ) -> DrawParams:
        greedy = [t < GREEDY_BELOW for t in temperatures]
        width = max(1, max((len(s) for s in stop_ids), default=1))
        stops = [[*s, *([-1] * (width - len(s)))] for s in stop_ids]
        filtered = [
            i
            for i, (k, p) in enumerate(zip(top_ks, top_ps, strict=True))
            if 0 < k < vocab or p < 1.0
        ]

        def put(values: Sequence[float | int | bool], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        filters = None
        if filtered:
            ks = [top_ks[i] if 0 < top_ks[i] < vocab else vocab for i in filtered]
            ps = [min(1.0, top_ps[i]) for i in filtered]
            filters = (put(filtered, torch.long), put(ks, torch.long), put(ps, torch.float))
        tempered = [1.0 if g else t for g, t in zip(greedy, temperatures, strict=True)]

        return cls(
            seed_lo=put([s & _M32 for s in seeds], torch.long),
            seed_hi=put([(s >> 32) & _M32 for s in seeds], torch.long),
            temperature=put(tempered, torch.float),
            greedy=put(greedy, torch.bool),
            stop_ids=torch.tensor(stops, dtype=torch.long).to(device, non_blocking=True),
            filters=filters,
            any_greedy=any(greedy),
            any_tempered=any(t != 1.0 for t in tempered),
            topk_width=min(topk_width, vocab),
        )


def _filtered_draw(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Draws of rows [F, V] under their top-k, then top-p on what top-k kept (vLLM's and the
    Tinker service's order), in descending order of probability. Ties with the k-th
    probability are kept (the k best by value, not by index)."""
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    kth = ordered.gather(1, (top_k - 1)[:, None])
    ordered = torch.where(ordered >= kth, ordered, torch.zeros_like(ordered))
    total = ordered.sum(-1, keepdim=True)
    before = ordered.cumsum(-1) / total - ordered / total  # probability mass above each token
    drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    ordered = ordered.masked_fill(drop, 0.0)
    cdf = ordered.cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=probs.shape[-1] - 1)
    return order.gather(1, picked).squeeze(1)


def _per_block(t: torch.Tensor, block: int, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """`reduce` (torch.sum, torch.amax) over each `block` consecutive entries of every row of
    t [R, V]: [R, ceil(V / block)], the last block ragged where V is not a multiple of it (a
    padded copy would cost a pass over [R, V])."""
    rows, vocab = t.shape
    full = vocab - vocab % block
    parts = [reduce(t[:, :full].reshape(rows, full // block, block), dim=-1)] if full else []
    if full < vocab:
        parts.append(reduce(t[:, full:], dim=-1, keepdim=True))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def _blocks_of(
    t: torch.Tensor, index: torch.Tensor, block: int, fill: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i's blocks `index[i]` ([R, n]) of t [R, V], side by side ([R, n * block], entries
    past V set to `fill`), and the columns they were read from ([R, n * block] int64, past V
    clamped to V - 1)."""
    vocab = t.shape[-1]
    cols = (index[:, :, None] * block + torch.arange(block, device=t.device)).flatten(1)
    inside = cols < vocab
    cols = cols.clamp(max=vocab - 1)
    return t.gather(1, cols).masked_fill(~inside, fill), cols


def _first_reaching(cdf: torch.Tensor, target: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Per row of cdf [R, N] (the cumulative sums of mass [R, N] >= 0), the first index whose
    cdf reaches target [R] among those with mass > 0, else the last with mass > 0.

    With a sequential cumsum and target > 0 this is `searchsorted(cdf, target)`: the first
    index reaching the target always holds mass. Written out, an index without mass is never
    returned whatever order the device's cumsum adds in, and a target past the last sum
    (rounding) gives the last index that holds mass rather than a clamped one that may not."""
    size = cdf.shape[-1]
    at = torch.arange(size, device=cdf.device)
    held = mass > 0
    first = torch.where((cdf >= target[:, None]) & held, at, size).amin(-1)
    last = torch.where(held, at, -1).amax(-1)
    return torch.where(first < size, first, last).clamp(min=0)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of probs [R, V] (not necessarily normalised), the first token whose cumulative
    probability reaches u * total, u [R] in (0, 1]; never a token of probability 0.

    Two levels: the block sums [R, V / block] and their cumsum give the block and the mass
    before it; the chosen block alone is gathered ([R, block]) and summed token by token. The
    flat cumsum this replaces adds in another order, so the two can differ where u * total
    lies within rounding (~1e-7 relative) of a token's boundary."""
    block = min(_BLOCK, probs.shape[-1])
    sums = _per_block(probs, block, torch.sum)  # [R, blocks]
    cdf = sums.cumsum(-1)
    target = u * cdf[:, -1]
    index = _first_reaching(cdf, target, sums)
    before = cdf.gather(1, (index - 1).clamp(min=0)[:, None])[:, 0]
    before = torch.where(index > 0, before, torch.zeros_like(before))
    inside, cols = _blocks_of(probs, index[:, None], block, 0.0)  # [R, block]
    within = _first_reaching(inside.cumsum(-1), target - before, inside)
    return cols.gather(1, within[:, None])[:, 0]


def _row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's largest logit [R], the first index holding it [R] int64 (torch.argmax's
    tie-break) and the block maxima [R, V / block], from the block maxima and the argmax inside
    the best block: one read of the logits (`torch.max` with indices costs ~5x an `amax` on
    an AVX2 CPU, `aminmax` ~7x). A NaN propagates to the max."""
    block = min(_BLOCK, logits.shape[-1])
    maxima = _per_block(logits, block, torch.amax)  # [R, blocks]
    inside, cols = _blocks_of(logits, maxima.argmax(-1)[:, None], block, float("-inf"))
    return maxima.amax(-1), cols.gather(1, inside.argmax(-1)[:, None])[:, 0], maxima


def _top_logits(
    logits: torch.Tensor, maxima: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(logits, width)` from the `width` blocks with the largest maxima (they hold
    the `width` largest logits: a block outside them has `width` better maxima above its
    own), without a pass over [R, V]. Equal logits may come in another order."""
    block = min(_BLOCK, logits.shape[-1])
    if width * block >= logits.shape[-1]:
        return torch.topk(logits.float(), width, dim=-1)
    best = torch.topk(maxima, width, dim=-1).indices  # [R, width]
    inside, cols = _blocks_of(logits, best, block, float("-inf"))  # [R, width * block]
    values, at = torch.topk(inside.float(), width, dim=-1)  # (bf16 logits: exact in fp32)
    return values, cols.gather(1, at)


def _draw(
    logits: torch.Tensor, params: DrawParams, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`draw`, and the block maxima of the logits (`_row_max`)."""
    top, top_at, maxima = _row_max(logits)
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    # softmax's largest probability is exp(0) / sum(exp(logits - max)): log(sum) without a
    # second exp pass. In fp64: a logprob then differs from log_softmax's fp32 one by < 1e-6
    # where |logprob| < 8, by about one fp32 rounding step of the value above (its own error).
    logsumexp = top.double() - probs.gather(1, top_at[:, None])[:, 0].double().log()
    if params.any_tempered:  # greedy rows hold temperature 1
        # The tempered logits go into the softmax's memory (used up). Division and the
        # row-wise softmax give a row the same bits whatever rows share the step, its rows at
        # temperature 1 the plain path's; an elementwise exp would not (on the CPU its vector
        # and scalar paths may round apart, and which elements take which depends on R * V).
        probs = torch.softmax(torch.div(logits, params.temperature[:, None], out=probs), dim=-1)
    u = uniforms(params.seed_lo, params.seed_hi, positions)
    chosen = _inverse_cdf(probs, u)
    if params.filters is not None:
        rows, top_k, top_p = params.filters
        picked = _filtered_draw(probs.index_select(0, rows), top_k, top_p, u[rows])
        chosen = chosen.index_copy(0, rows, picked)
    if params.any_greedy:
        chosen = torch.where(params.greedy, top_at, chosen)
    return chosen, logsumexp, maxima


def draw(
    logits: torch.Tensor, params: DrawParams, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's token [R] int64 and its logits' logsumexp [R] fp64 at temperature 1: a
    token's logprob is its logit minus it, the model's own, as the training forward pass
    computes it. The logsumexp is finite exactly where the row's largest logit is (a NaN or
    +inf there makes the softmax NaN; a finite max makes the normaliser lie in [1, V])."""
    chosen, logsumexp, _ = _draw(logits, params, positions)
    return chosen, logsumexp


@dataclass
class StepDraw:
    """What the host gets from one step, per row, from a single device-to-host copy."""

    tokens: list[int]
    logprobs: list[float]
    finite: list[bool]
    stop_hit: list[bool]
    topk: list[list[tuple[int, float]]] | None  # [R][width], best first

    @classmethod
    def fetch(cls, logits: torch.Tensor, params: DrawParams, positions: torch.Tensor) -> StepDraw:
        """The step's draw from its logits [R, V]: fp32, or on a CPU whose native draw
        takes them the head's own bf16 output."""
        if native_draw.takes(logits):
            chosen, logsumexp, finite, maxima = _native(logits, params, positions)
        else:
            logits = logits.float()
            chosen, logsumexp, maxima = _draw(logits, params, positions)
            # Any NaN or infinity in a row shows in its max (hence its logsumexp) or its min.
            finite = torch.isfinite(logsumexp) & torch.isfinite(logits.amin(-1))
        columns = [
            chosen.to(torch.float64),  # token ids < 2**53: exact
            logits.gather(1, chosen[:, None])[:, 0].to(torch.float64) - logsumexp,
            finite.to(torch.float64),
            (chosen[:, None] == params.stop_ids).any(-1).to(torch.float64),
        ]
        width = params.topk_width
        if width:
            # the top logits are the top logprobs: they differ by the row's logsumexp
            values, ids = _top_logits(logits, maxima, width)
            values = values.to(torch.float64) - logsumexp[:, None]
            packed = torch.cat([torch.stack(columns, 1), ids.to(torch.float64), values], 1)
        else:
            packed = torch.stack(columns, 1)
        host = _to_host(packed).tolist()  # the step's one copy
        topk = None
        if width:
            topk = [
                [(int(i), v) for i, v in zip(r[4 : 4 + width], r[4 + width :], strict=True)]
                for r in host
            ]
        return cls(
            [int(r[0]) for r in host],
            [r[1] for r in host],
            [r[2] == 1.0 for r in host],
            [r[3] == 1.0 for r in host],
            topk,
        )


def _native(
    logits: torch.Tensor, params: DrawParams, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_draw` and the rows' finiteness by the native kernels (native_draw.py): every row by
    one call, then the rows with top-k or top-p by a second (torch's sort of their rows took
    ~330 ms a step of 128 rows x 49,152 tokens; the kernel sorts only a row's candidates)."""
    u = uniforms(params.seed_lo, params.seed_hi, positions)
    block = min(_BLOCK, logits.shape[-1])
    chosen, logsumexp, finite, maxima = native_draw.draw(
        logits, u, params.temperature, params.greedy, block
    )
    if params.filters is not None:
        rows, top_k, top_p = params.filters
        picked = native_draw.draw_filtered(
            logits, rows, u[rows], params.temperature[rows], top_k, top_p
        )
        # (greedy rows keep their argmax; a row not finite keeps the report of the call above)
        keep = params.greedy[rows] | (picked < 0)
        chosen = chosen.index_copy(0, rows, torch.where(keep, chosen[rows], picked))
    return chosen, logsumexp, finite, maxima


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """The tensor on the host: on CUDA through pinned memory, waited on by an event (the
    stream's other work is not synchronised); elsewhere as it is."""
    if t.device.type != "cuda":
        return t
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return pinned
