"""Start and stop a `tuneloop serve` child process on 127.0.0.1.

Used by the test suite and benchmarks (a real server process, as a user runs it). It only
spawns the `tuneloop` command, so the SDK still never imports the server package.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LiveServer:
    url: str
    key: str
    data_dir: Path
    process: subprocess.Popen[str]


def _tuneloop(*args: str) -> list[str]:
    return [sys.executable, "-m", "tuneloop", *args]


def create_key(data_dir: Path, tenant: str) -> str:
    out = subprocess.run(
        _tuneloop("keys", "--data-dir", str(data_dir), "create", "--tenant", tenant),
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip()


@contextmanager
def live_server(
    data_dir: Path, *extra: str, backend: str = "fake", models: tuple[str, ...] = ()
) -> Iterator[LiveServer]:
    """A server with its own data dir and a key for tenant "alice"; stopped on exit."""
    key = create_key(data_dir, "alice")
    args = ["serve", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir)]
    args += ["--long-poll-s", "5", "--backend", backend]
    for model in models:
        args += ["--model", model]
    process = subprocess.Popen(
        _tuneloop(*args, *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = _wait_ready(process)
        yield LiveServer(url, key, data_dir, process)
    finally:
        stop(process)


def _wait_ready(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            if process.poll() is not None:
                break
            continue
        seen.append(line)
        if line.startswith("tuneloop serving at "):
            # Keep reading the server's output: a full pipe would block the server.
            threading.Thread(target=_drain, args=(process.stdout,), daemon=True).start()
            return line.split(" at ", 1)[1].strip()
    stop(process)
    raise RuntimeError("server did not become ready:\n" + "".join(seen))


def _drain(stream: IO[str]) -> None:
    with contextlib.suppress(ValueError, OSError):  # closed by stop()
        for _line in stream:
            pass


def stop(process: subprocess.Popen[str], timeout: float = 15.0) -> int:
    """SIGTERM by pid, then SIGKILL if it does not exit in time; returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)
    if process.stdout is not None:
        process.stdout.close()
    return int(process.returncode)
