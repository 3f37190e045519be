"""The LoRA factors' gradients, S^T @ G, by one C++ call on CPUs with AVX512-BF16 and no AMX.

A training pass's adapted layer (ops.py's one-adapter node, siblings.py's group; the head's
tiles in fused_head.py for dB) ends its backward with dA = dlow^T @ x and dB = dy^T @ low:
sums over every row of the pass with one narrow side (the rank's 32 columns, or a sibling
group's). oneDNN runs them at a fifth to two thirds of the bf16 peak on the vector unit.
`lora_grads_avx512.cpp` makes them from the operands where they lie (the narrow one
rearranged into row pairs), each entry summed in fp32 and rounded once, as oneDNN's kernel
does (in another order of the sums): on a Zen 5 EPYC's training steps, 138 -> 81 ms a step
across both threads' parts, the steps 1.01-1.02x (docs/benchmarks.md). Where the CPU has AMX
oneDNN takes the tile unit, which this kernel does not use, so it is left to torch there;
where the kernel cannot be built the products stay torch's.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine import native

__all__ = ["available", "kernel_product", "native_kernel", "transposed_product"]

SOURCE = Path(__file__).with_name("lora_grads_avx512.cpp")
_NEEDS = ("avx512f", "avx512bw", "avx512_bf16")
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
# s, lds, g, ldg; k, m, n; c, ldc; transposed, threads
_SIGNATURE = (
    _POINTER, _SIZE, _POINTER, _SIZE, _SIZE, _SIZE, _SIZE, _POINTER, _SIZE, ctypes.c_int,
    ctypes.c_int,
)  # fmt: skip
_NATIVE = True  # (bench/train_variants.py switches it off to compare: --variant lora-grads)


def native_kernel() -> Any:
    """The library's entry point (`_SIGNATURE`), or None where it cannot be built."""
    return native.function(SOURCE, "lora_tn_bf16", _SIGNATURE, ctypes.c_int, _NEEDS)


def available(*tensors: torch.Tensor) -> bool:
    """Whether `transposed_product` takes these operands natively: bf16 CPU tensors, on a CPU
    without AMX whose kernel could be built."""
    if not _NATIVE or any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        return False
    return "amx_bf16" not in native.cpu_flags() and native_kernel() is not None


def transposed_product(
    s: torch.Tensor, g: torch.Tensor, *, transposed: bool = False
) -> torch.Tensor:
    """s^T @ g for s [K, M] and g [K, N] ([M, N]), or with `transposed` its transpose g^T @ s
    ([N, M]), contiguous: by the kernel where `available`, else by torch. Autograd does not
    see the kernel: for a backward pass's own products."""
    if s.dim() != 2 or g.dim() != 2 or s.shape[0] != g.shape[0]:
        raise ValueError(f"S^T @ G needs [K, M] and [K, N], not {list(s.shape)}, {list(g.shape)}")
    if not available(s, g) or 0 in (s.shape[1], g.shape[1]):
        return (g.t() @ s) if transposed else (s.t() @ g)
    return kernel_product(s, g, transposed=transposed)


def kernel_product(s: torch.Tensor, g: torch.Tensor, *, transposed: bool = False) -> torch.Tensor:
    """`transposed_product` by the kernel whatever the CPU's AMX (the tests run it on every
    CPU that can build it); bf16 CPU operands of positive widths, their features contiguous
    (copied where not)."""
    kernel = native_kernel()
    if kernel is None:
        raise RuntimeError("the LoRA gradient kernel is not built on this CPU")
    k, m = s.shape
    n = g.shape[1]
    s = native.bf16_rows(s, m, "LoRA gradient kernel", "narrow side")
    g = native.bf16_rows(g, n, "LoRA gradient kernel", "wide side")
    out = torch.empty((n, m) if transposed else (m, n), dtype=torch.bfloat16)
    code = kernel(
        s.data_ptr(),
        s.stride(0) if k > 1 else m,
        g.data_ptr(),
        g.stride(0) if k > 1 else n,
        k,
        m,
        n,
        out.data_ptr(),
        out.stride(0),
        int(transposed),
        torch.get_num_threads(),
    )
    if code:
        raise ValueError(f"the LoRA gradient kernel refused [{k}, {m}] and [{k}, {n}]")
    return out
