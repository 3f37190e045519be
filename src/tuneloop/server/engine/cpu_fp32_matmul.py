"""fp32 products by a frozen weight on a CPU, by oneDNN where it measures faster than torch's.

torch sends a plain fp32 matmul on a CPU to MKL's sgemm, whose kernel on AMD CPUs stops at AVX2:
on a Zen 5 EPYC (AVX-512) sgemm ran a training step's [1408, 576] @ [576, 3072] at 0.21
TFLOP/s, oneDNN's fp32 kernel on the same plain weight at 0.42-0.51; with both capped at AVX2
(bench/avx2_only.sh, an AVX2-only CPU's case) 0.21-0.24 against 0.25-0.26. bf16 matmuls go to
oneDNN already. oneDNN's linear (`mkldnn._linear_pointwise`, the kernel packed.py calls on
packed weights) also takes a plain weight, strided or transposed, reordering it inside the
call: no second copy of any weight is kept.

Which kernel runs is measured at the first call (a training step's rows by an MLP weight,
forward and input gradient, rounds alternated; ~0.7 s on two Zen 3 cores: the torch backend
asks when it loads an fp32 model on a CPU, so that no request waits on it) and kept for later
processes on the host (`_measured`: a worker group's processes choose alike), as
other CPU kernel choices here are (gated_mlp.py's SiLU loops): sgemm is well tuned on other
CPUs (Intel's with AVX-512), and on a Zen 3 EPYC (AVX2) it ran a whole training step 1.17x
faster than oneDNN did; a default must not be one host's.
The products routed here are the ones by a frozen weight over many rows (the base linears'
forward and input gradient, the LM head's tiles); the LoRA factors' small products and their
gradients stay torch's (capped at AVX2, oneDNN ran most of them 1.03-1.21x, a B gradient's
product of transposed inputs 0.6x: about half a percent of a step, not worth a second rule).
oneDNN's sums round differently from sgemm's (within fp32's rounding:
tests/unit/engine/test_cpu_fp32_matmul.py). `TUNELOOP_FP32_ONEDNN=0` or `=1` sets the choice
instead of measuring it (benchmarks compare the two so).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tuneloop.server.engine import native, packed

__all__ = ["addmm_", "choose", "linear", "linear_into", "matmul", "onednn_chosen"]

log = logging.getLogger(__name__)

# oneDNN must beat sgemm by this much on the probe to be taken; a tie keeps torch's own path.
# (A step gains less than its products: on a Zen 5 capped at AVX2, a forward probe read
# 1.11-1.16x where a whole step ran 1.05x faster.)
MIN_SPEEDUP = 1.03
# The probe: a training step's rows by an MLP weight in both of the step's forms, forward
# (x @ W.T) and input gradient (dy @ W), at both of its widths (576 in, 1536 out, and the
# transpose). A forward at 576 alone (the earlier probe, 256 rows) read 0.92-1.06x on a Zen 3
# EPYC, a coin flip, where a whole step ran 0.86x on oneDNN: its input gradients and its
# 1536-wide forwards ran 0.76-0.90x there. Four products of ~12 ms each at 0.15 TFLOP/s.
_ROWS, _IN, _OUT = 1024, 576, 1536
_ROUNDS = 5

VARIABLE = "TUNELOOP_FP32_ONEDNN"
_forced: bool | None = None


_kernels_present = packed.fp32_kernels
_onednn = packed.onednn_linear  # (a module name, so that the tests can watch its calls)


def _probe_products(kernel: str) -> list[Callable[[], torch.Tensor]]:
    """The probe's four products on `kernel` ("torch" or "onednn"): forward and input
    gradient by a [_OUT, _IN] weight and by its transpose."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_ROWS, _IN, generator=generator)
    dy = torch.randn(_ROWS, _OUT, generator=generator)
    w = torch.randn(_OUT, _IN, generator=generator)
    w_t = w.t().contiguous()
    if kernel == "torch":
        return [
            lambda: torch.nn.functional.linear(x, w),
            lambda: dy @ w,
            lambda: torch.nn.functional.linear(dy, w_t),
            lambda: x @ w_t,
        ]
    return [
        lambda: _onednn(x, w, None),
        lambda: _onednn(dy, w.t(), None),
        lambda: _onednn(dy, w_t, None),
        lambda: _onednn(x, w_t.t(), None),
    ]


def _seconds(products: list[Callable[[], torch.Tensor]]) -> float:
    start = time.perf_counter()
    for product in products:
        product()
    return time.perf_counter() - start


