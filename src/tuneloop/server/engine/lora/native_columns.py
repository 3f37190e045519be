"""A lone adapter's LoRA columns, [x | x @ A.T], by one C++ call on CPUs with AVX512-BF16.

A decode step on fused weights (fused.py) multiplies each group of sibling linears by
[x | x @ A.T]: the input and its products with the adapter's stacked down-projections A
[R, K]. torch makes that as a small oneDNN matmul and a concatenation: at 128 rows on an
AVX-512-BF16 EPYC, 36-99 us a group and 228 us a layer, about twice what the arithmetic
needs, 120 groups a step. `lora_columns_avx512.cpp` writes both parts in one pass: the copy
of x and the product made by vdpbf16ps on A rearranged once ("pairs"), each output summed in
fp32 and rounded to bf16 once, as oneDNN's kernel does (in another order of the sums: the two
differ by a bf16 step in a few outputs in 10^4, tests/unit/engine/test_native_columns.py);
143 us a layer (bench/cpu_kernels.py). It is built and loaded by native.py; where it cannot
be, `available` is False and fused.py keeps the oneDNN product.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine import native

__all__ = [
    "DownPairs",
    "UpVectors",
    "add_delta",
    "available",
    "delta_kernel",
    "extend",
    "low",
    "low_kernel",
    "native_kernel",
    "pack",
    "pack_up",
    "tiles",
]

SOURCE = Path(__file__).with_name("lora_columns_avx512.cpp")
_NEEDS = ("avx512f", "avx512_bf16")
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
# x, ldx, pairs; rows, k, r, rp; out; threads
_SIGNATURE = (_POINTER, _SIZE, _POINTER, *[_SIZE] * 4, _POINTER, ctypes.c_int)
# x, ldx, pairs; rows, k, r, rp; low, ldo; threads
_LOW_SIGNATURE = (_POINTER, _SIZE, _POINTER, *[_SIZE] * 4, _POINTER, _SIZE, ctypes.c_int)
# x, ldx, pairs; rows, k, r, rp; up, col, rank, vectors; y, ldy; threads
_DELTA_SIGNATURE = (
    _POINTER, _SIZE, _POINTER, *[_SIZE] * 4, _POINTER, _POINTER, _SIZE, _SIZE, _POINTER, _SIZE,
    ctypes.c_int,
)  # fmt: skip


def native_kernel() -> Any:
    """The library's entry point (`_SIGNATURE`), or None where it cannot be built."""
    return native.function(SOURCE, "lora_columns_bf16", _SIGNATURE, ctypes.c_int, _NEEDS)


def low_kernel() -> Any:
    """The entry point of the LoRA part alone (`_LOW_SIGNATURE`), or None."""
    return native.function(SOURCE, "lora_low_bf16", _LOW_SIGNATURE, ctypes.c_int, _NEEDS)


def delta_kernel() -> Any:
    """The entry point of a key's delta added to its rows (`_DELTA_SIGNATURE`), or None."""
    return native.function(SOURCE, "lora_delta_bf16", _DELTA_SIGNATURE, ctypes.c_int, _NEEDS)


