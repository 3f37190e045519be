"""Sibling linears under one adapter as one autograd node, for passes over many tokens.

An attention's q/k/v projections and an MLP's gate/up take the same input (fused.py's
SIBLINGS). Run one by one, each adapted layer is its own node (ops.py's one-adapter node):
a down-projection x @ A.T per layer, a concatenation of its input with it and of its weight
with B, one matmul; in the backward pass one input gradient, one A gradient per layer. For
the group at once (`SiblingLinears`):

- forward: one down-projection x @ [A_1; ...; A_G].T ([rows, G r]), then, at half
  precision, one matmul of [x | low] by the siblings' weights stacked with their B blocks in
  the extra columns, the delta summed with the base in fp32 and rounded once, as the
  one-adapter node does (in fp32, the stacked base matmul and each delta added into its
  columns; on CPUs with AVX512-BF16 the native kernel without joining either side,
  native_summed.py); each sibling's output is a view of its columns' part (its rows strided);
- backward: the input gradient by one chain of accumulating matmuls, the down-projections'
  gradients by one matmul [G r, rows] @ [rows, in].

On SmolLM2-135M's shapes (1,408 tokens, rank 32, bf16, an AMX Xeon) a decoder layer's seven
adapted linears forward + backward ran 1.04x faster grouped (22.9 -> 22.0 ms,
`bench/train_variants.py --micro`, docs/benchmarks.md): the small k/v matmuls and the rank-32
products, slow for their FLOPs, run once per group instead of once per layer.

The first sibling called with an input computes the group's outputs; the others take theirs
while the input is the same tensor (fused.py's `take`, which its decode groups use too).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tuneloop.server.engine import cpu_fp32_matmul
from tuneloop.server.engine.lora import native_grads, native_summed, ops
from tuneloop.server.engine.lora.ops import HALF, Factors

__all__ = ["SiblingLinears", "sibling_linears", "stack_weights", "stacked", "stacked_view"]

_GROUPED = True  # (bench/train_variants.py switches it off to compare: --variant siblings)
# Each sibling's output is a view of its columns of the group's output: copying them out cost
# ~1.6 ms a layer of 1,408 tokens for gate/up alone, and their readers (the attention's view
# into heads, the MLP's SiLU product) read rows through their strides. (train_variants.py
# copies them to compare: --variant mlp-product.)
_COPIED_OUTPUTS = False


class SiblingLinears(torch.autograd.Function):
    """x @ W_i.T + scale_i * x @ A_i.T @ B_i.T for each sibling i, the weights frozen, as one
    graph node with one output per sibling. Inputs: x, the weights (a tuple, no gradient), their
    stacked bias or None (no gradient), the scales, then A_1, B_1, ..., A_G, B_G in x's
    dtype."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weights: tuple[torch.Tensor, ...],
        bias: torch.Tensor | None,
        scales: tuple[float, ...],
        *factors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        flat = x.reshape(-1, x.shape[-1])
        downs, ups = factors[0::2], factors[1::2]
        a_all = torch.cat(downs)  # [G r, in]
        low = flat @ a_all.t()  # [rows, G r], before the scales
        sizes = [w.shape[0] for w in weights]
        if x.dtype in HALF and ops._EXACT_DELTA:
            out = _summed(flat, low, weights, bias, ups, scales)
        else:  # fp32: each delta added into its columns, no zero blocks multiplied
            out = cpu_fp32_matmul.linear(flat, stacked(weights), bias)
            row = column = 0
            for b, scale, size in zip(ups, scales, sizes, strict=True):
                rank = b.shape[1]
                part = low[:, column : column + rank]
                out[:, row : row + size].addmm_(part, b.t(), alpha=scale)
                row, column = row + size, column + rank
        ctx.save_for_backward(flat, low, a_all, *weights, *ups)
        ctx.scales = scales  # type: ignore[attr-defined]
        ctx.count = len(weights)  # type: ignore[attr-defined]
        ctx.shape = x.shape  # type: ignore[attr-defined]
        lead = x.shape[:-1]
        parts = out.split(sizes, dim=1)
        if _COPIED_OUTPUTS:
            parts = tuple(part.contiguous() for part in parts)
        return tuple(part.view(*lead, part.shape[1]) for part in parts)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        flat, low, a_all, *rest = ctx.saved_tensors  # type: ignore[attr-defined]
        scales: tuple[float, ...] = ctx.scales  # type: ignore[attr-defined]
        count: int = ctx.count  # type: ignore[attr-defined]
        weights, ups = rest[:count], rest[count:]
        rows = flat.shape[0]
        dys = [
            flat.new_zeros((rows, w.shape[0])) if g is None else g.reshape(rows, -1)
            for g, w in zip(grads, weights, strict=True)
        ]
        # the gradient of low, scaled: scale_i * dy_i @ B_i per sibling
        d_low = torch.cat(
            [ops.scaled_(dy @ b, s) for dy, b, s in zip(dys, ups, scales, strict=True)], dim=1
        )
        d_x = None
        wants_x: bool = ctx.needs_input_grad[0]  # type: ignore[attr-defined]
        widths = [*(dy.shape[1] for dy in dys), d_low.shape[1]]
        if wants_x and native_summed.available(flat, weights, widths):
            # one call, rounded once (native_summed.py)
            d_x = native_summed.input_grad(dys, d_low, weights, a_all)
            if d_x is not None:
                d_x = d_x.view(ctx.shape)  # type: ignore[attr-defined]
        if wants_x and d_x is None:
            d_x = cpu_fp32_matmul.matmul(dys[0], weights[0])
            for dy, w in zip(dys[1:], weights[1:], strict=True):
                cpu_fp32_matmul.addmm_(d_x, dy, w)
            d_x = d_x.addmm_(d_low, a_all).view(ctx.shape)  # type: ignore[attr-defined]
        d_a_all = native_grads.transposed_product(d_low, flat)  # [G r, in]
        d_factors: list[torch.Tensor] = []
        column = 0
        for dy, b, scale in zip(dys, ups, scales, strict=True):
            rank = b.shape[1]
            part = low[:, column : column + rank]
            d_b = ops.scaled_(native_grads.transposed_product(part, dy, transposed=True), scale)
            d_factors += [d_a_all[column : column + rank], d_b]
            column += rank
        return (d_x, None, None, None, *d_factors)


