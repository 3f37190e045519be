"""Decode weights in a layout of our own, multiplied by C++ kernels (bf16: AVX512-BF16; fp32: AVX2).

A sampling step's linears run on weights made once for it (lora/fused.py): packed for
oneDNN's bf16 kernel (packed.py) where this kernel is not built. On an AVX-512-BF16 EPYC that
kernel read a decode step's weights at 21-24 GB/s at 1-8 rows, where the cores read 37 GB/s,
so a step of a few rows (one user's chat, a short eval) was slower than the memory allows.
`linear_avx512.cpp` on its own layout ("blocks": 64 outputs' weights for each input pair in
one 256-byte run, a block one stream) read them at 28-31 GB/s there (decode steps 1.39-1.48x
faster at 1-4 rows), ran 1.21x oneDNN's speed at 32 rows and 1.04x at 128 (95 % of the host's
measured bf16 peak; bench/native_linear.py, docs/benchmarks.md). The blocks replace the
packed copy, so they cost no memory beyond it.

Where the CPU has AMX the kernel runs on the tile unit (input sizes of whole tiles, multiples
of 32; `tiles`), on the same layout. oneDNN's kernel ran on the tiles too, but at a 128-row
decode step it read cold weights at ~8 GB/s, the read and the arithmetic taking turns; the
tile form asks for the next block's weights while a block's products run, and its whole
layer loop can run in one C++ call (native_layers.py). `TUNELOOP_NATIVE_LINEAR=0` keeps
oneDNN's packed layout everywhere. Another kernel, so its sums round differently from
oneDNN's (a bf16 step in a few outputs); the modules and the lean loops (decode_layers.py,
native_layers.py) make the same calls, so they agree bit for bit with each other.

fp32 weights take `linear_fp32.cpp` on CPUs with AVX2 and FMA (an fp32 model's sampling
steps: a CPU without bf16 units, or a model asked for at fp32): blocks of 16 outputs' weights
for each input, [ceil(N / 16), K, 16], in tiles of AVX2 vectors or, where the CPU has them,
AVX-512 vectors (the same sums in the same order: the same bits). On a Zen 3 EPYC (AVX2)
oneDNN's packed fp32 kernel ran a 128-row step's linears at 75 % of the fp32 peak and one
row's at ~25 GB/s; the AVX2 tiles ran them 1.03-1.13x and 1.30-1.39x faster. On an AVX-512
Zen 4 EPYC the AVX-512 tiles ran a step's linears 1.6-2.0x oneDNN's fp32 kernel at 1-2 rows,
1.2-1.5x at 4-8, 1.13-1.23x at 16-32 and 1.08x at 128 (a prefill's 512-2,048 rows: 0.98-1.04x),
where the AVX2 tiles ran 0.76-0.90x at 4-32 rows (bench/native_linear.py --dtype float32).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine import native

__all__ = [
    "NativeWeight",
    "available",
    "fp32_kernel",
    "kernel_for",
    "linear",
    "native_kernel",
    "pack",
    "tiles",
    "zero_spans",
]

SOURCE = Path(__file__).with_name("linear_avx512.cpp")
_NEEDS = ("avx512f", "avx512_bf16")
FP32_SOURCE = Path(__file__).with_name("linear_fp32.cpp")
_FP32_NEEDS = ("avx2", "fma")
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
# x, ldx, rows, k, w, bias, n, y, ldy, threads, spans
_SIGNATURE = (
    _POINTER, _SIZE, _SIZE, _SIZE, _POINTER, _POINTER, _SIZE, _POINTER, _SIZE, ctypes.c_int,
    _POINTER,
)  # fmt: skip
_BLOCK = 64  # outputs a block (bf16)
_ZERO_SPANS = True  # (bench/native_linear.py --part spans switches it off to compare)
_FP32_BLOCK = 16


def native_kernel() -> Any:
    """The library's entry point (`_SIGNATURE`), or None where it cannot be built."""
    return native.function(SOURCE, "linear_bf16", _SIGNATURE, ctypes.c_int, _NEEDS)