def tiles(allowed: bool = True) -> bool:
    """Let the kernels' product x @ A.T run on the AMX tile unit where the CPU has one (the
    default), or keep it on the AVX-512 blocks (`allowed=False`: both forms on one CPU, for
    the tests and bench/cpu_kernels.py). Returns whether calls now take the tile unit (built
    with AMX, granted by the OS, allowed; input sizes of whole tiles, multiples of 32)."""
    lib = native.library(SOURCE, _NEEDS)
    if lib is None:
        return False
    lib.lora_columns_tiles.argtypes = (ctypes.c_int,)
    lib.lora_columns_tiles.restype = ctypes.c_int
    return bool(lib.lora_columns_tiles(int(allowed)))


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `pack` and `extend` take weights of `dtype` on `device`: bf16 on a CPU whose
    kernel could be built."""
    return device.type == "cpu" and dtype == torch.bfloat16 and native_kernel() is not None


@dataclass(frozen=True)
class DownPairs:
    """A [R, K] down-projection rearranged for the kernel: `pairs` [ceil(K / 2), Rp, 2], Rp
    = R rounded up to 16, zeros in the padding."""

    pairs: torch.Tensor
    rank: int
    in_features: int


def pack(a: torch.Tensor) -> DownPairs:
    """`a` [R, K] bf16 (the stacked down-projections) in the kernel's layout."""
    if a.dim() != 2 or a.dtype != torch.bfloat16 or a.device.type != "cpu":
        raise ValueError("the LoRA columns kernel takes a 2-D bf16 CPU down-projection")
    rank, k = a.shape
    rp, kp = -(-rank // 16) * 16, -(-k // 2) * 2
    padded = torch.zeros((rp, kp), dtype=a.dtype)
    padded[:rank, :k] = a.detach()
    # [Rp, Kp] -> [Kp / 2, Rp, 2]: input pair p's weights for every output, side by side
    pairs = padded.view(rp, kp // 2, 2).transpose(0, 1).contiguous()
    return DownPairs(pairs, rank, k)


@dataclass(frozen=True)
class UpVectors:
    """A group's up-projections for `lora_delta_bf16`: `vectors` [V, ceil(rank / 2), 16, 2],
    output vector v's weights (16 outputs of one member) pair by pair, and `col` [V] int64,
    the first of that member's `rank` columns in the stacked down-projections' product (-1:
    the member has no delta)."""

    vectors: torch.Tensor
    col: torch.Tensor
    rank: int


def pack_up(
    sizes: list[int], ups: list[torch.Tensor | None], dtype: torch.dtype
) -> UpVectors | None:
    """Each member's scale * B [sizes[i], rank] (None: no delta) in the delta kernel's layout,
    their columns of the product in the order given, or None where the kernel does not take
    them: one rank for every member with a delta, each member's outputs a multiple of 16."""
    found = [u for u in ups if u is not None]
    if not found or len({u.shape[1] for u in found}) != 1 or any(n % 16 for n in sizes):
        return None
    rank = found[0].shape[1]
    half = -(-rank // 2)
    blocks: list[torch.Tensor] = []
    cols: list[int] = []
    seen = 0  # members with a delta before this one: its columns follow theirs
    for n, u in zip(sizes, ups, strict=True):
        padded = torch.zeros((n, 2 * half), dtype=dtype)
        if u is not None:
            padded[:, :rank] = u.detach()
        # [n, 2 half] -> [n / 16, 16, half, 2] -> [n / 16, half, 16, 2]
        blocks.append(padded.view(-1, 16, half, 2).transpose(1, 2).contiguous())
        cols += [seen * rank if u is not None else -1] * (n // 16)
        seen += u is not None
    return UpVectors(torch.cat(blocks), torch.tensor(cols, dtype=torch.int64), rank)


def extend(x: torch.Tensor, down: DownPairs) -> torch.Tensor:
    """[x | x @ A.T] for x [rows, K] bf16 (its last dimension contiguous), [rows, K + R]."""
    return _columns(x, down, copy=True)


def low(x: torch.Tensor, down: DownPairs) -> torch.Tensor:
    """x @ A.T alone, [rows, R] for x [rows, K] bf16: `extend`'s last R columns, the same
    values, without the copy of x."""
    return _columns(x, down, copy=False)


def _columns(x: torch.Tensor, down: DownPairs, *, copy: bool) -> torch.Tensor:
    x = _checked(x, down)
    kernel = native_kernel() if copy else low_kernel()
    assert kernel is not None, "the columns are made where available() holds"
    rows, k = x.shape
    out = torch.empty((rows, k + down.rank if copy else down.rank), dtype=x.dtype)
    reads = (x.stride(0) if rows > 1 else k, down.pairs.data_ptr(), rows, k, down.rank)
    operands = (x.data_ptr(), *reads, down.pairs.shape[1], out.data_ptr())
    stride = () if copy else (down.rank,)  # (the LoRA part's own row stride)
    if kernel(*operands, *stride, torch.get_num_threads()):
        raise ValueError("the LoRA columns kernel refused its shapes")
    return out


def _checked(x: torch.Tensor, down: DownPairs) -> torch.Tensor:
    """x as the kernel reads it (rows strided, features contiguous), or ValueError."""
    shape = f"[{down.rank}, {down.in_features}] down-projection"
    return native.bf16_rows(x, down.in_features, "LoRA columns kernel", shape)


def add_delta(
    y: torch.Tensor, x: torch.Tensor, down: DownPairs, up: UpVectors, start: int, end: int
) -> None:
    """y[start:end] += (x[start:end] @ A.T) @ the members' blocks of up, in place, for y [N,
    outputs] (rows contiguous) and x [N, K] bf16 (`lora_delta_bf16`)."""
    x = _checked(x, down)
    kernel = delta_kernel()
    assert kernel is not None, "add_delta is used where available() holds"
    rows = end - start
    if not 0 <= start <= end <= min(x.shape[0], y.shape[0]):
        raise ValueError(f"rows [{start}, {end}) outside the step's {x.shape[0]}")
    if y.stride(1) != 1 or y.shape[1] != 16 * up.col.shape[0] or y.dtype != x.dtype:
        raise ValueError("the LoRA delta kernel takes bf16 outputs of its vectors' width")
    size = x.element_size()
    code = kernel(
        x.data_ptr() + start * x.stride(0) * size,
        x.stride(0) if rows > 1 else x.shape[1],
        down.pairs.data_ptr(),
        rows,
        x.shape[1],
        down.rank,
        down.pairs.shape[1],
        up.vectors.data_ptr(),
        up.col.data_ptr(),
        up.rank,
        up.col.shape[0],
        y.data_ptr() + start * y.stride(0) * size,
        y.stride(0),
        torch.get_num_threads(),
    )
    if code:
        raise ValueError("the LoRA delta kernel refused its shapes")
