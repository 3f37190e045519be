"""Sampling one adapter snapshot: its LoRA products, its fused weights, its merged weights.

In one process, the same `TorchBackend` and sampler, calls alternating between three paths:
"products", the base layers plus the LoRA products (`fuse_lone_key` and `merge_lone_adapter`
off); "fused", sibling layers stacked into one packed matmul with the adapter's delta in extra
columns (`fuse_lone_key`, lora/fused.py); "merged", the delta merged into the weights
(`merge_lone_adapter`). bench/engine.py's sampling workload (32 prompts of 16-48
tokens x 4 samples, rank-32 LoRA on every linear layer and the head, SmolLM2-135M). Reported
per path: wall and CPU seconds per call, tok/s, and the fraction of the decode bandwidth bound
(weights read once per step, from `machine_peak.py`'s quick run at start).

    python bench/merged_sampling.py [--dtype bfloat16] [--new 32] [--rounds 2] [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from engine import (  # siblings: a script's folder is on sys.path
    ALPHA,
    DTYPES,
    MODEL,
    RANK,
    SEED,
    random_prompts,
)
from event_loop import cpu_model
from machine_peak import measure as measure_peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.torch_backend import TorchBackend

    peak = measure_peak("cpu", args.threads, quick=True)
    backend = TorchBackend(
        [MODEL],
        cache_dir=Path("~/.cache/tuneloop").expanduser(),
        device="cpu",
        dtype=DTYPES[args.dtype],
    )
    backend.create_adapter(t.AdapterSpec("a", MODEL, rank=RANK, seed=SEED, alpha=ALPHA))
    backend.create_sampler("s", MODEL, adapter_id="a")
    prompts = random_prompts(args.prompts)

    def call(new: int) -> int:
        works = [
            t.SampleWork("s", p, args.samples, new, 1.0, -1, 1.0, SEED, (), ()) for p in prompts
        ]
        results = backend.sample(works)
        return sum(len(s.tokens) for r in results for s in r.sequences)  # type: ignore[union-attr]

    # path -> (fuse_lone_key, merge_lone_adapter)
    paths = {"products": (False, False), "fused": (True, False), "merged": (False, True)}
    for fuse, merge in paths.values():  # warm: shapes (a switch makes its copy again)
        backend.fuse_lone_key, backend.merge_lone_adapter = fuse, merge
        call(2)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, (fuse, merge) in paths.items():
            backend.fuse_lone_key, backend.merge_lone_adapter = fuse, merge
            cpu, wall = time.process_time(), time.perf_counter()
            tokens = call(args.new)
            runs[name].append(
                {
                    "wall_s": time.perf_counter() - wall,
                    "cpu_s": time.process_time() - cpu,
                    "tokens": tokens,
                    "load": os.getloadavg()[0],
                }
            )
            print(name, runs[name][-1], flush=True)
    # What making a sampler's copy costs (once per snapshot sampled alone; inside each call
    # above, since the paths alternate).
    bank = next(iter(backend._runtimes.values())).bank
    builds: dict[str, float] = {}
    for name, merge in (("fused", False), ("merged", True)):
        bank.release_lone()
        wall = time.perf_counter()
        bank.lone_weights("s", merge=merge)
        builds[name] = time.perf_counter() - wall
    model = next(iter(backend.resident_models().values()))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = args.prompts * args.samples
    bound = float(peak["read_gb_per_s"]) * 1e9 / weight_bytes * rows
    report: dict[str, object] = {
        "cpu": cpu_model(),
        "peak": peak,
        "dtype": args.dtype,
        "workload": f"{args.prompts} prompts x {args.samples} samples x {args.new} tokens",
        "runs": runs,
        "build_s": builds,
    }
    summary: dict[str, dict[str, float]] = {}
    for name in paths:
        wall = statistics.median(r["wall_s"] for r in runs[name])
        tok_s = rows * args.new / wall
        summary[name] = {
            "wall_s": wall,
            "cpu_s": statistics.median(r["cpu_s"] for r in runs[name]),
            "tok_per_s": tok_s,
            "bandwidth_fraction": tok_s / bound,
        }
    report.update(summary)
    for name in ("fused", "merged"):
        report[f"{name}_speedup"] = {
            key: summary["products"][key] / summary[name][key] for key in ("wall_s", "cpu_s")
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