def fp32_kernel() -> Any:
    """linear_fp32.cpp's entry point (`_SIGNATURE`, fp32 pointers), or None where it cannot be
    built (a CPU without AVX2 and FMA)."""
    return native.function(FP32_SOURCE, "linear_fp32", _SIGNATURE, ctypes.c_int, _FP32_NEEDS)


def tiles(allowed: bool | None = True) -> bool:
    """Let the kernel run on the AMX tile unit where the CPU has one (the default), or keep it
    on the AVX-512 loops (`allowed=False`: both forms on one CPU, for the tests and
    bench/native_linear.py); None leaves the switch as it is. Returns whether calls now take
    the tile unit (built with AMX, granted by the OS, allowed; input sizes of whole tiles,
    multiples of 32)."""
    switch = native.function(SOURCE, "linear_bf16_tiles", (ctypes.c_int,), ctypes.c_int, _NEEDS)
    return switch is not None and bool(switch(-1 if allowed is None else int(allowed)))


def kernel_for(dtype: torch.dtype) -> Any:
    """The entry point for weights of `dtype` (bf16: `native_kernel`, fp32: `fp32_kernel`),
    or None for another dtype or where it cannot be built."""
    if dtype == torch.bfloat16:
        return native_kernel()
    return fp32_kernel() if dtype == torch.float32 else None


def _takes(weight: torch.Tensor) -> bool:
    """Whether `pack` takes `weight`: a 2-D CPU tensor whose dtype's kernel is built here (bf16
    with AVX512-BF16, fp32 with AVX2 and FMA)."""
    if weight.dim() != 2 or weight.device.type != "cpu":
        return False
    return kernel_for(weight.dtype) is not None


def available(weight: torch.Tensor) -> bool:
    """Whether decode weights like `weight` go in the kernel's layout: `pack` takes it and
    TUNELOOP_NATIVE_LINEAR is not 0."""
    if os.environ.get("TUNELOOP_NATIVE_LINEAR", "1") == "0":
        return False
    return _takes(weight)


@dataclass(frozen=True)
class NativeWeight:
    """A weight [N, K] (and its bias) in the kernel's layout: `blocks` [ceil(N / 64), ceil(K /
    2), 64, 2] bf16 or [ceil(N / 16), K, 16] fp32, zeros past N and K; `bias` [blocks x
    outputs a block] fp32 or None; `spans` (bf16) None or int32 [ceil(N / 64), 4]: the input
    pairs each block multiplies, [s0, s1) then [s2, s3), the others all zeros (`zero_spans`)."""

    blocks: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    spans: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        """[N, K], as the plain weight's."""
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (self.blocks, self.bias, self.spans) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def zero_spans(blocks: torch.Tensor, scanned_from: int = 0) -> torch.Tensor | None:
    """For bf16 `blocks` [nb, pairs, 64, 2]: each block's input pairs to multiply, int32 [nb,
    4] ([s0, s1) then [s2, s3)), leaving out the block's zero pairs before its first nonzero
    pair, after its last, and its longest run of zero pairs between; None where no block has
    a zero pair to leave out. Only pairs from `scanned_from` on are read: those before it
    are taken to hold weights (a head-sized weight scanned whole took 56 ms, about half its
    packing; its 32 LoRA columns 4.4 ms).

    A lone key's sibling group (lora/fused.py) holds each member's up-projection in its own
    rank's extra columns and zeros in the other members' (q/k/v: two thirds of 96 columns,
    gate/up: half of 64; a fresh adapter's B is all zeros); a block's zero pairs add exactly
    nothing to its sums, so leaving them out keeps every output's bits (for finite inputs).
    The kernel leaves them out in calls of more than 16 rows (linear_avx512.cpp says why; not
    on the AMX tile unit): a 128-row step's linears 1.01-1.03x faster on a Zen 4 EPYC."""
    count, pairs = blocks.shape[0], blocks.shape[1]
    scanned = blocks[:, scanned_from:].ne(0).flatten(2).any(2)
    if bool(scanned.all()):
        return None
    live = torch.cat([scanned.new_ones((count, min(scanned_from, pairs))), scanned], dim=1)
    # (in tensor operations: a fresh adapter's copy has zero pairs in every block, hundreds
    # of blocks of hundreds of pairs, and the copy is made again for every sampler snapshot)
    index = torch.arange(pairs).expand(count, pairs)
    any_live = live.any(1)
    first = live.int().argmax(1)
    last = pairs - live.flip(1).int().argmax(1)
    # the last live pair strictly before each pair (-1: none), so a live pair's gap before it
    seen = torch.where(live, index, -1).cummax(1).values
    before = torch.cat([torch.full((count, 1), -1), seen[:, :-1]], dim=1)
    gaps = torch.where(live & (before >= 0), index - before - 1, 0)
    after = gaps.argmax(1)  # the live pair after the longest run (the first such run)
    gap = gaps.gather(1, after[:, None])[:, 0]
    start = torch.where(gap > 0, after - gap, last)
    spans = torch.stack([first, start, start + gap, last], dim=1)
    return spans.where(any_live[:, None], 0).to(torch.int32)


