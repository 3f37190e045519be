"""C++ kernels of the engine's CPU steps, built at first use for the host CPU and loaded.

Some small kernels cost more in torch's machinery around them than in their arithmetic, or
are written by a compiler in a form far from what the CPU can do (kv/native_decode.py,
lora/native_columns.py, rms_norm.cpp's wrapper in compiled.py, gated_mlp.py, rotary.py).
Their sources ship beside their wrappers; `library` builds one with the system's C++
compiler (the one torch.compile needs on a CPU anyway; `CXX` picks another) for this CPU
(`-march=native`) into a folder of the user's own under the temporary directory, named by a
hash of the source, the headers of its folder and of the engine's folder, the flags, the
compiler's version and the CPU's flags, so a later process loads it without compiling. A
library links the OpenMP runtime torch has already loaded (libgomp.so.1), so its threads are
torch's. Calls go through ctypes, which releases the GIL for them. Where a library cannot be
built (no compiler, a CPU without the instructions it needs, not x86-64 Linux) `library`
gives None, with a warning where the build itself failed, and the callers keep their torch
path.

`TUNELOOP_CPU_ISA=avx2` makes a larger CPU look like an AVX2-only one to these kernels: its
flags are cut to x86-64-v3's (no AVX-512, no AMX, no bf16 instructions) and the sources are
built for that level. With torch's and oneDNN's own caps (`ATEN_CPU_CAPABILITY=avx2`,
`ONEDNN_MAX_CPU_ISA=AVX2`; bench/avx2_only.sh sets all three) the engine takes the paths of an
fp32-only CPU, so they can be measured and tested on a host that has more.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "bf16_rows",
    "bf16_without_autograd",
    "cache_dir",
    "cpu_flags",
    "cpu_rows",
    "function",
    "in_sampling_step",
    "isa_cap",
    "library",
    "plain",
    "sampling_step",
    "without_autograd",
]

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-std=c++20", "-fopenmp", "-fPIC", "-shared")
ISA_VARIABLE = "TUNELOOP_CPU_ISA"
# x86-64-v3's flags as /proc/cpuinfo spells them (abm is LZCNT's): what an AVX2-only CPU lists
# of the ones the kernels ask for
_AVX2_LEVEL = frozenset(
    [
        "fpu",
        "cx8",
        "cmov",
        "mmx",
        "fxsr",
        "sse",
        "sse2",
        "pni",
        "ssse3",
        "sse4_1",
        "sse4_2",
        "popcnt",
        "cx16",
        "lahf_lm",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "bmi1",
        "bmi2",
        "movbe",
        "abm",
        "xsave",
        "osxsave",
    ]
)
_ENGINE = Path(__file__).parent  # its headers are shared by the sources of its subfolders
_state = threading.local()  # `sampling`: inside `sampling_step()` on this thread


@contextlib.contextmanager
def sampling_step() -> Iterator[None]:
    """Inside the block (a sampling step's forward pass, model_runner.py), operations without
    autograd may take their native form (compiled.py's norms)."""
    previous = getattr(_state, "sampling", False)
    _state.sampling = True
    try:
        yield
    finally:
        _state.sampling = previous


def in_sampling_step() -> bool:
    return bool(getattr(_state, "sampling", False))


def without_autograd(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """Whether a loop of `dtype` may take these inputs: each of that dtype on a CPU (the loops
    read raw memory), and none that autograd would record in grad mode (the loops have no
    backward)."""
    if any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def plain(t: torch.Tensor) -> bool:
    """Whether `t` is a tensor or parameter itself, not a subclass (a sharded DTensor, whose
    local shard is not the whole): a loop may read it through its pointer."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def bf16_without_autograd(*tensors: torch.Tensor) -> bool:
    """`without_autograd` for a bf16 loop."""
    return without_autograd(torch.bfloat16, *tensors)


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def bf16_rows(x: torch.Tensor, features: int, kernel: str, operand: str) -> torch.Tensor:
    """`cpu_rows` for a kernel that reads bf16."""
    return cpu_rows(x, torch.bfloat16, features, kernel, operand)


def cpu_rows(
    x: torch.Tensor, dtype: torch.dtype, features: int, kernel: str, operand: str
) -> torch.Tensor:
    """x [rows, features] as a kernel reads it (`dtype` on a CPU, features contiguous, rows
    strided), copied where its layout is another; ValueError naming `kernel` and the `operand`
    x multiplies where it is not such a tensor."""
    if x.dim() != 2 or x.dtype != dtype or x.device.type != "cpu":
        name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
        raise ValueError(f"the {kernel} takes 2-D {name} CPU inputs")
    if x.shape[1] != features:
        raise ValueError(f"inputs of {x.shape[1]} features for a {operand}")
    if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        x = x.contiguous()
    return x


def isa_cap() -> str | None:
    """The string "avx2" where `TUNELOOP_CPU_ISA` asks the kernels to take an AVX2-only CPU's
    paths, None where they take the host's; ValueError naming the variable for any other
    value."""
    value = os.environ.get(ISA_VARIABLE, "").strip().lower()
    if value in ("", "native"):
        return None
    if value != "avx2":
        raise ValueError(f"{ISA_VARIABLE} must be 'avx2' or 'native', not {value!r}")
    return value


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read),
    cut to x86-64-v3's under `TUNELOOP_CPU_ISA=avx2`."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    flags = frozenset(line.partition(":")[2].split())
    return flags & _AVX2_LEVEL if isa_cap() == "avx2" else flags


def _compile_flags() -> tuple[str, ...]:
    if isa_cap() != "avx2":
        return FLAGS
    return tuple("-march=x86-64-v3" if flag == "-march=native" else flag for flag in FLAGS)


def _compiler() -> str | None:
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((path for name in names if (path := shutil.which(name))), None)


def cache_dir() -> Path:
    """A folder only this user can write: nobody else's library is ever loaded from it (nor
    another user's measured choice read: cpu_fp32_matmul.py)."""
    folder = Path(tempfile.gettempdir()) / f"tuneloop-kernels-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise RuntimeError(f"{folder} is not this user's own folder")
    return folder


def _build(source: Path) -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++, clang++ or $CXX)")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    flags = _compile_flags()
    parts = [" ".join(flags), version, " ".join(sorted(cpu_flags()))]
    # the headers beside the source and the engine's own (bf16.h, amx.h, included as "../x.h"
    # from a subfolder) are part of what is built
    headers = sorted({*source.parent.glob("*.h"), *_ENGINE.glob("*.h")})
    texts = [source.read_bytes(), *(h.read_bytes() for h in headers)]
    key = hashlib.sha256(b"\0".join([*texts, *(p.encode() for p in parts)]))
    folder = cache_dir()
    built = folder / f"{source.stem}_{key.hexdigest()[:24]}.so"
    if not built.exists():
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            fresh = Path(scratch) / built.name
            result = subprocess.run(
                [compiler, *flags, "-o", str(fresh), str(source)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
            os.replace(fresh, built)  # atomic: a concurrent process loads one or the other
    return ctypes.CDLL(str(built))


@functools.cache
def library(source: Path, needs: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernels of the C++ file `source`, built for this CPU and loaded; None on a CPU
    without every feature flag in `needs`, or where building fails (with a warning)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if not set(needs) <= cpu_flags():
        return None
    try:
        return _build(source)
    except Exception as exc:  # any failure leaves the caller's torch path
        log.warning("the native kernels of %s could not be built: %s", source.name, exc)
        return None


@functools.cache
def function(
    source: Path,
    name: str,
    argtypes: tuple[Any, ...],
    restype: Any = None,
    needs: tuple[str, ...] = (),
) -> Any:
    """The C function `name` of `library(source, needs)` with its signature set (ctypes
    converts the arguments by it), or None where the library cannot be built."""
    lib = library(source, needs)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn
