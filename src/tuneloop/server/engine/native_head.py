"""A training pass's LM head tiles' element-wise work as C++ loops on a CPU, bf16 or fp32.

fused_head.py computes the head tile by tile: per tile of logits, its rows' running maximum,
sum of exponentials and targets' logits (forward), and the logits' gradient (backward). Eager
torch makes those in five to seven fp32 passes over each tile; head_tile.h makes each in one
pass over the tile, a row at a time, at the tile's width (head_tile.cpp: bf16,
head_tile_fp32.cpp: fp32). On SmolLM2-135M (a 49,152-word head) on an AMX Xeon, the bf16 head
of a 1,252-token training step took 131.7 -> 88.9 ms forward and 159.5 -> 121.6 ms backward
with them, the step 1.045x faster; at fp32 on an Ice Lake Xeon (AVX-512, no bf16 units), the
head of 704 rows on one thread 615 -> 510 ms forward and 643 -> 558 ms backward, and on a Zen 3
EPYC (AVX2, 8 lanes) 597 -> 541 and 608 -> 582 (docs/benchmarks.md).

The loops' exp is SLEEF's expf_u10 as torch's vectorized kernels call it; their sums run in
another order than torch's, so a row's logsumexp differs from eager's by a few fp32 ulps, and
a gradient by an ulp of its exp at fp32, or by a bf16 step where that moves its rounding
(tests/unit/engine/test_native_head.py). They take CPU tiles of a head without a logit softcap,
bf16 where the CPU has AVX512-BF16, fp32 where it has AVX512F or AVX2 and FMA, and where the
library could be built; elsewhere fused_head.py's torch code runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine import native

__all__ = ["backward_kernel", "backward_tile", "forward_kernel", "forward_tile", "takes"]

# each width's source, its functions' suffix and the CPU features it needs
_SOURCES = {
    torch.bfloat16: (Path(__file__).with_name("head_tile.cpp"), "bf16", ("avx512f", "avx512_bf16")),
    torch.float32: (Path(__file__).with_name("head_tile_fp32.cpp"), "fp32", ("avx2", "fma")),
}
_P, _I = ctypes.c_void_p, ctypes.c_int64
# raw, ld, rows, n, v0, targets, k; high, total, picked; threads
_FORWARD = (_P, _I, _I, _I, _I, _P, _I, _P, _P, _P, ctypes.c_int)
# raw, ld, rows, n, v0, targets, k; lse, g_sum, g; d; threads
_BACKWARD = (_P, _I, _I, _I, _I, _P, _I, _P, _P, _P, _P, ctypes.c_int)


def _kernel(dtype: torch.dtype, part: str, signature: tuple[Any, ...]) -> Any:
    if dtype not in _SOURCES:
        return None
    source, suffix, needs = _SOURCES[dtype]
    return native.function(source, f"head_tile_{part}_{suffix}", signature, ctypes.c_int, needs)


def forward_kernel(dtype: torch.dtype = torch.bfloat16) -> Any:
    """head_tile_forward_<bf16|fp32> (`_FORWARD`) for tiles of `dtype`, or None where it
    cannot be built (or no loop takes that dtype)."""
    return _kernel(dtype, "forward", _FORWARD)


def backward_kernel(dtype: torch.dtype = torch.bfloat16) -> Any:
    """head_tile_backward_<bf16|fp32> (`_BACKWARD`) for tiles of `dtype`, or None where it
    cannot be built (or no loop takes that dtype)."""
    return _kernel(dtype, "backward", _BACKWARD)


def takes(raw: torch.Tensor, softcap: float | None) -> bool:
    """Whether the loops take this tile of logits: bf16 or fp32 on a CPU, rows each
    contiguous, no softcap, both kernels of its dtype built."""
    if softcap or raw.device.type != "cpu" or raw.dim() != 2 or raw.stride(1) != 1:
        return False
    return forward_kernel(raw.dtype) is not None and backward_kernel(raw.dtype) is not None


def _rows(t: torch.Tensor, r0: int) -> int:
    """The address of row r0 of a contiguous tensor."""
    return t.data_ptr() + r0 * t.stride(0) * t.element_size()


def _check(targets: torch.Tensor, *fp32: torch.Tensor) -> None:
    """The loops read raw memory: int64 targets [N, K] and fp32 statistics, each contiguous."""
    if targets.dtype != torch.int64 or targets.dim() != 2 or not targets.is_contiguous():
        raise ValueError("the head tile's loops take contiguous int64 targets [N, K]")
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in fp32):
        raise ValueError("the head tile's loops take contiguous fp32 statistics")


def _call(
    kernel: Any,
    part: str,
    raw: torch.Tensor,
    tile: tuple[int, int, int, int],
    targets: torch.Tensor,
    stats: tuple[torch.Tensor, ...],
    *after: int,
) -> None:
    """One loop's call on tile `tile` of `raw`: the tile, its rows' targets and fp32 `stats`
    (each from the tile's first row), then `after` (addresses), then the thread count."""
    r0, r1, v0, v1 = tile
    _check(targets, *stats)
    code = kernel(
        raw.data_ptr(), raw.stride(0), r1 - r0, v1 - v0, v0, _rows(targets, r0),
        targets.shape[1], *(_rows(t, r0) for t in stats), *after, torch.get_num_threads(),
    )  # fmt: skip
    if code:
        raise ValueError(f"the head tile's {part} loop refused its shapes")


def forward_tile(
    raw: torch.Tensor,
    tile: tuple[int, int, int, int],
    targets: torch.Tensor,
    high: torch.Tensor,
    total: torch.Tensor,
    picked: torch.Tensor,
) -> None:
    """fused_head._forward_tile for a bf16 or fp32 tile `raw` [r1 - r0, v1 - v0] (`takes`):
    its rows' running maximum `high`, sum of exponentials `total` and targets' logits `picked`
    ([N, K], as targets), updated in place. targets int64, each tensor contiguous."""
    _call(forward_kernel(raw.dtype), "forward", raw, tile, targets, (high, total, picked))


def backward_tile(
    raw: torch.Tensor,
    tile: tuple[int, int, int, int],
    targets: torch.Tensor,
    lse: torch.Tensor,
    g_sum: torch.Tensor,
    g: torch.Tensor,
) -> torch.Tensor:
    """The tile's gradient of its logits at raw's dtype, [r1 - r0, v1 - v0]: exp(z - lse) * -g_sum
    plus the targets' gradients g ([N, K], as targets) in their columns. lse, g_sum [N] fp32,
    each tensor contiguous."""
    r0, r1, v0, v1 = tile
    d = torch.empty((r1 - r0, v1 - v0), dtype=raw.dtype)
    _call(backward_kernel(raw.dtype), "backward", raw, tile, targets, (lse, g_sum, g), d.data_ptr())
    return d
