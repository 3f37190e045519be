"""The base model's weight dtype, chosen per device by measurement.

bf16 weights halve the bytes every matmul and decode step reads; where the hardware multiplies
bf16 natively (GPU tensor cores, CPU matrix units such as AMX) they are also several times faster
to multiply. Where it does not (CPUs without bf16 instructions) bf16 is emulated and slower than
fp32. So on a CPU a short timed matmul decides: bf16 only if it beats fp32 by a clear margin.
Mixed precision on top of it, as mixed-precision trainers do: LoRA factors are fp32 masters with
fp32 AdamW state, their products run in this dtype (lora/slots.py), the LM head runs in it with
its log-softmax accumulated in fp32 (logprobs.py), and losses and their sums are fp32.

The probe runs in a child process: on a CPU without bf16 instructions, one emulated bf16 matmul
left the server's own fp32 work ~1.6x slower for the rest of its life (measured: sampling 27 vs
44-57 tok/s on SmolLM2). Where /proc/cpuinfo shows no bf16 instructions at all, there is
nothing to probe.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
import time

import torch

from tuneloop.server.engine import native

log = logging.getLogger(__name__)

# bf16 must be this much faster than fp32 on the probe to be chosen: matrix units (AMX) measure
# several x, emulated bf16 (an AVX2-only CPU) ~0.02x, so noise on a busy machine cannot flip it.
MIN_BF16_SPEEDUP = 1.5
# Small enough that the probe costs milliseconds where bf16 is emulated (~50x slower), large
# enough that matrix units show their speed: [tokens, hidden] @ [hidden, hidden].
_PROBE_SHAPE = (128, 512, 512)


def _best_seconds(a: torch.Tensor, b: torch.Tensor, repeats: int = 3) -> float:
    a @ b  # warm-up: kernel selection, packing of weights
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


def probe_speedup() -> float:
    """fp32 time / bf16 time of the probe matmul, in this process (the child's entry point)."""
    m, k, n = _PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator)
    b = torch.randn(k, n, generator=generator)
    fp32 = _best_seconds(a, b)
    bf16 = _best_seconds(a.bfloat16(), b.bfloat16())
    return fp32 / bf16


def cpu_bf16_flags() -> bool | None:
    """Whether the CPU lists bf16 instructions (AVX-512-BF16, AMX); None if it can't be read.
    Under `TUNELOOP_CPU_ISA=avx2` (native.py) it lists none: weights stay fp32 unprobed."""
    flags = native.cpu_flags()
    if not flags:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_bf16_speedup() -> float:
    """fp32 time / bf16 time of the probe matmul on this CPU, with the current thread count;
    0.0 when the CPU has no bf16 instructions (not probed)."""
    if cpu_bf16_flags() is False:
        return 0.0
    code = (
        f"import torch; torch.set_num_threads({torch.get_num_threads()}); "
        "from tuneloop.server.engine.dtypes import probe_speedup; print(probe_speedup())"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        )
        return float(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        log.warning("the bf16 probe failed (%s): weights stay fp32", exc)
        return 0.0


def choose_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it and on CPUs where it measures faster; fp32 otherwise."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type != "cpu":
        return torch.float32
    speedup = cpu_bf16_speedup()
    chosen = torch.bfloat16 if speedup >= MIN_BF16_SPEEDUP else torch.float32
    log.info("bf16 matmul is %.2fx fp32 on this CPU: weights in %s", speedup, chosen)
    return chosen
