"""The decode rows' attention as C++ kernels: bf16 pools on x86-64 CPUs with AVX512-BF16, fp32
pools on those with AVX2 and FMA.

Inductor's kernel for the same sums (decode_attention.py) sums each score across the vector
lanes one score at a time and runs the softmax's passes on one thread over 9-lane vectors; on
an AVX-512-BF16 EPYC it took 760-960 us a layer of 128 rows x 30-70 slots where the bf16
kernel takes 200-285 us (bench/cpu_kernels.py, docs/benchmarks.md), and at fp32 9.3-11.5 ms
a layer of 128 rows x 470-570 slots where the fp32 kernel takes 5.6 ms (its reads of the
pool are what is left). What they do is described at the top of
`decode_attention_avx512.cpp` and `decode_attention_avx2.cpp`: scores summed across lanes 16
(8) keys at a time, softmax and value sums in fp32, rows in parallel under OpenMP, the pool's
lines asked for ahead. They are built and loaded by native.py; where one cannot be,
`available` is False for its dtype and the engine keeps inductor's kernel.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine import native
from tuneloop.server.engine.kv import decode_attention

__all__ = ["attend", "available", "fp32_kernel", "kernel_for", "native_kernel"]

SOURCE = Path(__file__).with_name("decode_attention_avx512.cpp")
FP32_SOURCE = Path(__file__).with_name("decode_attention_avx2.cpp")


_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
# q, k_pool, v_pool, slots, mask; rows, width, heads, kv_heads, dim, dim_v; scale; out; threads
_SIGNATURE = (*[_POINTER] * 5, *[_SIZE] * 6, ctypes.c_float, _POINTER, ctypes.c_int)


def native_kernel(name: str = "decode_attention_bf16") -> Any:
    """The library's entry point, or None where it cannot be built. (Its twin
    "decode_attention_bf16_generic" makes every row by the loop for any head shape, which
    the common shapes' loop must match bit for bit.)"""
    return native.function(SOURCE, name, _SIGNATURE, ctypes.c_int, ("avx512f", "avx512_bf16"))


def fp32_kernel() -> Any:
    """The fp32 library's entry point ("decode_attention_fp32"), or None where it cannot be
    built."""
    return native.function(
        FP32_SOURCE, "decode_attention_fp32", _SIGNATURE, ctypes.c_int, ("avx2", "fma")
    )


def kernel_for(dtype: torch.dtype) -> Any:
    """The entry point for pools of `dtype`: bf16's, else the fp32 one (None where not built)."""
    return native_kernel() if dtype == torch.bfloat16 else fp32_kernel()


# Head sizes each kernel takes: multiples of its vectors' reach.
_DIVISOR = {torch.bfloat16: 32, torch.float32: 16}


def available(
    heads: int, kv_heads: int, dim: int, dim_v: int, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether `attend` takes a model's decode steps: bf16 (head sizes multiples of 32) or
    fp32 (of 16) on a CPU whose kernel could be built, whole groups of query heads per key
    head."""
    if device.type != "cpu" or dtype not in _DIVISOR:
        return False
    if kv_heads <= 0 or heads % kv_heads or dim % _DIVISOR[dtype] or dim_v % _DIVISOR[dtype]:
        return False
    return kernel_for(dtype) is not None


def attend(
    q: torch.Tensor,  # [rows, heads, dim] bf16 or fp32
    k_pool: torch.Tensor,  # [slots, kv_heads, dim]
    v_pool: torch.Tensor,  # [slots, kv_heads, dim_v]
    slots: torch.Tensor,  # [rows, context] long: each row's slots, padded with a zero slot
    mask: torch.Tensor,  # [rows, context] bool: which of them the row attends to
    scale: float,
) -> torch.Tensor:
    """`decode_attention.attend`'s result, by the native kernel of q's dtype (`available`
    must hold for it); head sizes it does not take run that eager function instead."""
    dtype = q.dtype
    same = dtype in _DIVISOR and k_pool.dtype == dtype and v_pool.dtype == dtype
    indices = slots.dtype == torch.long and mask.dtype == torch.bool
    if not (same and indices) or q.device.type != "cpu":  # (the kernel reads raw memory)
        raise ValueError(
            "the native decode attention takes bf16 or fp32 CPU tensors of one dtype, long "
            "slots, a bool mask"
        )
    kernel = kernel_for(dtype)
    assert kernel is not None
    low, high = torch.aminmax(slots) if slots.numel() else (slots.new_zeros(()),) * 2
    if int(low) < 0 or int(high) >= min(k_pool.shape[0], v_pool.shape[0]):
        raise ValueError("a decode row's slot lies outside the pool")  # never read past it
    rows, heads, dim = q.shape
    dim_v = v_pool.shape[-1]
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    slots, mask = slots.contiguous(), mask.contiguous()
    out = torch.empty((rows, heads, dim_v), dtype=q.dtype, device=q.device)
    code = kernel(
        q.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        slots.data_ptr(),
        mask.data_ptr(),
        rows,
        slots.shape[1],
        heads,
        k_pool.shape[1],
        dim,
        dim_v,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if code:  # head sizes it does not take (a model's checked in `available`; MLA's values
        return decode_attention.attend(q, k_pool, v_pool, slots, mask, scale)  # may differ)
    return out
