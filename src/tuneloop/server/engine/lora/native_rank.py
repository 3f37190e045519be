"""A training pass's LoRA products with the rank's narrow side, by C++ calls on CPUs with
AVX512-BF16 and no AMX.

An adapted layer of a training pass (ops.py's one-adapter node, siblings.py's group, the
head's tiles in fused_head.py) makes, beside its frozen matmul, products with one side of
the rank's width (32 columns, or a sibling group's): forward low = x @ A.T, backward dlow =
dy @ B and the factors' gradients dA = dlow^T @ x, dB = dy^T @ low (sums over the pass's
rows). oneDNN runs them on the vector unit at a fifth to four fifths of the bf16 peak
(SmolLM2-135M's 736-row training parts on a Zen 5 EPYC: 0.18-0.40 TFLOP/s a thread against
0.47 for the layers' own matmuls; a tenth of a thread's step). `lora_rank_avx512.cpp` makes
them from the operands where they lie, the narrow one rearranged into row pairs for
`vdpbf16ps`, the wide one's next rows asked for ahead; each entry summed in fp32 and rounded
once, as oneDNN's kernel does (in another order of the sums). Where the CPU has AMX oneDNN
takes the tile unit, which these kernels do not use, so the products stay torch's there, as
they do where the kernels cannot be built, off bf16 and off the CPU.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine import native

__all__ = [
    "available",
    "kernel_narrow_product",
    "kernel_transposed_product",
    "narrow_kernel",
    "narrow_product",
    "transposed_kernel",
    "transposed_product",
]

SOURCE = Path(__file__).with_name("lora_rank_avx512.cpp")
_NEEDS = ("avx512f", "avx512bw", "avx512_bf16")
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
# s, lds, g, ldg; k, m, n; c, ldc; transposed, threads
_TN_SIGNATURE = (
    _POINTER, _SIZE, _POINTER, _SIZE, _SIZE, _SIZE, _SIZE, _POINTER, _SIZE, ctypes.c_int,
    ctypes.c_int,
)  # fmt: skip
# x, ldx, w, ldw, w_rows_are_outputs; rows, k, m; c, ldc; threads
_NN_SIGNATURE = (
    _POINTER, _SIZE, _POINTER, _SIZE, ctypes.c_int, _SIZE, _SIZE, _SIZE, _POINTER, _SIZE,
    ctypes.c_int,
)  # fmt: skip
_NATIVE = True  # (bench/train_variants.py switches it off to compare: --variant rank-products)


def transposed_kernel() -> Any:
    """The entry point of S^T @ G (`_TN_SIGNATURE`), or None where it cannot be built."""
    return native.function(SOURCE, "lora_tn_bf16", _TN_SIGNATURE, ctypes.c_int, _NEEDS)


def narrow_kernel() -> Any:
    """The entry point of X @ W with W narrow (`_NN_SIGNATURE`), or None."""
    return native.function(SOURCE, "lora_nn_bf16", _NN_SIGNATURE, ctypes.c_int, _NEEDS)


def available(*tensors: torch.Tensor) -> bool:
    """Whether the products take these operands natively: bf16 CPU tensors, on a CPU without
    AMX whose kernels could be built."""
    if not _NATIVE or any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        return False
    return "amx_bf16" not in native.cpu_flags() and transposed_kernel() is not None


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
    return kernel_transposed_product(s, g, transposed=transposed)


def narrow_product(x: torch.Tensor, w: torch.Tensor, *, outputs_first: bool) -> torch.Tensor:
    """x [rows, K] times a narrow W: x @ w.T for w [M, K] (`outputs_first`: a down-projection
    A) or x @ w for w [K, M] (an up-projection B as dlow = dy @ B), [rows, M]: by the kernel
    where `available`, else by torch. Autograd does not see the kernel: for the adapted
    layers' own autograd nodes."""
    k = w.shape[1] if outputs_first else w.shape[0]
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != k:
        raise ValueError(
            f"X @ W needs [rows, K] and W of K inputs, not {list(x.shape)}, {list(w.shape)}"
        )
    if not available(x, w) or 0 in (x.shape[0], k, w.numel()):
        return x @ w.t() if outputs_first else x @ w
    return kernel_narrow_product(x, w, outputs_first=outputs_first)


def kernel_transposed_product(
    s: torch.Tensor, g: torch.Tensor, *, transposed: bool = False
) -> torch.Tensor:
    """`transposed_product` by the kernel whatever the CPU's AMX (the tests run it on every
    CPU that can build it); bf16 CPU operands of positive widths, their features contiguous
    (copied where not)."""
    kernel = transposed_kernel()
    if kernel is None:
        raise RuntimeError("the LoRA rank kernels are not built on this CPU")
    k, m = s.shape
    n = g.shape[1]
    s = native.bf16_rows(s, m, "LoRA rank kernel", "narrow side")
    g = native.bf16_rows(g, n, "LoRA rank kernel", "wide side")
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
        raise ValueError(f"the LoRA rank kernel refused [{k}, {m}] and [{k}, {n}]")
    return out


def kernel_narrow_product(x: torch.Tensor, w: torch.Tensor, *, outputs_first: bool) -> torch.Tensor:
    """`narrow_product` by the kernel whatever the CPU's AMX; bf16 CPU operands of positive
    sizes, their features contiguous (copied where not)."""
    kernel = narrow_kernel()
    if kernel is None:
        raise RuntimeError("the LoRA rank kernels are not built on this CPU")
    rows, k = x.shape
    m = w.shape[0] if outputs_first else w.shape[1]
    x = native.bf16_rows(x, k, "LoRA rank kernel", "input")
    w = native.bf16_rows(w, w.shape[1], "LoRA rank kernel", "narrow weights")
    out = torch.empty((rows, m), dtype=torch.bfloat16)
    code = kernel(
        x.data_ptr(),
        x.stride(0) if rows > 1 else k,
        w.data_ptr(),
        w.stride(0) if w.shape[0] > 1 else w.shape[1],
        int(outputs_first),
        rows,
        k,
        m,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if code:
        raise ValueError(f"the LoRA rank kernel refused [{rows}, {k}] by {list(w.shape)}")
    return out
