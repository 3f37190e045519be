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

__all__ = ["DownPairs", "available", "extend", "native_kernel", "pack"]

SOURCE = Path(__file__).with_name("lora_columns_avx512.cpp")
_NEEDS = ("avx512f", "avx512_bf16")
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
# x, ldx, pairs; rows, k, r, rp; out; threads
_SIGNATURE = (_POINTER, _SIZE, _POINTER, *[_SIZE] * 4, _POINTER, ctypes.c_int)


def native_kernel() -> Any:
    """The library's entry point (`_SIGNATURE`), or None where it cannot be built."""
    return native.function(SOURCE, "lora_columns_bf16", _SIGNATURE, ctypes.c_int, _NEEDS)


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


def extend(x: torch.Tensor, down: DownPairs) -> torch.Tensor:
    """[x | x @ A.T] for x [rows, K] bf16 (its last dimension contiguous), [rows, K + R]."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError("the LoRA columns kernel takes 2-D bf16 CPU inputs")
    if x.shape[1] != down.in_features:
        shape = f"[{down.rank}, {down.in_features}]"
        raise ValueError(f"inputs of {x.shape[1]} features for a {shape} down-projection")
    if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        x = x.contiguous()
    kernel = native_kernel()
    assert kernel is not None, "extend is used where available() holds"
    rows, k = x.shape
    out = torch.empty((rows, k + down.rank), dtype=x.dtype)
    code = kernel(
        x.data_ptr(),
        x.stride(0) if rows > 1 else k,
        down.pairs.data_ptr(),
        rows,
        k,
        down.rank,
        down.pairs.shape[1],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if code:
        raise ValueError("the LoRA columns kernel refused its shapes")
    return out
