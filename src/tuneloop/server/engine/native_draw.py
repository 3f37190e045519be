"""A decode step's draw on the CPU as one C++ call (draw.cpp): tokens, logsumexps, finiteness.

draw.py's torch form reads a step's [rows, V] logits six times over (block maxima, a minimum,
a softmax that writes [rows, V] probabilities, their block sums, the gathers) and needs them
in fp32, so the head's bf16 output was first copied to a fresh fp32 tensor. At 128 rows x
49,152 tokens on an AVX-512-BF16 EPYC, a step's draw of fp32 logits took 5.7 ms and of a bf16
head's, copy included, 14.2 ms; draw.cpp makes two passes over the head's own output, 2.2 and
2.3 ms (bench/draw_step.py, docs/benchmarks.md). It draws every row, greedy and tempered
rows included, as if unfiltered; draw.py keeps the top-k logprobs (from the block maxima this
call returns).

Rows with top-k or top-p take a second call (`draw_filtered`). The torch form sorts each such
row's whole vocabulary: 128 rows of 49,152 tokens took ~330 ms a step on an AMX Xeon, where the
unfiltered draw takes ~3.5. The kernel bins a row's exp(logit - max) by their top bits, sorts
only the bins' candidates that the filters can keep, and filters and draws them as the torch
form does (tied probabilities in ascending token order, which torch's sort leaves unspecified).

Its exp is a polynomial rather than torch's, and its sums add in another order, so a row's
probabilities differ from torch's softmax in the last bits: a token differs from the torch
form's only where the row's uniform falls within that rounding of a boundary between two
tokens, and the logsumexp agrees with log_softmax's to ~1e-6 (tests/unit/engine/test_draw.py).
Which form draws a row depends on the host and that row's own parameters only, never on the
rows beside it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine import native

__all__ = ["available", "draw", "draw_filtered", "takes"]

SOURCE = Path(__file__).with_name("draw.cpp")

_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
# logits, bf16; rows, vocab, stride, block; u, temperature, greedy; tokens, logsumexp, finite,
# maxima; threads
_SIGNATURE = (
    _POINTER,
    ctypes.c_int,
    *[_SIZE] * 4,
    *[_POINTER] * 3,
    *[_POINTER] * 4,
    ctypes.c_int,
)


# logits, bf16; count, rows, vocab, stride; u, temperature, top_k, top_p; tokens; threads
_FILTERED = (
    _POINTER,
    ctypes.c_int,
    _SIZE,
    _POINTER,
    _SIZE,
    _SIZE,
    *[_POINTER] * 5,
    ctypes.c_int,
)


def _kernel() -> Any:
    return native.function(SOURCE, "draw_rows", _SIGNATURE)


def _filtered_kernel() -> Any:
    return native.function(SOURCE, "draw_filtered_rows", _FILTERED, ctypes.c_int)


def available() -> bool:
    """Whether the kernel could be built for this host (x86-64 Linux with a C++ compiler)."""
    return _kernel() is not None


def takes(logits: torch.Tensor) -> bool:
    """Whether `draw` takes these logits: [rows, V] fp32 or bf16 on a CPU, each row's tokens
    contiguous, and the kernel built."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return False
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        return False
    return available()


def draw(
    logits: torch.Tensor,
    u: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's token [R] int64 (the argmax for greedy rows), its logits' logsumexp at
    temperature 1 [R] fp64 (NaN where a logit is NaN or infinite), whether they are all finite
    [R] bool, and the maxima of each `block` tokens [R, ceil(V / block)] fp32 (NaN in a row
    that is not finite). u [R] fp32 in (0, 1], temperature [R] fp32, greedy [R] bool;
    `takes(logits)` must hold."""
    kernel = _kernel()
    assert kernel is not None
    assert takes(logits)
    rows, vocab = logits.shape
    u = u.to(torch.float32).contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    greedy = greedy.to(torch.bool).contiguous()
    if not (u.shape == temperature.shape == greedy.shape == (rows,)):
        raise ValueError("u, temperature and greedy need one value per row")
    tokens = torch.empty(rows, dtype=torch.long)
    logsumexp = torch.empty(rows, dtype=torch.float64)
    finite = torch.empty(rows, dtype=torch.bool)
    maxima = torch.empty((rows, -(-vocab // block)), dtype=torch.float32)
    kernel(
        logits.data_ptr(),
        int(logits.dtype == torch.bfloat16),
        rows,
        vocab,
        logits.stride(0),
        block,
        u.data_ptr(),
        temperature.data_ptr(),
        greedy.data_ptr(),
        tokens.data_ptr(),
        logsumexp.data_ptr(),
        finite.data_ptr(),
        maxima.data_ptr(),
        torch.get_num_threads(),
    )
    return tokens, logsumexp, finite, maxima


def draw_filtered(
    logits: torch.Tensor,
    rows: torch.Tensor,
    u: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """The tokens [F] int64 of the rows `rows` [F] of logits under their top-k ([F], the
    vocabulary where none), then top-p ([F], 1 where none), at their uniform and temperature
    ([F] each): draw.py's `_filtered_draw` of their tempered softmax, tied probabilities in
    ascending token order; -1 in a row with a logit that is not finite. `takes(logits)` must
    hold."""
    kernel = _filtered_kernel()
    assert kernel is not None
    assert takes(logits)
    count, (height, vocab) = rows.shape[0], logits.shape
    rows = rows.to(torch.int64).contiguous()
    u = u.to(torch.float32).contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    top_k = top_k.to(torch.int64).contiguous()
    top_p = top_p.to(torch.float32).contiguous()
    if not (rows.shape == u.shape == temperature.shape == top_k.shape == top_p.shape == (count,)):
        raise ValueError("rows, u, temperature, top_k and top_p need one value per filtered row")
    if count and (int(rows.min()) < 0 or int(rows.max()) >= height):
        raise ValueError(f"rows must index the logits' {height} rows")
    tokens = torch.empty(count, dtype=torch.long)
    code = kernel(
        logits.data_ptr(),
        int(logits.dtype == torch.bfloat16),
        count,
        rows.data_ptr(),
        vocab,
        logits.stride(0) if height > 1 else vocab,
        u.data_ptr(),
        temperature.data_ptr(),
        top_k.data_ptr(),
        top_p.data_ptr(),
        tokens.data_ptr(),
        torch.get_num_threads(),
    )
    if code:
        raise ValueError(f"top_k must lie in [1, {vocab}] and temperatures above 0")
    return tokens