def _summed(
    flat: torch.Tensor,
    low: torch.Tensor,
    weights: Sequence[torch.Tensor],
    bias: torch.Tensor | None,
    ups: Sequence[torch.Tensor],
    scales: Sequence[float],
) -> torch.Tensor:
    """[flat | low] @ [W_all | B blocks].T: every sibling's delta summed with its base in the
    matmul's fp32 accumulator and rounded once (each sibling's B in its own block of columns,
    zero elsewhere); by the native kernel without joining them where it takes the pass
    (native_summed.py)."""
    if native_summed.available(flat, weights, (flat.shape[1], low.shape[1])):
        packed = native_summed.frozen(weights)
        if packed is not None:
            sizes = [w.shape[0] for w in weights]
            ranks = [b.shape[1] for b in ups]
            spans = native_summed.spans_of(sizes, ranks, flat.shape[1] // 2)
            blocks = native_summed.b_blocks(ups, scales)
            return native_summed.summed(flat, low, packed, blocks, bias, spans)
    width = flat.shape[1]
    wide = flat.new_empty((sum(w.shape[0] for w in weights), width + low.shape[1]))
    torch.cat(list(weights), out=wide[:, :width])
    wide[:, width:].zero_()  # (only the B columns: the weights' part is written once)
    row = column = 0
    for w, b, scale in zip(weights, ups, scales, strict=True):
        size, rank = w.shape[0], b.shape[1]
        wide[row : row + size, width + column : width + column + rank] = b * scale
        row, column = row + size, column + rank
    return torch.nn.functional.linear(torch.cat([flat, low], dim=1), wide, bias)


def stack_weights(bases: Sequence[nn.Linear]) -> bool:
    """Moves a group's frozen weights into one tensor, each layer's weight a view of its rows
    (in the group's order), so that the fp32 node's forward reads them as one matrix
    (`stacked`) instead of concatenating them a pass (SmolLM2-135M, 704 rows, one thread, an
    Ice Lake Xeon: q/k/v's forward 9.83 -> 9.02 ms, gate/up's 28.52 -> 27.03, ~1 % of an fp32
    training step; docs/benchmarks.md). The same values: the layers compute as before. Only
    plain contiguous weights of one dtype and device, already apart (a group stacked before is
    left as it is); returns whether they are stacked now."""
    weights = [b.weight for b in bases]
    if len(weights) < 2 or stacked_view(weights) is not None:
        return len(weights) > 1
    first = weights[0]
    if any(
        type(w) is not nn.Parameter
        or w.dim() != 2
        or not w.is_contiguous()
        or (w.dtype, w.device, w.shape[1]) != (first.dtype, first.device, first.shape[1])
        for w in weights
    ):
        return False
    with torch.no_grad():
        whole = torch.cat([w.detach() for w in weights])
    row = 0
    for base, w in zip(bases, weights, strict=True):
        base.weight.data = whole[row : row + w.shape[0]]
        row += w.shape[0]
    return True


def stacked_view(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The weights as one [sum of rows, in] tensor where they are contiguous rows of one
    storage, each after the one before (`stack_weights`), without a copy; else None."""
    first = weights[0]
    if first.dim() != 2 or not first.is_contiguous():
        return None
    storage = first.untyped_storage().data_ptr()
    end, rows = first.data_ptr(), 0
    for w in weights:
        if w.dim() != 2 or not w.is_contiguous() or w.shape[1] != first.shape[1]:
            return None
        if w.dtype != first.dtype or w.untyped_storage().data_ptr() != storage:
            return None
        if w.data_ptr() != end:
            return None
        end += w.numel() * w.element_size()
        rows += w.shape[0]
    return first.detach().as_strided((rows, first.shape[1]), (first.shape[1], 1))


def stacked(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The weights' rows as one matrix: a view where `stack_weights` moved them into one
    tensor, else their concatenation."""
    view = stacked_view(weights)
    return torch.cat(list(weights)) if view is None else view


def sibling_linears(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    factors: Sequence[Factors],
    biases: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Each sibling's `linear(x, weight, bias) + delta`: frozen weights and biases (None: none;
    a group where some have one adds zeros for the others), each sibling's factors in x's
    dtype."""
    flat: list[torch.Tensor] = []
    for a, b, _ in factors:
        flat += [a, b]
    scales = tuple(float(f[2]) for f in factors)
    bias = None
    if biases is not None and any(b is not None for b in biases):
        bias = torch.cat(
            [
                x.new_zeros(w.shape[0]) if b is None else b.detach()
                for w, b in zip(weights, biases, strict=True)
            ]
        )
    out: tuple[torch.Tensor, ...] = SiblingLinears.apply(x, tuple(weights), bias, scales, *flat)
    return out
