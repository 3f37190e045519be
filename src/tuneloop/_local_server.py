"""Start and stop a `tuneloop serve` child process on 127.0.0.1.

Used by the test suite and benchmarks (a real server process, as a user runs it). It only
spawns the `tuneloop` command, so the SDK still never imports the server package.
"""

from __future__ import annotations

import contextlib
import os
import queue
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

# Long enough for a first start that converts the packaged model (~16 s) and imports torch.
READY_TIMEOUT_S = 300.0


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


def start_server(
    data_dir: Path,
    *extra: str,
    key: str,
    backend: str = "fake",
    models: tuple[str, ...] = (),
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> LiveServer:
    """Start `tuneloop serve` on a free port of 127.0.0.1 and wait until it is ready.

    The server watches this process and stops by itself if it dies (even by SIGKILL), so it
    never outlives its owner.
    """
    args = ["serve", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir)]
    args += ["--long-poll-s", "5", "--backend", backend, "--parent-pid", str(os.getpid())]
    for model in models:
        args += ["--model", model]
    process, url, _printed = launch([*args, *extra], ready_timeout_s)
    return LiveServer(url, key, data_dir, process)


def launch(
    args: list[str], ready_timeout_s: float = READY_TIMEOUT_S
) -> tuple[subprocess.Popen[str], str, str]:
    """Run `tuneloop ARGS`, a command that prints `tuneloop serving at URL` once it accepts
    requests (`serve`, `deploy`), and wait for that: (process, URL, what it printed until then).
    A command that exits or is not ready in time is stopped and raises RuntimeError."""
    process = subprocess.Popen(
        _tuneloop(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue[str | None] = queue.Queue(maxsize=1000)
    # Keep reading the server's output for its whole life: a full pipe would block it.
    threading.Thread(target=_drain, args=(process.stdout, lines), daemon=True).start()
    try:
        url, printed = _wait_ready(lines, ready_timeout_s)
    except BaseException:
        stop(process)
        raise
    return process, url, printed


@contextmanager
def live_server(
    data_dir: Path, *extra: str, backend: str = "fake", models: tuple[str, ...] = ()
) -> Iterator[LiveServer]:
    """A server with its own data dir and a key for tenant "alice"; stopped on exit."""
    server = start_server(
        data_dir, *extra, key=create_key(data_dir, "alice"), backend=backend, models=models
    )
    try:
        yield server
    finally:
        stop(server.process)


def _wait_ready(lines: queue.Queue[str | None], timeout: float) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:  # the server exited
            break
        seen.append(line)
        if line.startswith("tuneloop serving at "):
            return line.split(" at ", 1)[1].strip(), "".join(seen)
    raise RuntimeError("server did not become ready:\n" + "".join(seen[-40:]))


def _drain(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    """Pass the server's output lines on until it ends (the caller reads only the first)."""
    with contextlib.suppress(ValueError, OSError):  # closed by stop()
        for line in stream:
            with contextlib.suppress(queue.Full):  # nobody reads after startup: drop
                lines.put_nowait(line)
    lines.put(None)


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
