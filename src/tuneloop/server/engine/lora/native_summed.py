"""A training pass's exact-delta products, [x | low] @ [W | B].T, on the native linear kernel.

At half precision an adapted layer's forward (ops.py's one-adapter node, siblings.py's group)
sums the LoRA delta with the base in fp32 and rounds once: one matmul of [x | x @ A.T] by
[W | scale * B]. By torch that joins the inputs and the weights anew every pass (a copy of W
and of x a layer), then runs oneDNN. Where the CPU has AVX512-BF16 and no AMX, the native
linear kernel's two-operand entry (`linear_bf16_pair` in linear_avx512.cpp) makes the same
sums without the joins: W in the kernel's blocks once (frozen: kept while its tensors are the
same, `frozen`), B packed per call (a few thousand rows of the rank's columns), x and low read
where they lie. A sibling group's B holds zeros outside each member's own rank columns; the
kernel leaves those pairs out (`spans`), as a decode step's fused groups do. Where the CPU has
AMX oneDNN runs on the tile unit, which this entry does not use, so it is left to torch there.

Another kernel than oneDNN's, so the outputs round differently (a bf16 step in a few of them);
the sampler's decode steps run this kernel on the same joined sums. The packed W is a second
copy of the adapted layers' weights (the model's linear weights once more); it is made only
where it takes at most MERGED_SHARE of the free memory, else the pass keeps torch's products.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tuneloop.server.engine import native, native_linear
from tuneloop.server.engine.memory import free_bytes
from tuneloop.server.engine.native_linear import NativeWeight

__all__ = ["available", "b_blocks", "frozen", "pair_kernel", "spans_of", "summed"]

_P, _I = ctypes.c_void_p, ctypes.c_int64
# x1, ld1, k1, x2, ld2, k2, rows, w1, stride1, w2, stride2, bias, n, y, ldy, threads, spans
_SIGNATURE = (_P, _I, _I, _P, _I, _I, _I, _P, _I, _P, _I, _P, _I, _P, _I, ctypes.c_int, _P)
_NATIVE = True  # (bench/train_variants.py switches it off to compare: --variant native-summed)
MERGED_SHARE = 0.25  # of the free memory a packed copy of the frozen weights may take
_BLOCK = 64

# Per frozen weight (a sibling group's first member), the weights' pointers and versions when
# packed and the packed copy (None: refused for memory); dropped with the weight.
_FROZEN: WeakIdKeyDictionary = WeakIdKeyDictionary()
_LOCK = threading.Lock()
_SPANS: dict[tuple[tuple[int, ...], tuple[int, ...], int], torch.Tensor | None] = {}


def pair_kernel() -> Any:
    """linear_avx512.cpp's two-operand entry point (`_SIGNATURE`), or None where it cannot be
    built."""
    return native.function(
        native_linear.SOURCE,
        "linear_bf16_pair",
        _SIGNATURE,
        ctypes.c_int,
        ("avx512f", "avx512_bf16"),
    )


def available(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether `summed` takes a pass of x through these frozen weights: bf16 CPU tensors, even
    input widths, on a CPU without AMX whose kernel could be built (TUNELOOP_NATIVE_LINEAR
    not 0)."""
    if not _NATIVE or os.environ.get("TUNELOOP_NATIVE_LINEAR", "1") == "0":
        return False
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] % 2:
        return False
    if any(w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 2 for w in weights):
        return False
    return "amx_bf16" not in native.cpu_flags() and pair_kernel() is not None


def _state(weights: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple((w.data_ptr(), w._version, tuple(w.shape)) for w in weights)


def frozen(weights: Sequence[torch.Tensor]) -> NativeWeight | None:
    """The weights' rows stacked in the kernel's blocks, kept with the first weight while every
    one of them is the same tensor, unchanged in place; None where the copy would take more
    than MERGED_SHARE of the free memory."""
    state = _state(weights)
    held = _FROZEN.get(weights[0])
    if held is not None and held[0] == state:
        return held[1]
    with _LOCK:  # (both threads' parts may ask first at once: one copy)
        held = _FROZEN.get(weights[0])
        if held is not None and held[0] == state:
            return held[1]
        need = sum(w.numel() for w in weights) * 2
        free = free_bytes(weights[0].device)
        packed = None
        if free is None or need <= MERGED_SHARE * free:
            with torch.no_grad():
                whole = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0]
                packed = native_linear.pack(whole.detach(), None, extra_from=whole.shape[1])
        _FROZEN[weights[0]] = (state, packed)
        return packed


