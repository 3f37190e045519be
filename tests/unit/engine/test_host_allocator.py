"""The CPU engine tunes glibc's allocator once per process, and does nothing without glibc."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from tuneloop.server.engine import host_allocator


def test_tuned_once_where_glibc_has_mallopt(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []

    class Mallopt:
        argtypes: object = None
        restype: object = None

        def __call__(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    class Libc:
        mallopt = Mallopt()

    monkeypatch.setattr(host_allocator, "_tuned", None)
    monkeypatch.setattr(host_allocator.ctypes, "CDLL", lambda name: Libc())
    monkeypatch.setattr(host_allocator.ctypes.util, "find_library", lambda name: "libc.so.6")
    assert host_allocator.tune_for_cpu_engine()
    assert dict(calls) == {
        -3: host_allocator.MMAP_THRESHOLD,
        -1: host_allocator.TRIM_THRESHOLD,
        -2: host_allocator.TOP_PAD,
    }
    assert host_allocator.tune_for_cpu_engine()  # once: no second round of calls
    assert len(calls) == 3


def test_without_mallopt_nothing_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_allocator, "_tuned", None)

    def no_libc(name: str) -> object:
        raise OSError("not glibc")

    monkeypatch.setattr(host_allocator.ctypes, "CDLL", no_libc)
    assert not host_allocator.tune_for_cpu_engine()


def test_glibc_accepts_the_values_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C library is glibc, its real mallopt takes every value (none out of range)."""
    name = ctypes.util.find_library("c")
    if not name or not hasattr(ctypes.CDLL(name), "mallopt"):
        pytest.skip("no glibc here")
    monkeypatch.setattr(host_allocator, "_tuned", None)  # tune again, with the real mallopt
    assert host_allocator.tune_for_cpu_engine()


JEMALLOC = ctypes.util.find_library("jemalloc")

_PURGE_CHILD = r"""
import sys
import numpy as np
from tuneloop.server.engine import host_allocator as h

def resident():
    je = h._find_jemalloc()
    je.refresh()
    return je.read("stats.resident")

assert h._find_jemalloc() is not None
print("steady", h.release_fragmentation())  # a small process: far below the slack
blocks = [np.ones((1 << 17) + 512 * i) for i in range(400)]  # ~750 MB of sizes never reused
del blocks
before = resident()
h.SLACK, h.MIN_SLACK_BYTES = 0.0, 0  # any unused page is past the slack now
print("purged", h.release_fragmentation())
print("freed_mb", (before - resident()) >> 20)
"""


@pytest.mark.skipif(JEMALLOC is None, reason="libjemalloc is not installed (make install does)")
def test_unused_jemalloc_pages_are_purged_past_the_slack_only() -> None:
    """In a process on jemalloc with its decay off (as `tuneloop serve` runs on a CPU), the
    freed pages stay resident until they pass the slack over the working set; then one call
    gives them back."""
    env = {
        **os.environ,
        "LD_PRELOAD": JEMALLOC,
        "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1",
    }
    out = subprocess.run(
        [sys.executable, "-c", _PURGE_CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split() for line in out.stdout.splitlines())
    assert lines["steady"] == "False"
    assert lines["purged"] == "True"
    assert int(lines["freed_mb"]) > 150


def test_no_jemalloc_no_release() -> None:
    """This test process runs on glibc (pytest is not preloaded with jemalloc)."""
    if "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("this process runs on jemalloc")
    assert host_allocator._find_jemalloc() is None
    assert host_allocator.release_fragmentation() is False
