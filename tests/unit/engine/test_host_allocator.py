"""The CPU engine tunes glibc's allocator once per process, and does nothing without glibc."""

from __future__ import annotations

import ctypes

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
