"""glibc's allocator tuned for an engine that computes on the CPU.

A decode step allocates and frees tensors of megabytes (a step's logits and their
probabilities are 25 MB each for 128 rows of a 49k vocabulary). glibc serves an allocation
above its mmap threshold with a fresh mapping and unmaps it on free, so every step faults in
those pages again, and it trims the heap's free top back to the OS. Its dynamic threshold
does not settle for a mix of sizes. Fixing the threshold at 32 MB (above those buffers; the
largest the dynamic threshold reaches on 64-bit) and keeping up to 1 GB of freed heap took a
SmolLM2-135M bf16 decode step of 128 rows from 119.9 to 116.0 ms (medians of three alternated
runs on an AMX Xeon); in runs where the dynamic threshold had not settled, the head and the
draw, whose buffers are the largest, took 11.0 and 13.2 ms against 8.2 and 9.9 tuned. It is
what torch's CPU performance guide gets from jemalloc or tcmalloc. The cost: up to 1 GB of
freed memory stays in the process, for the next step to reuse.

Process-wide and once; a no-op where the C library is not glibc (`mallopt` missing).

Under jemalloc with its decay off (`tuneloop serve` on a CPU, cli/preload.py) no freed page
goes back to the OS, which is what keeps a step's buffers warm, but sizes that never recur
fragment it: a bf16 SmolLM2-135M training loop of new 8 x 64-256-token batches grew from 2.9
to 8.7 GB resident in 60 steps, and its steps slowed by a fifth, when its packed lengths were
not bucketed (packing.py). `release_fragmentation()`, after each engine call, purges jemalloc's
unused pages once the resident memory exceeds SLACK x the working set (the bytes allocated at
rest plus the largest peak the calling thread's recent calls reached, jemalloc's
`thread.peak`); in a steady loop (2.5 GB resident against a 1.9 GB working set) it never
does: a purge after every step cost 15 % of the step time in page faults.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import logging
from typing import Any

__all__ = ["release_fragmentation", "tune_for_cpu_engine"]

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_tuned: bool | None = None

# Purge jemalloc's unused pages past SLACK x the working set, and never below MIN_SLACK_BYTES
# above it; the working set counts the largest of the last PEAKS calls' peaks.
SLACK = 2.0
MIN_SLACK_BYTES = 1 << 30
PEAKS = 32
_ARENAS_ALL = 4096  # jemalloc's MALLCTL_ARENAS_ALL


class _Jemalloc:
    """The few `mallctl` names used here, on the jemalloc this process runs on."""

    def __init__(self, mallctl: Any) -> None:
        self._mallctl = mallctl
        self.peaks: collections.deque[int] = collections.deque(maxlen=PEAKS)

    def read(self, name: str) -> int:
        value, size = ctypes.c_uint64(0), ctypes.c_size_t(8)
        if self._mallctl(name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0):
            raise OSError(f"mallctl {name} failed")
        return value.value

    def call(self, name: str) -> None:
        if self._mallctl(name.encode(), None, None, None, 0):
            raise OSError(f"mallctl {name} failed")

    def refresh(self) -> None:
        """jemalloc's statistics are a snapshot taken at an `epoch` write."""
        epoch, size = ctypes.c_uint64(1), ctypes.c_size_t(8)
        self._mallctl(b"epoch", ctypes.byref(epoch), ctypes.byref(size), ctypes.byref(epoch), 8)


_jemalloc: _Jemalloc | bool | None = False  # False: not looked up yet


def _find_jemalloc() -> _Jemalloc | None:
    """The jemalloc this process allocates with (preloaded, so its `mallctl` is a global
    symbol), if its statistics and per-thread peaks work."""
    global _jemalloc
    if _jemalloc is False:
        _jemalloc = None
        try:
            mallctl = ctypes.CDLL(None).mallctl
            mallctl.restype = ctypes.c_int
            pointer = ctypes.c_void_p
            mallctl.argtypes = [ctypes.c_char_p, pointer, pointer, pointer, ctypes.c_size_t]
            found = _Jemalloc(mallctl)
            found.refresh()
            found.read("stats.resident")
            found.read("thread.peak.read")
            found.call("thread.peak.reset")
            _jemalloc = found
        except (OSError, AttributeError):
            log.debug("no jemalloc with statistics here: nothing to release")
    return _jemalloc if isinstance(_jemalloc, _Jemalloc) else None


def release_fragmentation() -> bool:
    """After an engine call, on its thread: purge jemalloc's unused pages if they have grown
    past the working set's slack (see the module). Whether it purged; False off jemalloc."""
    je = _find_jemalloc()
    if je is None:
        return False
    try:
        je.peaks.append(je.read("thread.peak.read"))
        je.call("thread.peak.reset")
        je.refresh()
        resident = je.read("stats.resident")
        working = je.read("stats.allocated") + max(je.peaks)
        if resident <= max(SLACK * working, working + MIN_SLACK_BYTES):
            return False
        je.call(f"arena.{_ARENAS_ALL}.purge")
    except OSError as exc:
        log.warning("reading or purging jemalloc failed: %s", exc)
        return False
    log.info(
        "purged jemalloc's unused pages: %.2f GB resident against a %.2f GB working set",
        resident / 1e9,
        working / 1e9,
    )
    return True


def tune_for_cpu_engine() -> bool:
    """Set the thresholds above (once per process); whether they are set."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.debug("no glibc mallopt here: the host allocator keeps its defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    )
    _tuned = all(mallopt(param, value) == 1 for param, value in settings)
    log.info("host allocator tuned for CPU compute: %s", _tuned)
    return _tuned