def pack(
    weight: torch.Tensor, bias: torch.Tensor | None = None, extra_from: int = 0
) -> NativeWeight:
    """`weight` [N, K] bf16 or fp32 (and `bias` [N]) in its kernel's layout; bf16 with the
    spans of its zero pairs (`zero_spans`) in the input columns from `extra_from` on (a lone
    key's LoRA columns: fused.py), or in all of them (0)."""
    if not _takes(weight):
        raise ValueError(
            "the native linear kernel takes a 2-D CPU weight, bf16 (AVX512-BF16) or fp32 "
            "(AVX2 and FMA)"
        )
    n, k = weight.shape
    # bf16: 64 outputs' weights for each input pair; fp32: 16 outputs' for each input
    block, pair = (_FP32_BLOCK, 1) if weight.dtype == torch.float32 else (_BLOCK, 2)
    nb, kp = -(-n // block), -(-k // pair)
    padded = torch.zeros((nb * block, pair * kp), dtype=weight.dtype)
    padded[:n, :k] = weight.detach()
    # [nb * block, pair kp] -> [nb, block, kp, pair] -> [nb, kp, block, pair]
    blocks = padded.view(nb, block, kp, pair).transpose(1, 2).contiguous()
    if pair == 1:
        blocks = blocks.squeeze(-1)  # [nb, k, block]
    wide = None
    if bias is not None:
        wide = torch.zeros(nb * block, dtype=torch.float32)
        wide[:n] = bias.detach().float()
    spans = zero_spans(blocks, extra_from // 2) if pair == 2 and _ZERO_SPANS else None
    return NativeWeight(blocks, wide, n, k, spans)


def linear(x: torch.Tensor, weight: NativeWeight) -> torch.Tensor:
    """x [rows, K] (features contiguous) @ W.T + bias, [rows, N], in the weight's dtype."""
    shape = f"[{weight.out_features}, {weight.in_features}] weight"
    dtype = weight.blocks.dtype
    x = native.cpu_rows(x, dtype, weight.in_features, "native linear kernel", shape)
    kernel = kernel_for(dtype)
    assert kernel is not None, "linear is used on packed weights: the kernel is built"
    rows, n = x.shape[0], weight.out_features
    y = torch.empty((rows, n), dtype=x.dtype)
    bias = weight.bias.data_ptr() if weight.bias is not None else None
    code = kernel(
        x.data_ptr(),
        x.stride(0) if rows > 1 else x.shape[1],
        rows,
        x.shape[1],
        weight.blocks.data_ptr(),
        bias,
        n,
        y.data_ptr(),
        n,
        torch.get_num_threads(),
        weight.spans.data_ptr() if weight.spans is not None else None,
    )
    if code:
        raise ValueError("the native linear kernel refused its shapes")
    return y
