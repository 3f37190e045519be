"""Causal attention of one packed sequence in bf16/fp16 on a CPU, with autograd.

Two kernels, chosen by the sequence's length:
- up to `MATMUL_MAX_TOKENS` tokens, batched matmuls, one per key head with its
  group of query heads stacked (no copy of the keys per query head; the key and value
  gradients sum over the group inside the matmul): fp32 scores (a half-precision score rounds
  a large logit by up to ~2^-9 of itself, which showed as 18x the flash kernel's error at 4x
  the unit logit scale; bf16 scores are computed on the bf16 units all the same, exactly,
  see `_exact_bf16_products`), an fp32 softmax whose probabilities are kept in the half dtype
  for the backward, and half-precision matmuls for the rest. On 8 sequences of 64-256 tokens at
  SmolLM2-135M's shapes this took a layer's forward + backward from 18.4 ms to 12.4 ms on an
  AVX-512-BF16 EPYC (1.49x; bench/cpu_kernels.py): torch's CPU flash kernels work in small
  blocks with per-block bookkeeping that a short sequence does not amortise, and their fp32
  backward (below) upcasts every input. The kernel computes the full square of scores where
  flash skips the masked half, yet it stays ahead up to about a thousand tokens: a training
  step of 8 sequences of 300-580 tokens (RL lengths: a prompt and up to 384 sampled tokens)
  ran 1.19x faster with it than with flash, of 600-1000 tokens 1.19x; at 1000-1600 the two
  were even (bench/train_variants.py --variant attention-bound).
- longer, torch's CPU flash kernel forward (the kernel SDPA itself runs) with an fp32 backward:
  memory linear in the length. Its half-precision backward took about twice the fp32 one's time
  and rounds the key and value gradients further from fp64's (tests/unit/engine/test_packing.py).

The matmul kernel keeps heads x length half-precision probabilities per token and layer for the
backward; `memory.py` counts heads x MATMUL_MAX_TOKENS of them for every trained token.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

from tuneloop.server.engine import sequence_batches

__all__ = [
    "LENGTH_GRANULE",
    "MATMUL_MAX_TOKENS",
    "causal_attention",
    "packed_attention",
    "uses_matmul",
]

MATMUL_MAX_TOKENS = 1024
# The matmul kernel runs a sequence padded to a multiple of this many tokens: oneDNN builds a
# kernel for each batched-matmul shape it meets (0.3-3.6 ms each), and each new length brings
# eight. Bucketed, a step's lengths reuse the kernels of earlier steps' (`packing.bucketed`
# does the same for the packed row).
LENGTH_GRANULE = 16

_bias_lock = threading.Lock()
_bias = torch.empty(0, 0)


def uses_matmul(length: int) -> bool:
    """Whether a sequence of `length` tokens runs the matmul kernel."""
    return length <= MATMUL_MAX_TOKENS


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of q [1, heads, len, d] over k, v [1, key heads, len, d] (key heads
    may divide heads: grouped-query), [1, heads, len, d] in the inputs' dtype."""
    length = q.shape[2]
    if not uses_matmul(length):
        return _FlashFp32Backward.apply(q, k, v, scale)
    padded = _padded(length)
    if padded == length:
        return _MatmulCausal.apply(q, k, v, scale)
    out = _MatmulCausal.apply(*(_grown(t, padded) for t in (q, k, v)), scale)
    return out[:, :, :length]


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], scale: float
) -> torch.Tensor:
    """`causal_attention` of each sequence packed end to end in q [1, heads, total, d] and k, v
    [1, key heads, total, d] (`lengths` tokens each), [1, total, heads, d] in the inputs' dtype:
    the matmul kernel's sequences of one padded length as one batch of it
    (sequence_batches.py)."""

    def batch(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
        return _MatmulCausal.apply(qb, kb, vb, scale).transpose(1, 2)

    def one(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        return causal_attention(qs, ks, vs, scale).transpose(1, 2)

    how = sequence_batches.plan(tuple(lengths), LENGTH_GRANULE, MATMUL_MAX_TOKENS)
    return sequence_batches.attend(q, k, v, lengths, how, batch, one)


def _padded(length: int) -> int:
    return sequence_batches.rounded_up(length, LENGTH_GRANULE)


def _grown(t: torch.Tensor, padded: int) -> torch.Tensor:
    """t [n, heads, len, d] with zero rows past the end up to `padded`: the causal mask hides
    the padded keys from every real query, and the padded queries' outputs are dropped (their
    gradients are zero)."""
    if t.shape[2] == padded:
        return t
    return torch.nn.functional.pad(t, (0, 0, 0, padded - t.shape[2]))


def _causal_bias(length: int) -> torch.Tensor:
    """[length, length] fp32: 0 on and below the diagonal, -inf above; a view of one cached
    mask grown to the longest length seen (at most MATMUL_MAX_TOKENS rounded up to a granule)."""
    global _bias
    with _bias_lock:
        if _bias.shape[0] < length:
            _bias = torch.full((length, length), float("-inf")).triu_(1)
        return _bias[:length, :length]


@contextlib.contextmanager
def _exact_bf16_products(dtype: torch.dtype) -> Iterator[None]:
    """fp32 matmuls of bf16 values on oneDNN's bf16 units, for the block's duration.

    A bf16 value is exact in bf16, so rounding the fp32 copies back to bf16 loses nothing:
    oneDNN's bf16 kernels (AMX, AVX-512-BF16) multiply them exactly and sum in fp32, to an
    fp32 result, the scores the fp32 matmul gives up to summation order, faster where fp32
    runs at a fraction of the bf16 rate (an AMX Xeon: a layer's scores 1.4x faster, with half
    the fp32 matmul's error against fp64; bench/cpu_kernels.py). The switch
    is torch's process-wide `mkldnn.matmul.fp32_precision`: the engine computes on one
    thread, and the previous value comes back on exit. fp16 values are not exact in bf16: left
    in fp32. torch ignores the switch on a CPU without bf16 units."""
    switch = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]  # set at import
    if dtype != torch.bfloat16 or switch.fp32_precision == "bf16":
        yield
        return
    previous, switch.fp32_precision = switch.fp32_precision, "bf16"
    try:
        yield
    finally:
        switch.fp32_precision = previous


def _folded(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[n, heads, len, d] -> [n x key heads, groups x len, d]: each key head's group of query
    heads stacked, so that one matmul per key head serves its group and sums over it."""
    count, heads, length, dim = t.shape
    return t.reshape(count * kv_heads, heads // kv_heads * length, dim)


class _MatmulCausal(torch.autograd.Function):
    """Scores and softmax in fp32, probabilities saved in the inputs' dtype; see the module."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        kv_heads, length = k.shape[1], k.shape[2]
        queries = _folded(q, kv_heads)  # [n x key heads, groups x len, d]
        keys, values = k.flatten(0, 1), v.flatten(0, 1)  # [n x key heads, len, d]
        with _exact_bf16_products(q.dtype):
            scores = torch.bmm(queries.float(), keys.float().transpose(1, 2))
        blocks = scores.view(kv_heads, -1, length, length)
        torch.add(_causal_bias(length), blocks, alpha=scale, out=blocks)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        ctx.save_for_backward(queries, keys, values, probs)
        ctx.scale, ctx.shape = scale, q.shape  # type: ignore[attr-defined]
        return torch.bmm(probs, values).view(q.shape)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        queries, keys, values, probs = ctx.saved_tensors  # type: ignore[attr-defined]
        scale, shape = ctx.scale, ctx.shape  # type: ignore[attr-defined]
        grad = _folded(grad.to(queries.dtype), keys.shape[0] // shape[0])
        grad_values = torch.bmm(probs.transpose(1, 2), grad)  # summed over each group
        grad_probs = torch.bmm(grad, values.transpose(1, 2))
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        grad_q = torch.bmm(grad_scores, keys).mul_(scale)
        grad_keys = torch.bmm(grad_scores.transpose(1, 2), queries).mul_(scale)
        kv_shape = (shape[0], keys.shape[0] // shape[0], *keys.shape[1:])
        return grad_q.view(shape), grad_keys.view(kv_shape), grad_values.view(kv_shape), None


class _FlashFp32Backward(torch.autograd.Function):
    """torch's CPU flash kernel, forward in the inputs' half dtype and backward in fp32 (the
    saved half inputs and output upcast, with the forward's fp32 logsumexp)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.float(),
            q.float(),
            k.float(),
            v.float(),
            out.float(),
            lse,
            0.0,
            True,
            scale=ctx.scale,  # type: ignore[attr-defined]
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
