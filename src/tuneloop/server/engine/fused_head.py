"""The LM head over vocabulary chunks: its matmul, its LoRA product and its log-softmax fused.

On a small model the head dominates: SmolLM2's (vocab 49152, width 576) is a third of a training
step and a fifth of a decode step on a CPU. Run as `head(hidden)` it makes several passes over a
[tokens, vocab] tensor far larger than any cache: the base matmul (measured at 0.4-0.7x of the
same FLOPs on cache-sized outputs), the LoRA up-projection into a second such tensor, their sum,
then the log-softmax. Here the vocabulary is cut into chunks whose logits stay in cache: per chunk
one matmul, the LoRA product added into it by `addmm` while it is hot and, for training, an
online logsumexp and the targets' logits read from it. The backward pass needs the logits
again: a batch whose logits fit in SAVED_LOGITS_BYTES keeps its tiles (reading them back costs
far less than the matmul); a larger one recomputes each tile (one more matmul per tile, as the
activation checkpointing of the head's position chunks did before), so no [tokens, vocab]
tensor ever exists for it.

Only a plain head takes this path: an `nn.Linear`, or a `LoRALinear` over one, with no hooks
but FSDP2's (a sharded head's weight is gathered here with `unshard` for each pass, as its own
forward's hook would; other hooks keep the module's own forward).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tuneloop.server.engine import cpu_fp32_matmul, native_head
from tuneloop.server.engine.lora import native_grads
from tuneloop.server.engine.lora.linear import LoRALinear
from tuneloop.server.engine.lora.ops import HALF, shrink, summed_linear
from tuneloop.server.engine.memory import SAVED_LOGITS_BYTES

__all__ = ["HeadParts", "chunked_logits", "fused_target_logprobs", "head_parts"]

# A tile on a CPU: at most ROWS rows by COLUMNS columns of vocabulary (512 x 1024 fp32 logits
# are 2 MB, with the weight's 1024 rows streamed through): the output stays in cache for the
# LoRA product and the exponentials, and the matmul keeps its large-shape rate.
ROWS = 512
COLUMNS = 1024
# Accelerators gain nothing from cache-sized tiles and pay a launch per operation: large ones.
DEVICE_CHUNK_ELEMENTS = 1 << 26
DEVICE_ROWS = 1 << 16


@dataclass
class Segment:
    """Rows [start, end) of the flattened input and their adapter's factors in the compute dtype:
    `low` = scale * x @ A.T ([rows, r], part of the autograd graph) and B [vocab, r]."""

    start: int
    end: int
    low: torch.Tensor
    b: torch.Tensor


@dataclass
class HeadParts:
    """The head's frozen weight [V, d] and bias, or the FSDP2 module that gathers them, and its
    LoRA segments."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    segments: list[Segment]
    sharded: Any = None  # an FSDPModule: weight and bias come from it, gathered per pass
    # Whether a half-precision tile of one adapter sums the delta with the base before
    # rounding (`_tile`): for passes over many tokens, not sampling steps, where its copy of
    # the weight tile per call would cost more than the step.
    exact_delta: bool = True

    @property
    def vocab(self) -> int:
        return int(self.sharded.out_features if self.weight is None else self.weight.shape[0])

    @contextlib.contextmanager
    def gathered(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) whole for the length of a pass."""
        if self.sharded is None:
            assert self.weight is not None
            yield self.weight, self.bias
            return
        self.sharded.unshard()  # collective: every rank runs the same passes in the same order
        try:
            yield self.sharded.weight, self.sharded.bias
        finally:
            self.sharded.reshard()


def _plain(module: nn.Module) -> bool:
    return not (module._forward_hooks or module._forward_pre_hooks)


def _fsdp(module: nn.Module) -> Any:
    """`module` where it is an FSDP2 module (its hooks are FSDP's own), else None."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return module if isinstance(module, FSDPModule) else None


def head_parts(head: nn.Module, hidden: torch.Tensor) -> HeadParts | None:
    """The head's weight and, per routed segment of `hidden` ([N, d]), its LoRA factors; None
    where the head is not a plain Linear or runs a decode step's lone-key or shared weights
    (then `head(hidden)` is the way)."""
    base = head.base if isinstance(head, LoRALinear) else head
    if not isinstance(base, nn.Linear) or not _plain(head):
        return None
    sharded = _fsdp(base)
    if sharded is None and (type(base) is not nn.Linear or not _plain(base)):
        return None
    weight = None if sharded is not None else base.weight
    bias = None if sharded is not None else base.bias
    segments: list[Segment] = []
    if isinstance(head, LoRALinear):
        routing = head.routing
        lone = getattr(routing, "lone", None)
        if lone and id(head) in lone:
            return None  # the decode step's one matmul (lora/fused.py), by the module's forward
        shared = getattr(routing, "shared", None)
        if shared and id(head) in shared:
            return None  # the base part on the packed copy, by the module's forward too
        runs = getattr(routing, "runs", None)
        if runs:
            start = 0
            for (key, _, _), size in zip(runs, routing.sizes(hidden.shape[0]), strict=True):  # type: ignore[attr-defined]
                factors = head.lookup_as(key, hidden.dtype)
                if factors is not None:
                    low = shrink(hidden[start : start + size], factors)
                    segments.append(Segment(start, start + size, low, factors[1]))
                start += size
    exact = not getattr(head.routing, "steps", False) if isinstance(head, LoRALinear) else True
    return HeadParts(weight, bias, segments, sharded, exact)


def _tiles(rows: int, vocab: int, device: torch.device) -> Iterator[tuple[int, int, int, int]]:
    """(r0, r1, v0, v1). On a CPU, vocabulary chunks each cut into row pieces: a chunk's weight
    rows, joined with an adapter's B, serve all the pieces (`_Joined`). A row still meets the
    chunks in vocabulary order, so its running statistics and gradients sum in the same order
    as row pieces cut into chunks would. On an accelerator, row pieces cut into chunks."""
    if device.type == "cpu":
        for v0 in range(0, vocab, COLUMNS):
            for r0 in range(0, rows, ROWS):
                yield r0, min(rows, r0 + ROWS), v0, min(vocab, v0 + COLUMNS)
        return
    for r0 in range(0, rows, DEVICE_ROWS):
        r1 = min(rows, r0 + DEVICE_ROWS)
        step = max(1, DEVICE_CHUNK_ELEMENTS // (r1 - r0))
        for v0 in range(0, vocab, step):
            yield r0, r1, v0, min(vocab, v0 + step)


class _Joined:
    """`summed_linear`'s two inputs without its two copies per tile: [x | low] of a segment's
    rows, made once a pass, and [W | B] of the current vocabulary chunk, made once a chunk.
    The same matmul of the same values: the same bits. SmolLM2's head over 1,233 rows (48
    chunks, bf16, an AMX Xeon) took 73.4 ms forward against 86.5 ms copied per tile, the
    backward unchanged (bench/train_variants.py --micro)."""

    def __init__(self, x: torch.Tensor, parts: HeadParts, lows: Sequence[torch.Tensor]):
        self._x, self._parts, self._lows = x, parts, lows
        self._inputs: dict[int, torch.Tensor] = {}
        self._weights: dict[int, tuple[int, torch.Tensor]] = {}

    def input(self, i: int) -> torch.Tensor:
        if i not in self._inputs:
            seg = self._parts.segments[i]
            self._inputs[i] = torch.cat([self._x[seg.start : seg.end], self._lows[i]], dim=1)
        return self._inputs[i]

    def weight(self, i: int, w: torch.Tensor, v0: int) -> torch.Tensor:
        held = self._weights.get(i)
        if held is None or held[0] != v0:
            b = self._parts.segments[i].b[v0 : v0 + w.shape[0]]
            held = self._weights[i] = (v0, torch.cat([w, b], dim=1))
        return held[1]


def _tile(
    x: torch.Tensor,
    head: tuple[torch.Tensor, torch.Tensor | None],
    parts: HeadParts,
    lows: Sequence[torch.Tensor],
    tile: tuple[int, int, int, int],
    into: torch.Tensor | None = None,
    joined: _Joined | None = None,
) -> torch.Tensor:
    """Logits [r1 - r0, v1 - v0] of rows r0:r1 of `x` and vocabulary columns v0:v1, LoRA
    included; `head` is the gathered (weight, bias). `into`: a view of that shape in x's dtype
    to write them to (a slice of the whole logits: BLAS writes strided rows, no copy).
    `joined`: the pass's joined inputs, where the tiles come in `_tiles`' order."""
    r0, r1, v0, v1 = tile
    w, bias = head[0][v0:v1], head[1]
    whole = [i for i, seg in enumerate(parts.segments) if seg.start <= r0 and r1 <= seg.end]
    if into is None and x.dtype in HALF and whole and parts.exact_delta:
        # One adapter over the tile's rows at half precision: [x | low] @ [W | B].T, the delta
        # summed with the base before the logits are rounded (lora/ops.py's one-adapter node).
        i, seg = whole[0], parts.segments[whole[0]]
        cut = None if bias is None else bias[v0:v1]
        if joined is None:
            rows = lows[i][r0 - seg.start : r1 - seg.start]
            return summed_linear(x[r0:r1], rows, w, seg.b[v0:v1], cut)
        inputs = joined.input(i)[r0 - seg.start : r1 - seg.start]
        return torch.nn.functional.linear(inputs, joined.weight(i, w, v0), cut)
    if into is not None:
        out = cpu_fp32_matmul.linear_into(x[r0:r1], w, into)
        if bias is not None:
            out.add_(bias[v0:v1])
    else:
        out = cpu_fp32_matmul.linear(x[r0:r1], w, None if bias is None else bias[v0:v1])
    for seg, low in zip(parts.segments, lows, strict=True):
        s0, s1 = max(seg.start, r0), min(seg.end, r1)
        if s0 < s1:
            out[s0 - r0 : s1 - r0].addmm_(low[s0 - seg.start : s1 - seg.start], seg.b[v0:v1].t())
    return out


def chunked_logits(parts: HeadParts, hidden: torch.Tensor) -> torch.Tensor:
    """The head's logits [N, V] in fp32, computed tile by tile (no autograd)."""
    rows, vocab = hidden.shape[0], parts.vocab
    out = torch.empty((rows, vocab), dtype=torch.float32, device=hidden.device)
    lows = [seg.low for seg in parts.segments]
    direct = hidden.dtype == torch.float32
    with parts.gathered() as head:
        joined = _Joined(hidden, parts, lows)
        for tile in _tiles(rows, vocab, hidden.device):
            r0, r1, v0, v1 = tile
            if direct:
                _tile(hidden, head, parts, lows, tile, out[r0:r1, v0:v1])
            else:
                out[r0:r1, v0:v1] = _tile(hidden, head, parts, lows, tile, joined=joined)
    return out


def _capped(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    x = x.float()
    return torch.tanh(x / softcap) * softcap if softcap else x


_LOG2_E = 1.0 / math.log(2.0)

# `_FusedHead.apply`'s leading inputs before the factors: parts, targets, softcap, keep, hidden.
_LEADING = 5


class _FusedHead(torch.autograd.Function):
    """log_softmax(head(hidden))[targets] in fp32, the logsumexp accumulated online over chunks.

    Inputs: hidden [N, d], then each segment's `low` and B. Backward, per tile of logits z
    (kept or recomputed): d z = g at the targets - (sum_k g_k) x softmax(z); d hidden += d z @ W,
    d low += d z @ B, d B += d z.T @ low.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        parts: HeadParts,
        targets: torch.Tensor,
        softcap: float | None,
        keep: bool,
        hidden: torch.Tensor,
        *factors: torch.Tensor,
    ) -> torch.Tensor:
        lows = factors[0::2]
        rows, vocab = hidden.shape[0], parts.vocab
        device = hidden.device
        high = torch.full((rows,), float("-inf"), dtype=torch.float32, device=device)
        total = torch.zeros((rows,), dtype=torch.float32, device=device)
        picked = torch.zeros(targets.shape, dtype=torch.float32, device=device)
        kept: list[torch.Tensor] = []
        targets = targets.contiguous()
        with parts.gathered() as head:
            joined = _Joined(hidden, parts, lows)
            for tile in _tiles(rows, vocab, device):
                raw = _tile(hidden, head, parts, lows, tile, joined=joined)
                if keep:
                    kept.append(raw)
                if native_head.takes(raw, softcap):  # (the same statistics in one pass)
                    native_head.forward_tile(raw, tile, targets, high, total, picked)
                    continue
                z = _capped(raw, softcap)
                _forward_tile(z, tile, targets, high, total, picked)
        lse = high + torch.log(total)
        ctx.save_for_backward(targets, lse, hidden, *factors)
        ctx.kept = kept  # type: ignore[attr-defined]  # intermediates, never modified in place
        ctx.parts = parts  # type: ignore[attr-defined]
        ctx.softcap = softcap  # type: ignore[attr-defined]
        return picked - lse[:, None]

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        targets, lse, hidden, *factors = ctx.saved_tensors  # type: ignore[attr-defined]
        parts: HeadParts = ctx.parts  # type: ignore[attr-defined]
        softcap = ctx.softcap  # type: ignore[attr-defined]
        lows, bs = factors[0::2], factors[1::2]
        wants_b = ctx.needs_input_grad[_LEADING + 1 :: 2]  # type: ignore[attr-defined]
        rows, vocab = hidden.shape[0], parts.vocab
        g = grad.float().contiguous()  # (a gradient may arrive expanded)
        g_sum = g.sum(-1, keepdim=True)
        # gradients accumulate over chunks in fp32 (in place by addmm where that is the dtype)
        exact = hidden.dtype == torch.float32
        d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        d_lows = [torch.zeros(low.shape, dtype=torch.float32, device=low.device) for low in lows]
        d_bs = [
            torch.zeros(b.shape, dtype=torch.float32, device=b.device) if want else None
            for b, want in zip(bs, wants_b, strict=True)
        ]
        kept: list[torch.Tensor] = ctx.kept  # type: ignore[attr-defined]
        runs = _live_runs(g, hidden.device)
        with parts.gathered() as head:
            joined = _Joined(hidden, parts, lows)
            for i, whole in enumerate(_tiles(rows, vocab, hidden.device)):
                r0, r1, v0, v1 = whole
                logits = kept[i] if kept else None
                for a, b_end in _within(runs, r0, r1):
                    if logits is None:  # (the forward's tile: the logits it summed)
                        logits = _tile(hidden, head, parts, lows, whole, joined=joined)
                    tile, raw = (a, b_end, v0, v1), logits[a - r0 : b_end - r0]
                    _backward_tile(
                        raw, tile, head, parts, lows, bs, targets, lse, g, g_sum, softcap,
                        exact, d_hidden, d_lows, d_bs,
                    )  # fmt: skip
        out: list[torch.Tensor | None] = [None] * (_LEADING - 1) + [d_hidden.to(hidden.dtype)]
        for d_low, d_b, low, b in zip(d_lows, d_bs, lows, bs, strict=True):
            out += [d_low.to(low.dtype), None if d_b is None else d_b.to(b.dtype)]
        return tuple(out)


def _live_runs(g: torch.Tensor, device: torch.device) -> list[tuple[int, int]] | None:
    """The runs [start, end) of rows whose logprobs have a gradient (any nonzero or NaN entry
    of g), or None where every row has one or the head is not on a CPU. A row of zero gradient
    (a prompt token of a masked SFT datum or an RL sample, a bucket's padding) has a zero
    logits gradient, d hidden, d low and d B: its tiles' softmax and products are left out, and
    without kept logits so is its recompute. The rows kept give the values they gave with the
    others (row by row the same sums). On an accelerator one launch over a tile costs what it
    costs, so every row runs there, without the host reading g. A tile of both kinds of rows
    is recomputed whole where its logits were not kept: its live rows get the logits the
    forward pass summed."""
    if device.type != "cpu":
        return None
    live = (g != 0).any(-1)
    if bool(live.all()):
        return None
    edges = torch.diff(live.to(torch.int8), prepend=live.new_zeros(1, dtype=torch.int8),
                       append=live.new_zeros(1, dtype=torch.int8))  # fmt: skip
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends, strict=True))


def _within(runs: list[tuple[int, int]] | None, r0: int, r1: int) -> Iterator[tuple[int, int]]:
    """The parts of rows [r0, r1) that `runs` cover (all of them where runs is None)."""
    if runs is None:
        yield r0, r1
        return
    for start, end in runs:
        a, b = max(start, r0), min(end, r1)
        if a < b:
            yield a, b


def _backward_tile(
    raw: torch.Tensor,
    tile: tuple[int, int, int, int],
    head: tuple[torch.Tensor, torch.Tensor | None],
    parts: HeadParts,
    lows: Sequence[torch.Tensor],
    bs: Sequence[torch.Tensor],
    targets: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    g_sum: torch.Tensor,
    softcap: float | None,
    exact: bool,
    d_hidden: torch.Tensor,
    d_lows: Sequence[torch.Tensor],
    d_bs: Sequence[torch.Tensor | None],
) -> None:
    """One tile's logits gradient from its logits `raw`, and its products into d_hidden, each
    segment's d_low and d_B (fp32, in place)."""
    r0, r1, v0, v1 = tile
    if native_head.takes(raw, softcap):  # (the same gradient in one pass)
        d = native_head.backward_tile(raw, tile, targets, lse, g_sum.view(-1), g)
    else:
        z = _capped(raw, softcap)
        d = _exp_minus(z, lse[r0:r1]).mul_(-g_sum[r0:r1])
        inside, column = _targets_in(targets, tile)
        d.scatter_add_(-1, column, torch.where(inside, g[r0:r1], 0))
        if softcap:
            d.mul_(1 - (z / softcap).square())  # d/dx of tanh(x / c) * c
        d = d.to(head[0].dtype)
    if exact:
        cpu_fp32_matmul.addmm_(d_hidden[r0:r1], d, head[0][v0:v1])
    else:
        _accumulate(d_hidden[r0:r1], d, head[0][v0:v1], exact)
    for seg, low, b, d_low, d_b in zip(parts.segments, lows, bs, d_lows, d_bs, strict=True):
        s0, s1 = max(seg.start, r0), min(seg.end, r1)
        if s0 >= s1:
            continue
        d_seg, own = d[s0 - r0 : s1 - r0], slice(s0 - seg.start, s1 - seg.start)
        _accumulate(d_low[own], d_seg, b[v0:v1], exact)
        if d_b is None:
            continue
        if exact:
            d_b[v0:v1].addmm_(d_seg.t(), low[own])
        else:  # (dz.T @ low: the kernel of the layers' dB where it is used)
            d_b[v0:v1].add_(native_grads.transposed_product(low[own], d_seg, transposed=True))


def _forward_tile(
    z: torch.Tensor,
    tile: tuple[int, int, int, int],
    targets: torch.Tensor,
    high: torch.Tensor,
    total: torch.Tensor,
    picked: torch.Tensor,
) -> None:
    """One tile's logits z (fp32) into the rows' running maximum, sum of exponentials and
    targets' logits, in place."""
    r0, r1 = tile[:2]
    old = high[r0:r1]
    new = torch.maximum(old, z.amax(-1))
    # the running sum rescaled to the new maximum (exp(-inf) = 0 on a row's first chunk)
    total[r0:r1].mul_(torch.exp(old - new)).add_(_exp_minus(z, new).sum(-1))
    high[r0:r1] = new
    inside, column = _targets_in(targets, tile)
    picked[r0:r1] = torch.where(inside, z.gather(-1, column), picked[r0:r1])


def _exp_minus(z: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """exp(z - row[:, None]) for a tile of fp32 logits, as 2^((z - row) log2 e): torch's CPU
    exp2 took a third of exp's time on a 512 x 1024 tile (an AVX-512-BF16 EPYC), and the
    subtraction comes first so that the largest terms, near a row's maximum, keep their
    precision (the row sums' relative error measured 4e-8, exp's 2e-8; scaling z and the row
    by log2 e before subtracting gave 1.3e-6)."""
    return torch.sub(z, row[:, None]).mul_(_LOG2_E).exp2_()


def _targets_in(
    targets: torch.Tensor, tile: tuple[int, int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the tile's rows: which targets fall in its columns, and their column in it (clamped
    into the tile where they do not, to be masked)."""
    r0, r1, v0, v1 = tile
    t = targets[r0:r1]
    return (t >= v0) & (t < v1), (t - v0).clamp_(0, v1 - v0 - 1)


def _accumulate(into: torch.Tensor, a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    """into (fp32) += a @ b."""
    if exact:
        into.addmm_(a, b)
    else:
        into.add_(a @ b)


def fused_target_logprobs(
    parts: HeadParts, hidden: torch.Tensor, targets: torch.Tensor, softcap: float | None
) -> torch.Tensor:
    """log p(targets) [N, K] float32 of hidden [N, d] through the head `parts` describes."""
    factors: list[torch.Tensor] = []
    for seg in parts.segments:
        factors += [seg.low, seg.b]
    # Keep the logits for the backward pass where there will be one and they fit.
    trains = torch.is_grad_enabled() and any(t.requires_grad for t in (hidden, *factors))
    size = hidden.shape[0] * parts.vocab * hidden.element_size()
    keep = trains and size <= SAVED_LOGITS_BYTES
    result: torch.Tensor = _FusedHead.apply(parts, targets, softcap, keep, hidden, *factors)
    return result
