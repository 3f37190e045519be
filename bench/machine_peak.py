"""Machine peak: dense matmul TFLOP/s (fp32, bf16) and memory read bandwidth (GB/s) of a device.

The denominators for the engine benchmark's efficiency figures: training MFU is model FLOP/s
over the best matmul rate measured here at the same dtype, and sampling is compared with the
bandwidth bound (weight bytes read per decode step over the read bandwidth measured here).

Matmul: `torch.mm` into a preallocated output, on square sizes and on the shapes a small LLM
runs (tokens x hidden @ hidden x MLP width, and the LM head), 2*M*K*N FLOPs per product; one
untimed call first, then the median of timed repeats, and the best shape is the peak. On a CPU
the same products also run on a weight packed once for oneDNN (the kernel the engine's packed
linears call, packed.py), and the peak is the best of both: torch.mm's fp32 goes to MKL, whose
kernel on AMD CPUs stops at AVX2 (a Zen 5 EPYC: 0.23 TFLOP/s against oneDNN's 0.52 on its
AVX-512 units), so torch.mm alone would understate what the machine does. Shapes
run smallest first; one call slower than 5 s (0.5 s with --quick) is timed once and the larger
shapes of that dtype are skipped, so a dtype with no fast kernel (bf16 on a CPU without bf16
instructions runs ~100x slower than fp32) is reported as slow in seconds, not hours. Read
bandwidth: `sum()` over a float32 buffer far larger than any cache (1 GiB on the CPU, 2 GiB on
a GPU), counted as the buffer's bytes per second; a copy between two such buffers is reported
too (bytes read + written). Both run on torch's threads: `--threads` sets them.

    python bench/machine_peak.py [--device cpu|cuda] [--threads 2] [--quick] [--json peak.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GIB = 1024**3

# (M, K, N). Squares find the kernel's best case; the rest are the shapes the benchmarked models
# run: SmolLM2-135M (hidden 576, MLP 1536, vocab 49152) on the CPU, Qwen3-1.7B / 8B on a GPU.
CPU_SHAPES = [
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (4096, 4096, 4096),
    (1024, 576, 1536),
    (1024, 1536, 576),
    (1024, 576, 49152),
]
CPU_SHAPES_QUICK = [(1024, 1024, 1024), (2048, 2048, 2048), (1024, 576, 1536)]
CUDA_SHAPES = [
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (16384, 16384, 16384),
    (8192, 2048, 6144),
    (8192, 4096, 12288),
    (8192, 4096, 151936),
]
CUDA_SHAPES_QUICK = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 2048, 6144)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds_per_call(
    fn: Callable[[], object], device: torch.device, min_s: float, repeats: int, cap_s: float
) -> tuple[float, bool]:
    """Median over `repeats` of the mean time per call, each repeat running enough calls to
    last about `min_s` (so short kernels are not timer noise); one untimed call first. A call
    slower than `cap_s` is timed once and flagged (a kernel with no fast path, say bf16 on a CPU
    without bf16 instructions, must not hold the run for minutes)."""
    fn()  # warm-up: kernel selection, page faults, allocator
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - start, 1e-6)
    if once > cap_s:
        return once, True
    calls = max(1, math.ceil(min_s / once))
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples), False


def _matmul(
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    min_s: float,
    reps: int,
    cap_s: float,
    kernel: str = "mm",
) -> dict[str, Any]:
    m, k, n = shape
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
    b = torch.randn(k, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(m, n, device=device, dtype=dtype)
    if kernel == "mm":
        seconds, capped = _seconds_per_call(
            lambda: torch.mm(a, b, out=out), device, min_s, reps, cap_s
        )
    else:  # oneDNN on a weight [n, k] packed once, as packed.py multiplies the engine's
        mkldnn = torch.ops.mkldnn
        packed = mkldnn._reorder_linear_weight(b.t().contiguous())
        seconds, capped = _seconds_per_call(
            lambda: mkldnn._linear_pointwise(a, packed, None, "none", [], ""),
            device,
            min_s,
            reps,
            cap_s,
        )
    return {
        "kernel": kernel,
        "dtype": str(dtype).removeprefix("torch."),
        "m": m,
        "k": k,
        "n": n,
        "ms_per_call": round(1000 * seconds, 3),
        "tflops": round(2 * m * k * n / seconds / 1e12, 4),
        "slow_call_timed_once": capped,
    }


def _bandwidth(device: torch.device, gib: float, min_s: float, reps: int) -> dict[str, Any]:
    numel = int(gib * GIB) // 4
    # ones, not empty: every page is touched (mapped) before the clock starts
    src = torch.ones(numel, device=device, dtype=torch.float32)
    read_s, _ = _seconds_per_call(lambda: src.sum(), device, min_s, reps, math.inf)
    dst = torch.empty_like(src)
    copy_s, _ = _seconds_per_call(lambda: dst.copy_(src), device, min_s, reps, math.inf)
    nbytes = numel * 4
    return {
        "buffer_gib": round(nbytes / GIB, 2),
        "read_gb_per_s": round(nbytes / read_s / 1e9, 2),
        "copy_gb_per_s_read_plus_write": round(2 * nbytes / copy_s / 1e9, 2),
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _kernels(device: torch.device) -> list[str]:
    """torch.mm everywhere; on a CPU with oneDNN's packed linear also that ("onednn")."""
    mkldnn = torch.ops.mkldnn
    packed = (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )
    return ["mm", "onednn"] if packed else ["mm"]


