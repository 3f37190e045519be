"""`tuneloop serve` with the torch engine on a CPU runs on the system's jemalloc (cli/preload.py).

Real server processes: the library is read from the running server's memory map, with the
default and with `--no-jemalloc`. `make install` installs the library (Debian's libjemalloc2);
where it is missing the default server runs on glibc's allocator and this file says so.
"""

from __future__ import annotations

import ctypes.util
from pathlib import Path

import pytest

from tuneloop._local_server import create_key, start_server, stop
from tuneloop.server.cli import preload

TINY = "tuneloop/tiny-qwen3"
LIBRARY = ctypes.util.find_library("jemalloc")


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(LIBRARY is None, reason="libjemalloc is not installed (make install does)")
def test_a_cpu_torch_server_runs_on_jemalloc_unless_told_not_to(tmp_path: Path) -> None:
    loaded = {}
    for flag in ("--jemalloc", "--no-jemalloc"):
        data = tmp_path / flag.strip("-")
        data.mkdir()
        key = create_key(data, "t")
        server = start_server(
            data, flag, "--device", "cpu", key=key, backend="torch", models=(TINY,)
        )
        try:
            loaded[flag] = "libjemalloc" in _maps(server.process.pid)
        finally:
            assert stop(server.process) == 0
    assert loaded == {"--jemalloc": True, "--no-jemalloc": False}


def test_the_environment_names_the_library_once_and_keeps_what_was_preloaded() -> None:
    base = {"PATH": "/usr/bin", "LD_PRELOAD": "libother.so"}
    env = preload.jemalloc_environment(base)
    if LIBRARY is None:
        assert env is None  # nothing to preload: the server runs on glibc's allocator
        return
    assert env is not None
    assert env["LD_PRELOAD"] == f"{LIBRARY} libother.so"
    assert env["MALLOC_CONF"] == preload.MALLOC_CONF
    assert env["PATH"] == "/usr/bin"
    assert preload.jemalloc_environment(env) is None  # preloaded: no second start
    assert preload.jemalloc_environment({**base, preload.DISABLE_ENV: "0"}) is None
    mine = preload.jemalloc_environment({"MALLOC_CONF": "narenas:2"})
    assert mine is not None
    assert mine["MALLOC_CONF"] == "narenas:2"  # an operator's own setting is kept


def test_only_a_cpu_torch_engine_asks_for_it() -> None:
    assert preload.cpu_engine("torch", "cpu")
    assert not preload.cpu_engine("torch", "cuda")
    assert not preload.cpu_engine("torch", "cuda:1")
    assert not preload.cpu_engine("fake", "cpu")
    assert preload.cpu_engine("torch", None) == (not Path("/dev/nvidiactl").exists())


def test_only_a_process_started_as_serve_is_started_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` run inside another program (a CLI test runner) never replaces that program."""
    import os
    import sys

    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv(preload.DISABLE_ENV, raising=False)
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "pytest", "tests"])
    preload.restart_with_jemalloc()
    assert calls == []
    argv = ["python", "-m", "tuneloop", "serve", "--port", "0"]
    monkeypatch.setattr(sys, "orig_argv", argv)
    preload.restart_with_jemalloc()
    if LIBRARY is None:
        assert calls == []
        return
    [(path, new_argv, env)] = calls
    assert (path, new_argv) == (sys.executable, argv)
    assert env["LD_PRELOAD"] == LIBRARY
