"""Frozen linear weights packed once for oneDNN's kernels on a CPU.

torch runs a CPU's bf16 matmul through oneDNN, which reorders the weight into its blocked
layout (AMX tiles, AVX-512-BF16 pairs) on every call. At decode sizes (~128 rows) that reorder
is about a third of each matmul (bench/cpu_kernels.py). A weight read by every decode step
and never changed, a lone adapter's merged copy, is reordered once instead, with the op
inductor's freezing pass uses (`mkldnn._reorder_linear_weight`), and multiplied by
`mkldnn._linear_pointwise`: the same kernel on the same layout, so the same bits as
`functional.linear` (tests/unit/engine/test_packed.py). The packed weight replaces the plain
copy, so it costs no memory beyond it.

fp32 is packed too on x86-64: torch sends a plain fp32 matmul to MKL's sgemm, and oneDNN's fp32
kernel on a packed weight ran a decode step's 211 linears 1.40x (AVX2 EPYC) and 1.45x
(AVX-512 EPYC) faster at 128 rows, and faster at every row count from 1 to 1,024 (1.07x there);
another kernel, so its sums round differently from sgemm's (~1e-6 relative, fp32 rounding).
"""

from __future__ import annotations

import platform

import torch
from torch.nn import functional

from tuneloop.server.engine import native

__all__ = ["fp32_kernels", "linear", "onednn_linear", "pack", "packable"]

_HALF = (torch.bfloat16, torch.float16)
# x86-64's machine names: where oneDNN's packed fp32 kernel was measured against MKL's sgemm
# (module docstring), and whose CPU flags name the bf16 units below.
_X86_64 = ("x86_64", "amd64")
# An x86-64 CPU's bf16 units. oneDNN calls bf16 supported on AVX-512 CPUs without them too
# (Skylake to Ice Lake Xeons), where it emulates it: there a packed weight's sums rounded apart
# from functional.linear's (a bf16 step in one of 3,072 outputs at 2 rows, an Ice Lake Xeon),
# and emulated bf16 gains nothing from packing.
_BF16_UNITS = frozenset({"avx512_bf16", "amx_bf16"})


def _kernels() -> bool:
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def fp32_kernels() -> bool:
    """Whether oneDNN's fp32 linear runs here and was measured against MKL's sgemm: x86-64
    (cpu_fp32_matmul.py calls it on plain weights too)."""
    return _kernels() and platform.machine().lower() in _X86_64


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) by oneDNN's linear: a packed weight, or a plain one in any strides
    (reordered inside the call)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def packable(weight: torch.Tensor) -> bool:
    """Whether `weight` [out, in] can be packed: a CPU tensor in a half dtype that this CPU's
    oneDNN has native kernels for, or fp32 on x86-64 (where it was measured faster than MKL).
    Elsewhere it stays a plain tensor: GPUs have no such reorder and emulated bf16 gains
    nothing."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not _kernels():
        return False
    if weight.dtype == torch.float32:
        return fp32_kernels()
    if weight.dtype not in _HALF:
        return False
    mkldnn = torch.ops.mkldnn
    if weight.dtype == torch.bfloat16:
        x86 = platform.machine().lower() in _X86_64
        if x86 and not _BF16_UNITS & native.cpu_flags():
            return False
        return bool(mkldnn._is_mkldnn_bf16_supported())
    return bool(mkldnn._is_mkldnn_fp16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's layout (an opaque mkldnn tensor, `.is_mkldnn`) where `packable`,
    else `weight` itself. (The reorder's row-count hint is left out: with and without a hint
    of 128 rows, 128-row products took the same time, 107 against 110 us medians.)"""
    if not packable(weight):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`functional.linear(x, weight, bias)` for a plain or a packed weight."""
    if not weight.is_mkldnn:
        return functional.linear(x, weight, bias)
    return onednn_linear(x, weight, bias)
