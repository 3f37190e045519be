"""Causal attention of a packed row's sequences in C++ at bf16, with its backward.

causal_cpu.py's matmul kernel makes a sequence's attention from torch operations (fp32
copies, batched matmuls, the bias, the softmax and its gradient): on SmolLM2-135M's shapes
(9 query heads over 3 key heads, head size 64, sequences of 64-256 tokens) each costs more
than its arithmetic, and the attention took ~16 % of a bf16 training step on an AMX Xeon for
~3 % of its FLOPs. `attention_tiles.cpp` makes the same attention in 16-row blocks, the
blocks past the diagonal skipped, in two C++ calls (see its header for the layouts and
numerics): its products on the AMX tile unit where the CPU has one, else on AVX-512-BF16's
dot products (AMD's Zen 4 and 5), the softmax and the layouts on the vector unit either way.
`PackedTileCausal` is the autograd node of a packed row's sequences (packing.py), all of
them in one call each way: the kernels pad each sequence to whole 16-token blocks inside,
run the blocks of all sequences as one list of work, and write the output and the gradients
where their callers read them ([tokens, heads, dim] rows), so no per-sequence slices,
padding copies or concatenation remain. A sequence's values are those it gets alone.
packing.py takes it for bf16 CPU rows where `takes` says so (a CPU with AVX512-BF16; head
sizes of whole 32-feature tile rows, sequences within causal_cpu.py's matmul bound) and
causal_cpu.py's torch kernels elsewhere. One layer of SmolLM2-135M over 8 sequences of
64-256 tokens, forward + backward: 8.5 ms by the torch kernel, 3.5 ms here; a bf16 training
step 1.17x faster on an AMX Xeon (bench/train_variants.py --micro, --variant attention-
tiles; the vector form's figures on a Zen 5 EPYC are in docs/benchmarks.md).

The kernels read q, k, v and the output's gradient where they lie (rows of contiguous
features at any head and token strides: the attention's transposed projections need no copy).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine import causal_cpu, native

__all__ = ["PackedTileCausal", "backward_kernel", "forward_kernel", "takes", "tiles"]

SOURCE = Path(__file__).with_name("attention_tiles.cpp")
_NEEDS = ("avx512f", "avx512_bf16")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ROWS = (_P, _I, _I)  # address, head stride, token stride
# lengths, count, key heads, groups, dim, scale, threads
_SHAPE = (_P, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int)
_FORWARD = (*_ROWS * 4, _P, *_SHAPE)  # q, k, v, out; probs
_BACKWARD = (*_ROWS * 4, _P, *_ROWS, _P, _P, _I, _I, *_SHAPE)  # dout, q, k, v, probs; dq; dk, dv
DEPTH = 32  # features of a tile row


def forward_kernel() -> Any:
    """attention_forward_bf16 (`_FORWARD`), or None where it cannot be built."""
    return native.function(SOURCE, "attention_forward_bf16", _FORWARD, None, _NEEDS)


def backward_kernel() -> Any:
    """attention_backward_bf16 (`_BACKWARD`), or None where it cannot be built."""
    return native.function(SOURCE, "attention_backward_bf16", _BACKWARD, None, _NEEDS)


def _probs_size() -> Any:
    args = (_P, _I, _I, _I)  # lengths, count, key heads, groups
    return native.function(SOURCE, "attention_probs_size", args, ctypes.c_int64, _NEEDS)


def tiles(allowed: bool = True) -> bool:
    """Let the products take the AMX tile unit where the CPU has one (the default), or keep
    them on the vector unit (`allowed=False`: both forms on one CPU, for the tests and the
    benches). Returns whether they take the tile unit now (built with AMX, granted by the OS,
    allowed); False where the kernels cannot be built."""
    switch = native.function(SOURCE, "attention_tiles_allow", (ctypes.c_int,), ctypes.c_int, _NEEDS)
    return switch is not None and bool(switch(int(allowed)))


def _ready() -> bool:
    """The kernels built (a CPU with AVX512-BF16 and a C++ compiler)."""
    return forward_kernel() is not None and backward_kernel() is not None


def takes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, lengths: Sequence[int]
) -> bool:
    """Whether `PackedTileCausal` takes q [1, heads, T, d] over k, v [1, key heads, T, d], the
    sequences of `lengths` end to end: bf16 CPU tensors with contiguous features, head sizes
    of whole 32-feature rows, a positive scale, each sequence within the matmul kernel's
    bound, the kernels ready."""
    tensors = (q, k, v)
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.dim() != 4 for t in tensors):
        return False
    if any(t.stride(3) != 1 for t in tensors):
        return False
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[3]
    if q.shape[0] != 1 or k.shape != v.shape or k.shape[0] != 1 or k.shape[3] != dim:
        return False
    if kv_heads == 0 or heads % kv_heads or dim % DEPTH or not scale > 0:
        return False
    if sum(lengths) != q.shape[2] or k.shape[2] != q.shape[2] or min(lengths, default=0) < 1:
        return False
    if not all(causal_cpu.uses_matmul(n) for n in lengths):
        return False
    return _ready()


def _heads_first(t: torch.Tensor) -> list[int]:
    """A [1, heads, T, d] tensor's rows as the kernels read them: address, head stride, token
    stride."""
    return [t.data_ptr(), t.stride(1), t.stride(2)]


def _tokens_first(t: torch.Tensor) -> list[int]:
    """The same of a [1, T, heads, d] tensor."""
    return [t.data_ptr(), t.stride(2), t.stride(1)]


class PackedTileCausal(torch.autograd.Function):
    """Causal attention of each sequence of a packed row: q [1, heads, T, d] over k, v [1, key
    heads, T, d] (key heads may divide heads), the sequences of `lengths` end to end; the
    output [1, T, heads, d] bf16, contiguous (the layout the attention's caller reads)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lengths: tuple[int, ...],
        scale: float,
    ) -> torch.Tensor:
        heads, tokens, dim = q.shape[1:]
        kv_heads = k.shape[1]
        sizes = torch.tensor(lengths, dtype=torch.int64)
        shape = (sizes.data_ptr(), len(lengths), kv_heads, heads // kv_heads, dim, scale)
        out = torch.empty(1, tokens, heads, dim, dtype=q.dtype)
        # (written whole by the kernel: pairs of rows, zeros past each row block's keys)
        probs = torch.empty(_probs_size()(*shape[:4]), dtype=q.dtype)
        rows = [*_heads_first(q), *_heads_first(k), *_heads_first(v), *_tokens_first(out)]
        forward_kernel()(*rows, probs.data_ptr(), *shape, torch.get_num_threads())
        ctx.save_for_backward(q, k, v, probs, sizes)
        ctx.shape = shape[1:]  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, probs, sizes = ctx.saved_tensors  # type: ignore[attr-defined]
        grad = grad.to(q.dtype)
        if grad.stride(3) != 1:
            grad = grad.contiguous()
        (_, tokens, heads, dim), kv_heads = grad.shape, k.shape[1]
        dq = torch.empty(1, tokens, heads, dim, dtype=q.dtype)
        dk = torch.empty(1, tokens, kv_heads, dim, dtype=k.dtype)
        dv = torch.empty(1, tokens, kv_heads, dim, dtype=v.dtype)
        rows = [*_tokens_first(grad), *_heads_first(q), *_heads_first(k), *_heads_first(v)]
        grads = [*_tokens_first(dq), dk.data_ptr(), dv.data_ptr(), dk.stride(2), dk.stride(1)]
        shape = (sizes.data_ptr(), *ctx.shape)  # type: ignore[attr-defined]
        backward_kernel()(*rows, probs.data_ptr(), *grads, *shape, torch.get_num_threads())
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None
