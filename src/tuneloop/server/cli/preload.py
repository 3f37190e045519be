"""jemalloc under a CPU engine's server: `tuneloop serve` starts itself again with it preloaded.

A CPU engine's training pass grows glibc's heap to gigabytes of activations; once they are
freed, the decode steps that follow (an RL loop's sampling after each optimizer step) allocate
from that fragmented heap: ~12,000 allocations a sampling call each took 2.5x as long, the
element-wise operations ran ~30 % slower on colder memory, and sampling calls took 1.15x as
long after four training steps as before them (SmolLM2-135M bf16 on an AMX Xeon,
bench/sample_after_training.py, docs/benchmarks.md). jemalloc keeps freed memory in per-size
classes instead, as torch's CPU performance guide advises; with its decay off (freed pages stay
in the process for the next step, as host_allocator.py asks of glibc) the same calls took
1.02x as long after training as before, and no longer before it; a training step ran 1.17x
faster too (its LM head's tiles convert into fresh 2 MB buffers: 483 ms a step on glibc, 37 on
jemalloc).

A library is preloaded only at a process's start, so `serve` starts again (same process id, same
arguments, `os.execve`) with `LD_PRELOAD` naming the system's libjemalloc (Debian's and Ubuntu's
`libjemalloc2`; `make install` installs it) and `MALLOC_CONF` turning its decay off. Only for
the torch engine on a CPU, only where the library is found and not already preloaded, and not
when `TUNELOOP_JEMALLOC=0` (or `serve --no-jemalloc`). Worker processes inherit it.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "DISABLE_ENV",
    "MALLOC_CONF",
    "cpu_engine",
    "jemalloc_environment",
    "restart_with_jemalloc",
]

DISABLE_ENV = "TUNELOOP_JEMALLOC"  # "0": never preload
# Freed pages are never given back (dirty or muzzy): a step's buffers are reused warm.
MALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def _library() -> str | None:
    """The soname of the system's jemalloc, which the dynamic loader finds, or None."""
    return ctypes.util.find_library("jemalloc")


def jemalloc_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`environ` with jemalloc preloaded, or None where it is not wanted or not found, or is
    preloaded already (then the process runs on it: nothing to do)."""
    if environ.get(DISABLE_ENV, "") == "0":
        return None
    preloaded = environ.get("LD_PRELOAD", "")
    if "jemalloc" in preloaded:
        return None
    library = _library()
    if library is None:
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{library} {preloaded}".strip()
    env.setdefault("MALLOC_CONF", MALLOC_CONF)
    return env


def cpu_engine(backend: str, device: str | None) -> bool:
    """Whether the server's engine computes on the CPU: the torch engine, on `--device cpu` or,
    by default, where no NVIDIA device is present (torch's default then is the CPU too; torch
    is not imported to ask it before the restart)."""
    if backend != "torch":
        return False
    if device is not None:
        return device.split(":")[0] == "cpu"
    return not Path("/dev/nvidiactl").exists()


def restart_with_jemalloc() -> None:
    """Start this process again with jemalloc preloaded (see the module docstring); returns
    only where that is not done."""
    if "serve" not in sys.orig_argv[1:]:
        return  # `serve` called inside another program (a CLI test runner): never replace it
    env = jemalloc_environment(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)