def _onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights here: bf16 only on a CPU with bf16 or AVX-512 units."""
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def measure(device: str = "cpu", threads: int | None = None, quick: bool = False) -> dict[str, Any]:
    """Peak matmul TFLOP/s per dtype and read bandwidth of `device`, on `threads` torch threads
    (default: torch's current setting; restored afterwards). `quick` takes a few seconds: fewer,
    smaller shapes, shorter repeats and a smaller (still far above cache) buffer."""
    dev = torch.device(device)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    try:
        if dev.type == "cuda":
            shapes = CUDA_SHAPES_QUICK if quick else CUDA_SHAPES
            gib = 2.0
        else:
            shapes = CPU_SHAPES_QUICK if quick else CPU_SHAPES
            gib = 0.5 if quick else 1.0
        min_s, reps, cap_s = (0.1, 3, 0.5) if quick else (0.5, 5, 5.0)
        matmuls = []
        for kernel in _kernels(dev):
            for dtype in DTYPES.values():
                if kernel == "onednn" and not _onednn_takes(dtype):
                    continue
                # smallest product first; after one slower than the cap, larger ones are skipped
                for shape in sorted(shapes, key=math.prod):
                    matmuls.append(_matmul(dev, dtype, shape, min_s, reps, cap_s, kernel))
                    if matmuls[-1]["slow_call_timed_once"]:
                        break
        memory = _bandwidth(dev, gib, min_s, reps)
        threads_used = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
    peak = {name: max(r["tflops"] for r in matmuls if r["dtype"] == name) for name in DTYPES}
    return {
        "device": dev.type,
        "device_name": _device_name(dev),
        "threads": threads_used if dev.type == "cpu" else None,
        "torch": torch.__version__,
        # torch's vector level (ATEN_CPU_CAPABILITY caps it; bench/avx2_only.sh) and oneDNN's cap
        "cpu_capability": (torch.backends.cpu.get_cpu_capability() if dev.type == "cpu" else None),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") if dev.type == "cpu" else None,
        # fp32 products on a GPU run as plain fp32 unless TF32 is allowed; recorded as measured
        "cuda_matmul_allow_tf32": (
            bool(torch.backends.cuda.matmul.allow_tf32) if dev.type == "cuda" else None
        ),
        "quick": quick,
        "matmul_tflops": peak,
        "read_gb_per_s": memory["read_gb_per_s"],
        "memory": memory,
        "matmul": matmuls,
        "seconds": round(time.perf_counter() - started, 1),
    }


def print_table(result: dict[str, Any], file: Any = sys.stdout) -> None:
    threads = f", {result['threads']} threads" if result["threads"] else ""
    isa = ""
    if result.get("cpu_capability"):
        cap = result.get("onednn_max_cpu_isa")
        isa = f"; torch {result['cpu_capability']}" + (f", oneDNN capped at {cap}" if cap else "")
    print(f"{result['device_name']} ({result['device']}{threads}{isa})", file=file)
    print(
        f"{'kernel':7s} {'dtype':9s} {'M x K x N':>22s} {'ms/call':>10s} {'TFLOP/s':>9s}", file=file
    )
    for r in result["matmul"]:
        shape = f"{r['m']} x {r['k']} x {r['n']}"
        once = "  (slow: timed once, larger shapes skipped)" if r["slow_call_timed_once"] else ""
        print(
            f"{r.get('kernel', 'mm'):7s} {r['dtype']:9s} {shape:>22s} {r['ms_per_call']:10.3f} "
            f"{r['tflops']:9.3f}{once}",
            file=file,
        )
    peak = result["matmul_tflops"]
    memory = result["memory"]
    print(
        f"peak matmul: float32 {peak['float32']:.3f} TFLOP/s, bfloat16 {peak['bfloat16']:.3f} "
        f"TFLOP/s; read bandwidth {memory['read_gb_per_s']:.1f} GB/s (sum over "
        f"{memory['buffer_gib']} GiB), copy {memory['copy_gb_per_s_read_plus_write']:.1f} GB/s "
        f"read + written; {result['seconds']} s",
        file=file,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--quick", action="store_true", help="a few seconds, fewer shapes")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = measure(args.device, args.threads, args.quick)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
