"""Training throughput of two engine trees side by side: bench/engine.py's training workload.

Batches of 8 windows of 64-256 tokens (`--lengths`) of SmolLM2's token stream, each a
forward_backward (cross_entropy) and an optim_step of a rank-32 LoRA adapter on every linear
layer and the LM head, through `TorchBackend` in process, `--dtype` (fp32 by default),
`--threads` threads: `--warmup` untimed steps, then `--steps` timed ones. Each measurement
runs in its own process with one tree's `src/` first on the path (`--before-src`: a checkout
of the engine to compare with; the other is this tree), rounds alternating between the two,
so machine noise hits both alike; reported per round and as the median ratio, beside tokens
per CPU-second of the process and, on a guest that reports steal, per wall second less the
stolen time's share (a shared guest's neighbours take CPU time in bursts). (Run it on
jemalloc, as the server runs: LD_PRELOAD=libjemalloc.so.2.)

    python bench/training_ab.py --before-src /tmp/before/src [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# siblings: a script's folder is on sys.path
from columns import add_tree_options, alternate, answered_as_worker, stolen_seconds
from engine import BETAS, EPS, LR, SEED, adapted_backend, cross_entropy_pass, make_batches
from shared_prefix import cpu_model


def worker(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    from tuneloop.server.engine import types as t

    backend = adapted_backend(getattr(torch, args.dtype))
    step = t.AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.0, 0.0)
    stream = list(np.random.default_rng(SEED).integers(100, 40000, 200_000))
    low, high = (int(n) for n in args.lengths.split(","))
    batches = make_batches(stream, args.warmup + args.steps, 8, low, high)

    def train_step(rows: list[list[int]]) -> None:
        cross_entropy_pass(backend, rows)
        backend.optim_step("a", step)

    for rows in batches[: args.warmup]:
        train_step(rows)
    tokens = 0
    stolen, cpu = stolen_seconds(), time.process_time()
    start = time.perf_counter()
    for rows in batches[args.warmup :]:
        train_step(rows)
        tokens += sum(len(r) for r in rows)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    after = stolen_seconds()
    # the CPU time this process used (steal and idle excluded) and, where the guest reports
    # steal, the wall less the stolen time's share of one CPU of the run's (a guest's
    # neighbours took up to 30 % of a step's CPU time in some rounds)
    steal = None if stolen is None or after is None else after - stolen
    result = {"wall_s": wall, "tok_per_s": tokens / wall, "cpu_s": cpu, "steal_s": steal}
    result["tok_per_cpu_s"] = tokens / cpu
    if steal is not None:
        share = steal / max(1, os.cpu_count() or 1)
        result["tok_per_s_less_steal"] = tokens / max(wall - share, 1e-9)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="64,256", help="the windows' min,max tokens")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dtype", default="float32", help="the base weights' dtype, both trees")
    add_tree_options(parser)
    args = parser.parse_args()
    if answered_as_worker(args, worker):
        return 0
    names = ("threads", "lengths", "warmup", "steps", "dtype", "before_src")
    passed = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in names] + ["--worker"]
    runs = alternate(Path(__file__), args.before_src, passed, args.rounds)
    ratios = [
        a["tok_per_s"] / b["tok_per_s"] for a, b in zip(runs["after"], runs["before"], strict=True)
    ]
    others = {}
    for key in ("tok_per_s_less_steal", "tok_per_cpu_s"):
        pairs = zip(runs["after"], runs["before"], strict=True)
        found = [a[key] / b[key] for a, b in pairs if key in a and key in b]
        if found:
            others[key] = {
                n: [round(r[key], 1) for r in rs if key in r] for n, rs in runs.items()
            } | {"after_over_before_median": round(statistics.median(found), 3)}
    report: dict[str, Any] = {
        "cpu": cpu_model(),
        "config": {k: str(v) for k, v in vars(args).items()},
        "tok_per_s": {n: [round(r["tok_per_s"], 1) for r in rs] for n, rs in runs.items()},
        "median_tok_per_s": {
            n: statistics.median(r["tok_per_s"] for r in rs) for n, rs in runs.items()
        },
        "after_over_before_per_round": ratios,
        "after_over_before_median": statistics.median(ratios),
        "steal_s": {n: [r["steal_s"] for r in rs] for n, rs in runs.items()},
        **others,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps({**report, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
