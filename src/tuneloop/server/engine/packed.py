"""Frozen linear weights packed once for oneDNN's bf16/fp16 kernels on a CPU.

torch runs a CPU's bf16 matmul through oneDNN, which reorders the weight into its blocked
layout (AMX tiles, AVX-512-BF16 pairs) on every call. At decode sizes (~128 rows) that reorder
is about a third of each matmul (bench/cpu_kernels.py). A weight read by every decode step
and never changed, a lone adapter's merged copy, is reordered once instead, with the op
inductor's freezing pass uses (`mkldnn._reorder_linear_weight`), and multiplied by
`mkldnn._linear_pointwise`: the same kernel on the same layout, so the same bits as
`functional.linear` (tests/unit/engine/test_packed.py). The packed weight replaces the plain
copy, so it costs no memory beyond it.
"""

from __future__ import annotations

import torch
from torch.nn import functional

__all__ = ["linear", "pack", "packable"]

_HALF = (torch.bfloat16, torch.float16)


def _kernels() -> bool:
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def packable(weight: torch.Tensor) -> bool:
    """Whether `weight` [out, in] can be packed: a CPU tensor in a half dtype that this CPU's
    oneDNN has native kernels for (elsewhere it stays a plain tensor: GPUs have no such reorder,
    fp32 goes to MKL, and emulated bf16 gains nothing)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in _HALF:
        return False
    if not _kernels():
        return False
    mkldnn = torch.ops.mkldnn
    if weight.dtype == torch.bfloat16:
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
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