def b_blocks(ups: Sequence[torch.Tensor], scales: Sequence[float]) -> torch.Tensor:
    """The members' scale * B ([out_i, r_i] each) as the kernel's blocks of the joined weights'
    LoRA columns, [ceil(N / 64), ceil(R / 2), 64, 2]: member i's rows, its own rank's columns,
    zeros elsewhere (N = the members' outputs, R = their ranks)."""
    n, r = sum(b.shape[0] for b in ups), sum(b.shape[1] for b in ups)
    nb, kp = -(-n // _BLOCK), -(-r // 2)
    padded = ups[0].new_zeros((nb * _BLOCK, 2 * kp))
    row = column = 0
    for b, scale in zip(ups, scales, strict=True):
        size, rank = b.shape
        torch.mul(b, scale, out=padded[row : row + size, column : column + rank])
        row, column = row + size, column + rank
    return padded.view(nb, _BLOCK, kp, 2).transpose(1, 2).contiguous()


def spans_of(sizes: Sequence[int], ranks: Sequence[int], split: int) -> torch.Tensor | None:
    """The kernel's `spans` for a group's joined weights ([W | B blocks], W's `split` pairs
    first): every block's W pairs, then the rank columns of the members whose rows the block
    holds; None for one member (no zero columns) or odd ranks (a pair across two members)."""
    key = (tuple(sizes), tuple(ranks), split)
    if key in _SPANS:
        return _SPANS[key]
    spans = None
    if len(sizes) > 1 and all(r % 2 == 0 for r in ranks):
        starts, columns = [0], [0]
        for size, rank in zip(sizes, ranks, strict=True):
            starts.append(starts[-1] + size)
            columns.append(columns[-1] + rank)
        blocks = -(-starts[-1] // _BLOCK)
        table = []
        for b in range(blocks):
            lo, hi = b * _BLOCK, min((b + 1) * _BLOCK, starts[-1])
            members = [i for i in range(len(sizes)) if starts[i] < hi and starts[i + 1] > lo]
            first, last = columns[members[0]] // 2, columns[members[-1] + 1] // 2
            table.append([0, split, split + first, split + last])
        spans = torch.tensor(table, dtype=torch.int32)
    _SPANS[key] = spans
    return spans


def summed(
    x: torch.Tensor,
    low: torch.Tensor,
    weight: NativeWeight,
    blocks: torch.Tensor,
    bias: torch.Tensor | None = None,
    spans: torch.Tensor | None = None,
) -> torch.Tensor:
    """[x | low] @ [W | B].T + bias, [rows, N] bf16, each output summed in fp32 (from the bias)
    and rounded once: x [rows, K] and low [rows, R] (features contiguous, rows strided) read
    where they lie; W in `weight` (`frozen`), B in `blocks` (`b_blocks`)."""
    kernel = pair_kernel()
    if kernel is None:
        raise RuntimeError("the native linear kernel is not built on this CPU")
    k1, k2, n = weight.in_features, low.shape[1], weight.out_features
    x = native.bf16_rows(x, k1, "native linear kernel", f"[{n}, {k1}] weight")
    low = native.bf16_rows(low, k2, "native linear kernel", f"[{n}, {k2}] LoRA columns")
    rows = x.shape[0]
    if (
        low.shape[0] != rows
        or blocks.shape[0] != weight.blocks.shape[0]
        or blocks.shape[1] * 2 < k2
    ):
        raise ValueError("the LoRA columns do not match the weight's rows and blocks")
    if bias is not None:
        padded = bias.new_zeros(weight.blocks.shape[0] * _BLOCK, dtype=torch.float32)
        padded[:n] = bias.detach()
        bias = padded
    y = torch.empty((rows, n), dtype=torch.bfloat16)
    code = kernel(
        x.data_ptr(),
        x.stride(0) if rows > 1 else k1,
        k1,
        low.data_ptr(),
        low.stride(0) if rows > 1 else k2,
        k2,
        rows,
        weight.blocks.data_ptr(),
        weight.blocks.shape[1],
        blocks.data_ptr(),
        blocks.shape[1],
        bias.data_ptr() if bias is not None else None,
        n,
        y.data_ptr(),
        n,
        torch.get_num_threads(),
        spans.data_ptr() if spans is not None else None,
    )
    if code:
        raise ValueError("the native linear kernel refused its shapes")
    return y
