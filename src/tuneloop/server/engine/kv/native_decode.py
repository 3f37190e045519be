"""The decode rows' attention as a C++ kernel, for bf16 pools on x86-64 CPUs with AVX512-BF16.

Inductor's kernel for the same sums (decode_attention.py) sums each score across the vector
lanes one score at a time and runs the softmax's passes on one thread over 9-lane vectors; on
an AVX-512-BF16 EPYC it took 760-960 us a layer of 128 rows x 30-70 slots where this kernel
takes 200-285 us (bench/cpu_kernels.py, docs/benchmarks.md). What it does is described at the
top of `decode_attention_avx512.cpp`: scores by vdpbf16ps, 16 keys' sums across lanes at
once, softmax and value sums in fp32, rows in parallel under OpenMP.

The library is built at first use with the system's C++ compiler (the one torch.compile
needs on a CPU anyway; `CXX` picks another) for this CPU (`-march=native`), into a folder of
the user's own under the temporary directory, named by a hash of the source, the flags, the
compiler's version and the CPU's flags, so a second process loads it without compiling. It
links the OpenMP runtime torch has already loaded (libgomp.so.1), so its threads are torch's.
Calls go through ctypes, which releases the GIL for them. Where it cannot be built (another
CPU, no compiler) `available` is False and the engine keeps inductor's kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tuneloop.server.engine.kv import decode_attention

__all__ = ["attend", "available"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention_avx512.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _compiler() -> str | None:
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((path for name in names if (path := shutil.which(name))), None)


def _cache_dir() -> Path:
    """A folder only this user can write: nobody else's library is ever loaded from it."""
    folder = Path(tempfile.gettempdir()) / f"tuneloop-kernels-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise RuntimeError(f"{folder} is not this user's own folder")
    return folder


def _build() -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++, clang++ or $CXX)")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode()])
    ).hexdigest()[:24]
    folder = _cache_dir()
    library = folder / f"decode_attention_{key}.so"
    if not library.exists():
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            built = Path(scratch) / library.name
            result = subprocess.run(
                [compiler, *FLAGS, "-o", str(built), str(SOURCE)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
            os.replace(built, library)  # atomic: a concurrent process loads one or the other
    lib = ctypes.CDLL(str(library))
    fn = lib.decode_attention_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = (
        [ctypes.c_void_p] * 5
        + [ctypes.c_int64] * 6
        + [ctypes.c_float]
        + [
            ctypes.c_void_p,
            ctypes.c_int,
        ]
    )
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = _cpu_flags().split()
    if "avx512f" not in flags or "avx512_bf16" not in flags:
        return None
    try:
        return _build()
    except Exception as exc:  # any failure leaves inductor's kernel
        log.warning("the native decode attention could not be built, it is not used: %s", exc)
        return None


def available(
    heads: int, kv_heads: int, dim: int, dim_v: int, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether `attend` takes a model's decode steps: bf16 on a CPU whose kernel could be
    built, head sizes multiples of 32, whole groups of query heads per key head."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    if kv_heads <= 0 or heads % kv_heads or dim % 32 or dim_v % 32:
        return False
    return _library() is not None


def attend(
    q: torch.Tensor,  # [rows, heads, dim] bf16
    k_pool: torch.Tensor,  # [slots, kv_heads, dim]
    v_pool: torch.Tensor,  # [slots, kv_heads, dim_v]
    slots: torch.Tensor,  # [rows, context] long: each row's slots, padded with a zero slot
    mask: torch.Tensor,  # [rows, context] bool: which of them the row attends to
    scale: float,
) -> torch.Tensor:
    """`decode_attention.attend`'s result, by the native kernel (`available` must hold); head
    sizes it does not take run that eager function instead."""
    lib = _library()
    assert lib is not None
    bf16 = (q.dtype, k_pool.dtype, v_pool.dtype) == (torch.bfloat16,) * 3
    indices = slots.dtype == torch.long and mask.dtype == torch.bool
    if not (bf16 and indices) or q.device.type != "cpu":  # (the kernel reads raw memory)
        raise ValueError(
            "the native decode attention takes bf16 CPU tensors, long slots, a bool mask"
        )
    rows, heads, dim = q.shape
    dim_v = v_pool.shape[-1]
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    slots, mask = slots.contiguous(), mask.contiguous()
    out = torch.empty((rows, heads, dim_v), dtype=q.dtype, device=q.device)
    code = lib.decode_attention_bf16(
        q.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        slots.data_ptr(),
        mask.data_ptr(),
        rows,
        slots.shape[1],
        heads,
        k_pool.shape[1],
        dim,
        dim_v,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if code:  # head sizes it does not take (a model's checked in `available`; MLA's values
        return decode_attention.attend(q, k_pool, v_pool, slots, mask, scale)  # may differ)
    return out
