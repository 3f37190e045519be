"""Decode steps replayed as CUDA graphs against eager decode steps (engine/decode_graphs.py).

A random-weight Qwen3 of bench/engine.py's `--random-init` sizes at `--dtype`, a rank-32 LoRA
on every linear layer and the LM head after one optimizer step (its B no longer zero), sampled
through a snapshot as bench/engine.py does: 32 prompts of 16-48 random tokens x 4 samples x
`--new` tokens, no early stop, 128 decode rows.
One in-process `TorchBackend`; two sides, alternated call by call so that machine noise hits
both alike:
- "eager": `decode_graphs=False`, every decode step issued op by op from the host;
- "graphs": `decode_graphs=True`, each decode step one replay of its bucket's graph (made in
  the warm-up call and kept: the adapter does not change).
Per side: the median decode step (a call of `--new` tokens minus a call of 4, per step), the
median call's tokens/s, and the bandwidth fraction (weights read per step, bench/engine.py's
count, over the step time and `--peak-json`'s read bandwidth). Also: graphs captured, and how
many samples of the graph side equal the eager side's token for token (the padded batch may
round differently in bf16 and part two samples after a near tie). Prints the device.
`--compiled` then measures both sides again with the RMSNorms compiled (engine/compiled.py:
Triton kernels on CUDA), the graphs made again; `--profile` adds, per side, the device kernels
a decode step runs and the device's busy time in it (torch.profiler), against its wall time.

    python bench/decode_graphs.py --device cuda --random-init qwen3-8b \\
        --peak-json bench/results/peak_cuda_h200.json [--compiled] [--profile] [--json out.json]
    python bench/decode_graphs.py --device cpu --random-init tiny --dtype float32   # smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import (
    ALPHA,
    BETAS,
    DTYPES,
    EPS,
    LR,
    RANDOM_INIT,
    RANK,
    SEED,
    build_random_model,
    cross_entropy_pass,
    model_stats,
)


def measure(
    call: Any,
    sides: dict[str, bool],
    args: argparse.Namespace,
    rows: int,
    report: dict[str, Any],
    stats: dict[str, Any],
    read: float | None,
) -> None:
    """Warm up each side (graphs are made there), then `args.rounds` alternated rounds; the
    median step and call of each side, and how many samples equal the first side's."""
    last: dict[str, list[list[int]]] = {}
    for side, graphs in sides.items():
        start = time.perf_counter()
        _, last[side] = call(graphs, args.new)
        print(f"warm-up {side}: {time.perf_counter() - start:.2f} s", flush=True)
    steps: dict[str, list[float]] = {side: [] for side in sides}
    calls: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side, graphs in sides.items():
            long, last[side] = call(graphs, args.new)
            short, _ = call(graphs, 4)
            calls[side].append(long)
            steps[side].append((long - short) / (args.new - 4))
            print(f"{side}: call {long:.3f} s, step {steps[side][-1] * 1e3:.2f} ms", flush=True)
    first = next(iter(sides))
    for side in sides:
        step = statistics.median(steps[side])
        entry: dict[str, Any] = {
            "decode_step_ms": round(step * 1e3, 2),
            "tok_per_s": round(rows * args.new / statistics.median(calls[side]), 1),
            "decode_rows_per_s": round(rows / step, 1),
        }
        if read is not None:
            entry["bandwidth_fraction"] = round(stats["weight_bytes_per_step"] / step / read, 4)
        if side != first:
            same = sum(a == b for a, b in zip(last[first], last[side], strict=True))
            entry[f"samples_equal_to_{first}"] = f"{same}/{rows}"
        report[side] = entry


