"""Causal attention of a short packed sequence on the AMX tile unit, with its backward.

causal_cpu.py's matmul kernel makes a sequence's attention from torch operations (fp32
copies, batched matmuls, the bias, the softmax and its gradient): on SmolLM2-135M's shapes
(9 query heads over 3 key heads, head size 64, sequences of 64-256 tokens) each costs more
than its arithmetic, and the attention took ~16 % of a bf16 training step on an AMX Xeon for
~3 % of its FLOPs. `attention_tiles.cpp` makes the same attention in 16-row blocks on the
tile unit and the vector unit, the blocks past the diagonal skipped, in two C++ calls (see
its header for the layouts and numerics). `TileCausal` is the autograd node; causal_cpu.py
takes it for bf16 CPU sequences where `takes` says so (a CPU with AMX whose tiles Linux
grants, lengths of whole 16-row blocks, head sizes of whole 32-feature tile rows) and its
torch kernel elsewhere.

The kernels read q, k, v and the output's gradient where they lie (rows of contiguous
features at any head and token strides: the attention's transposed projections need no copy).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine import native

__all__ = ["TileCausal", "backward_kernel", "forward_kernel", "takes"]

SOURCE = Path(__file__).with_name("attention_tiles.cpp")
_NEEDS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ROWS = (_P, _I, _I)  # address, head stride, token stride
_SHAPE = (
    _I,
    _I,
    _I,
    _I,
    ctypes.c_float,
    ctypes.c_int,
)  # key heads, groups, length, dim, scale, threads
_FORWARD = (*_ROWS * 3, _P, _P, *_SHAPE)  # q, k, v; out, probs
_BACKWARD = (*_ROWS * 4, _P, _P, _P, _P, *_SHAPE)  # dout, q, k, v, probs; dq, dk, dv
BLOCK = 16  # query rows and keys of a tile
DEPTH = 32  # features of a tile row


def forward_kernel() -> Any:
    """attention_forward_bf16 (`_FORWARD`), or None where it cannot be built."""
    return native.function(SOURCE, "attention_forward_bf16", _FORWARD, ctypes.c_int, _NEEDS)


def backward_kernel() -> Any:
    """attention_backward_bf16 (`_BACKWARD`), or None where it cannot be built."""
    return native.function(SOURCE, "attention_backward_bf16", _BACKWARD, ctypes.c_int, _NEEDS)


def _ready() -> bool:
    """The kernels built and Linux granting this process the tile registers."""
    ready = native.function(SOURCE, "attention_tiles_ready", (), ctypes.c_int, _NEEDS)
    return ready is not None and forward_kernel() is not None and bool(ready())


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, length: int) -> bool:
    """Whether `TileCausal` takes q [1, heads, L, d] over k, v [1, key heads, L, d] once
    padded to `length` tokens: bf16 CPU tensors, whole 16-token blocks and 32-feature rows,
    a positive scale, the kernels ready."""
    tensors = (q, k, v)
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.dim() != 4 for t in tensors):
        return False
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[3]
    if q.shape[0] != 1 or k.shape != v.shape or k.shape[0] != 1 or k.shape[3] != dim:
        return False
    if kv_heads == 0 or heads % kv_heads or length % BLOCK or dim % DEPTH or not scale > 0:
        return False
    return _ready()


def _up(n: int) -> int:
    return -(-n // DEPTH) * DEPTH


def _rows(t: torch.Tensor) -> list[int]:
    """A [1, heads, L, d] tensor as the kernels read it: its address, head and token strides
    (features contiguous: checked by the caller)."""
    return [t.data_ptr(), t.stride(1), t.stride(2)]


def _features(t: torch.Tensor) -> torch.Tensor:
    """t with its features contiguous, as the kernels read rows."""
    return t if t.stride(3) == 1 else t.contiguous()


def _run(kernel: Any, part: str, *arguments: Any) -> None:
    if kernel(*arguments, torch.get_num_threads()) != 0:
        raise RuntimeError(f"the attention tile kernel's {part} pass could not run")


class TileCausal(torch.autograd.Function):
    """Causal attention of q [1, heads, L, d] over k, v [1, key heads, L, d] (L a multiple of
    16; key heads may divide heads), [1, heads, L, d] bf16, by attention_tiles.cpp."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        q, k, v = _features(q), _features(k), _features(v)
        kv_heads, length, dim = k.shape[1:]
        groups = q.shape[1] // kv_heads
        out = torch.empty(q.shape, dtype=q.dtype)
        # (written whole by the kernel: pairs of rows, zeros past each row block's keys)
        probs = torch.empty(kv_heads, _up(groups * length) // 2, _up(length), 2, dtype=q.dtype)
        shape = (kv_heads, groups, length, dim, scale)
        inputs = [*_rows(q), *_rows(k), *_rows(v)]
        _run(forward_kernel(), "forward", *inputs, out.data_ptr(), probs.data_ptr(), *shape)
        ctx.save_for_backward(q, k, v, probs)
        ctx.shape = shape  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, probs = ctx.saved_tensors  # type: ignore[attr-defined]
        grad = _features(grad.to(q.dtype))
        dq = torch.empty(q.shape, dtype=q.dtype)
        dk, dv = torch.empty(k.shape, dtype=k.dtype), torch.empty(v.shape, dtype=v.dtype)
        inputs = [*_rows(grad), *_rows(q), *_rows(k), *_rows(v), probs.data_ptr()]
        outputs = [dq.data_ptr(), dk.data_ptr(), dv.data_ptr()]
        _run(backward_kernel(), "backward", *inputs, *outputs, *ctx.shape)  # type: ignore[attr-defined]
        return dq, dk, dv, None