def _probe() -> tuple[bool, float]:
    """Times the probe: whether oneDNN ran its products at least MIN_SPEEDUP x faster than
    torch's fp32 matmul (rounds alternated, the median of their ratios), and that ratio."""
    theirs, ours = _probe_products("torch"), _probe_products("onednn")
    try:
        ours[0]()
    except RuntimeError as exc:  # a build whose oneDNN refuses plain fp32 weights
        log.info("oneDNN's fp32 linear is not available here (%s)", exc)
        return False, 0.0
    _seconds(theirs), _seconds(ours)  # each kernel's first calls set up its buffers
    ratios = [_seconds(theirs) / max(_seconds(ours), 1e-9) for _ in range(_ROUNDS)]
    speedup = statistics.median(ratios)
    return speedup >= MIN_SPEEDUP, speedup


_UNKEPT = "the fp32 kernel choice is not kept for other processes (%s)"
# What a recorded choice holds to: a process with other kernels or caps measures again.
_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def _record() -> Path | None:
    """Where this host's choice is kept for later processes (the user's own kernel folder,
    native.py), named by what it depends on; None where no such folder can be had."""
    try:
        folder = native.cache_dir()
    except (OSError, RuntimeError):
        return None
    parts = [torch.__version__, str(torch.get_num_threads()), *sorted(native.cpu_flags())]
    parts += [f"{name}={os.environ.get(name, '')}" for name in _CAPS]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return folder / f"fp32-matmul-{digest}.json"


def _recorded(record: Path) -> tuple[bool, float]:
    """The choice `record` holds, or measured and written there where it holds none."""
    try:
        saved = json.loads(record.read_text())
        return bool(saved["onednn"]), float(saved["speedup"])
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable
        chosen, speedup = _probe()
        try:
            record.write_text(json.dumps({"onednn": chosen, "speedup": speedup}))
        except OSError as exc:
            log.info(_UNKEPT, exc)
        return chosen, speedup


@functools.cache
def _measured() -> bool:
    """Whether oneDNN runs this host's fp32 products: measured once per host (threads, kernels
    and caps) and kept, so that every process of a worker group, and one restarted later,
    makes the same choice. Processes probing at once (a group's workers start together on a
    shared CPU) would each time the other's load, and a near tie would split them between
    the kernels, whose sums round differently: the first takes a lock and measures, the
    others read its result."""
    if not _kernels_present():
        return False
    record, found = _record(), None
    if record is not None:
        try:
            with open(record.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
                found = _recorded(record)
        except OSError as exc:  # no lock to be had: the choice is this process's alone
            log.info(_UNKEPT, exc)
    chosen, speedup = found if found is not None else _probe()
    log.info(
        "oneDNN's fp32 linear is %.2fx torch's here: fp32 products by frozen weights on %s",
        speedup,
        "oneDNN" if chosen else "torch's matmul",
    )
    return chosen


def choose(onednn: bool | None) -> None:
    """Force oneDNN (True: where torch has it) or torch's matmul (False) for every later
    call; None: as measured."""
    global _forced
    _forced = onednn


def _from_environment() -> bool | None:
    """`TUNELOOP_FP32_ONEDNN`: 1 takes oneDNN, 0 torch's matmul, unset or empty measures;
    ValueError naming the variable for any other value."""
    value = os.environ.get(VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{VARIABLE} must be 0 or 1, not {value!r}")
    return None if value == "" else value == "1"


def onednn_chosen() -> bool:
    """Whether fp32 CPU products by frozen weights go to oneDNN in this process: as `choose`
    forced, else as `TUNELOOP_FP32_ONEDNN` says, else as measured."""
    forced = _forced if _forced is not None else _from_environment()
    if forced is not None:
        return forced and _kernels_present()
    return _measured()


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _takes(*tensors: torch.Tensor) -> bool:
    """Plain fp32 CPU inputs (no subclass such as a sharded DTensor: the oneDNN op has no rule
    for them), nothing autograd would record (the call has no backward), oneDNN chosen here."""
    if any(
        type(t) not in _PLAIN or t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors
    ):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return onednn_chosen()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), x [rows, in] or [..., in], weight [out, in] in any strides."""
    if _takes(x, weight, *(() if bias is None else (bias,))):
        return _onednn(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def linear_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ weight.T for 2-D x, written into `out` (a strided view: BLAS writes its rows
    in place; under oneDNN the product is made, then copied)."""
    if _takes(x, weight, out):
        return out.copy_(_onednn(x, weight, None))
    return torch.mm(x, weight.t(), out=out)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for 2-D a [rows, k] and b [k, n] (b as oneDNN's weight b.T, a view)."""
    if _takes(a, b):
        return _onednn(a, b.t(), None)
    return a @ b


def addmm_(into: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """into += a @ b, in place (under oneDNN the product is made, then added)."""
    if _takes(into, a, b):
        return into.add_(_onednn(a, b.t(), None))
    return into.addmm_(a, b)