def profile_step(call: Any, graphs: bool, device: torch.device) -> dict[str, Any]:
    """Per decode step, from torch.profiler over a 12-token and a 4-token call (their
    difference over 8 steps): device kernels run and the device's busy time against the
    wall time (is the step bound by the device or by the host between replays?)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    measured = {}
    by_name: dict[int, dict[str, list[float]]] = {}
    for new in (12, 4):
        with profile(activities=activities) as prof:
            wall, _ = call(graphs, new)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        ops = [e for e in prof.events() if e.name.startswith("aten::")]
        busy = sum(e.device_time for e in kernels) / 1e6  # us -> s (overlap not removed)
        measured[new] = (wall, len(kernels), busy, len(ops))
        names: dict[str, list[float]] = {}
        for e in kernels:
            entry = names.setdefault(e.name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += e.device_time / 1e3  # us -> ms
        by_name[new] = names
    (w1, k1, b1, o1), (w0, k0, b0, o0) = measured[12], measured[4]
    steps = 8
    # The kernels of a decode step by name (the two calls' difference), the costliest first.
    per_step = {
        name: (
            (n - by_name[4].get(name, [0, 0.0])[0]) / steps,
            (ms - by_name[4].get(name, [0, 0.0])[1]) / steps,
        )
        for name, (n, ms) in by_name[12].items()
    }
    top = sorted(per_step.items(), key=lambda item: -item[1][1])[:25]
    return {
        "profiled_step_ms": round((w1 - w0) / steps * 1e3, 2),
        "device_kernels_per_step": round((k1 - k0) / steps, 1),
        "device_busy_ms_per_step": round((b1 - b0) / steps * 1e3, 2),
        "aten_ops_per_step": round((o1 - o0) / steps, 1),
        "kernels_per_step": [
            {"kernel": name, "count": round(n, 1), "ms": round(ms, 3)} for name, (n, ms) in top
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--random-init", choices=sorted(RANDOM_INIT), default="qwen3-8b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new", type=int, default=64, help="new tokens per sample")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--peak-json", type=Path, default=None, help="bench/machine_peak.py's")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="then both sides again with the RMSNorms compiled (engine/compiled.py)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="per side, kernels and device busy time per decode step (torch.profiler)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("tuneloop.server.engine.decode_graphs").setLevel(logging.INFO)
    from transformers import AutoConfig, AutoModelForCausalLM

    from tuneloop.server.engine import compiled
    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.torch_backend import TorchBackend

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}  {args.random_init} {args.dtype}  torch {torch.__version__}")
    scratch = Path(tempfile.mkdtemp())
    folder = scratch / "model"
    folder.mkdir()
    build_random_model(args.random_init, folder, dtype, args.device)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        stats = model_stats(AutoModelForCausalLM.from_config(config), dtype)
    backend = TorchBackend(
        [str(folder)],
        cache_dir=scratch / "cache",
        device=args.device,
        dtype=dtype,
        compile_norms=False,  # the first phase's norms are eager on every device
    )
    model = str(folder)
    backend.create_adapter(t.AdapterSpec("a", model, rank=RANK, seed=SEED, alpha=ALPHA))
    rng = np.random.default_rng(SEED)
    # One optimizer step: LoRA's B is no longer zero, so the products change the samples.
    cross_entropy_pass(backend, [list(rng.integers(1, config.vocab_size, 65)) for _ in range(4)])
    backend.optim_step("a", t.AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.0, 0.0))
    backend.create_sampler("s", model, adapter_id="a")
    prompts = [
        rng.integers(1, config.vocab_size, int(rng.integers(16, 49))) for _ in range(args.prompts)
    ]

    def call(graphs: bool, new: int) -> tuple[float, list[list[int]]]:
        backend.decode_graphs = graphs
        works = [
            t.SampleWork("s", p, args.samples, new, 1.0, -1, 1.0, SEED, (), ()) for p in prompts
        ]
        start = time.perf_counter()
        out = backend.sample(works)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        tokens: list[list[int]] = []
        for result in out:
            if isinstance(result, Exception):
                raise result
            tokens += [list(s.tokens) for s in result.sequences]
        return elapsed, tokens

    rows = args.prompts * args.samples
    runtime = next(iter(backend._runtimes.values()))
    read = None
    if args.peak_json is not None:
        read = float(json.loads(args.peak_json.read_text())["read_gb_per_s"]) * 1e9
    report: dict[str, Any] = {
        "device": name,
        "model": f"random-init {args.random_init}",
        "dtype": args.dtype,
        "rows": rows,
        "new_tokens": args.new,
        "weight_bytes_per_step": stats["weight_bytes_per_step"],
    }
    phases = [("", False)]
    if args.compiled:
        phases.append(("+compiled", True))
    for suffix, kernels in phases:
        if kernels:
            # The RMSNorms as compiled kernels (engine/compiled.py: Triton on CUDA); the graphs
            # made so far hold the eager norms' kernels: made again.
            report["norms_compiled"] = compiled.install(runtime.model)
            runtime.decoder.runner.graphs = None  # type: ignore[union-attr]
        sides = {f"eager{suffix}": False, f"graphs{suffix}": True}
        measure(call, sides, args, rows, report, stats, read)
        runner = runtime.decoder.runner  # type: ignore[union-attr]  # made by the first call
        if runner.graphs is not None:
            report[f"graphs_captured{suffix}"] = runner.graphs.captured
        if args.profile:
            for side, graphs in sides.items():
                report[side].update(profile_step(call, graphs, device))
        report[f"graphs_speedup_per_step{suffix}"] = round(
            report[f"eager{suffix}"]["decode_step_ms"]
            / report[f"graphs{suffix}"]["decode_step_ms"],
            2,
        )
        if args.json:  # after each phase: a run cut short keeps what it measured
            args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
