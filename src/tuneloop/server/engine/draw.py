"""The batched, on-device draw of one decode step: every row's token in one set of tensor ops.

A row's randomness is counter-based: its uniform for the draw at position `p` is a hash of
(the row's 64-bit seed, p), computed on the device. A row's token therefore depends on its seed,
its position and its own logits only, never on which rows share the step or in which order, and
the step needs no per-row random generator on the host (the draw used to call `torch.rand` once
per row per step, a host round trip each on an accelerator).

The draw is the inverse CDF of the row's tempered (and top-k/top-p filtered) distribution at
that uniform: one uniform per row, one `cumsum` and one `searchsorted` for the whole batch.
Filtered rows are drawn in sorted order, the filters being prefixes of it; they are sorted
apart, so rows without filters (the common case) never pay for a sort of the vocabulary.

Everything the host needs from a step (token, its logprob, whether the row's logits were
finite, whether the token is one of the row's stop tokens, the top-k logprobs asked for) is
packed into one tensor and copied once (`StepDraw.fetch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["GREEDY_BELOW", "DrawParams", "StepDraw", "draw", "uniforms"]

# Temperatures this close to 0 are greedy: dividing fp32 logits by them overflows to inf (NaN
# probabilities).
GREEDY_BELOW = 1e-5
_M32 = 0xFFFFFFFF


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


def draw(
    logits: torch.Tensor, params: DrawParams, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's token [R] int64 and the step's log-softmax [R, V] (temperature 1: the logprob
    reported is the model's own, as the training forward pass computes it)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    probs = torch.softmax(logits / params.temperature[:, None], dim=-1)
    u = uniforms(params.seed_lo, params.seed_hi, positions)
    cdf = probs.cumsum(-1)
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1)
    chosen = chosen.clamp(max=logits.shape[-1] - 1)
    if params.filters is not None:
        rows, top_k, top_p = params.filters
        picked = _filtered_draw(probs.index_select(0, rows), top_k, top_p, u[rows])
        chosen = chosen.index_copy(0, rows, picked)
    if params.any_greedy:
        chosen = torch.where(params.greedy, logits.argmax(-1), chosen)
    return chosen, logprobs


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
        chosen, logprobs = draw(logits, params, positions)
        columns = [
            chosen.to(torch.float64),  # token ids < 2**53: exact
            logprobs.gather(1, chosen[:, None])[:, 0].to(torch.float64),
            torch.isfinite(logits).all(-1).to(torch.float64),
            (chosen[:, None] == params.stop_ids).any(-1).to(torch.float64),
        ]
        width = params.topk_width
        if width:
            values, ids = torch.topk(logprobs, width, dim=-1)
            packed = torch.cat(
                [torch.stack(columns, 1), ids.to(torch.float64), values.to(torch.float64)], 1
            )
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
