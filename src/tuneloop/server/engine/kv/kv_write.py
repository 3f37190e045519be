"""A step's new keys and values written into a CPU pool by one C++ call (kv_write.cpp).

Each layer of a sampling step writes its new keys and values into the pool at the step's
slots. torch's `index_copy_` copies the rows one after another on one thread, and in a
pool of hundreds of MB each destination row is a cache miss: a 128-row decode step's 60
writes took ~2.6 ms, against ~0.4 ms when each destination is asked for a few rows ahead
and the rows are split between torch's threads (ad hoc, docs/benchmarks.md). Any dtype: rows
are copied as bytes, so the bits are `index_copy_`'s. Where the loop does not apply (another
device or dtype, rows not contiguous, a slot outside the pool) or could not be built, the
caller's `index_copy_` runs, with its own error for a bad slot.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine import native

__all__ = ["native_kernel", "write"]

SOURCE = Path(__file__).with_name("kv_write.cpp")
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
# pool, pool rows, row bytes, source, source stride (bytes), slots, tokens, threads
_SIGNATURE = (_POINTER, _SIZE, _SIZE, _POINTER, _SIZE, _POINTER, _SIZE, ctypes.c_int)


def native_kernel() -> Any:
    """kv_write.cpp's entry point (`_SIGNATURE`), or None where it cannot be built."""
    return native.function(SOURCE, "write_slots", _SIGNATURE, ctypes.c_int)


def write(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> bool:
    """`pool.index_copy_(0, slots, rows)` for a CPU pool [slots, ...] (contiguous), rows [n,
    ...] of its dtype and row shape, each row contiguous, slots [n] long; whether it was done
    (False: nothing written, the caller's `index_copy_` to run)."""
    if pool.device.type != "cpu" or rows.device.type != "cpu" or slots.device.type != "cpu":
        return False
    if rows.dtype != pool.dtype or slots.dtype != torch.long or slots.dim() != 1:
        return False
    if rows.shape[1:] != pool.shape[1:] or rows.shape[0] != slots.shape[0] or not len(rows):
        return False
    if not pool.is_contiguous() or not rows[0].is_contiguous() or not slots.is_contiguous():
        return False
    kernel = native_kernel()
    if kernel is None:
        return False
    size = pool.element_size()
    row_bytes = math.prod(pool.shape[1:]) * size
    code = kernel(
        pool.data_ptr(),
        pool.shape[0],
        row_bytes,
        rows.data_ptr(),
        rows.stride(0) * size if rows.shape[0] > 1 else row_bytes,
        slots.data_ptr(),
        slots.shape[0],
        torch.get_num_threads(),
    )
    return code == 0
