"""Training on batches of many short sequences: two engine trees side by side.

An RL step trains on groups of sampled answers: many sequences, often short. Per `--shapes`
entry (`count:min:max`: that many sequences of min-max tokens, uniform, seeded), one
in-process `TorchBackend` of SmolLM2-135M (`--dtype` weights, bf16 by default) with a rank-32
LoRA on every linear layer and the head runs `--steps` timed forward_backward (cross entropy)
+ optim_step calls after one untimed one. Each measurement runs in its own process with one
tree's `src/` first on the path (`--before-src`: the tree to compare with; the other is this
one), rounds alternating between the two; reported per round and as the median ratio, with
the CPU model and the load.

    python bench/train_sequences.py --before-src /tmp/before/src [--rounds 3]
    python bench/train_sequences.py --before-src /tmp/before/src --dtype float32 \
        --shapes 128:9:13,32:38:50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# siblings: a script's folder is on sys.path
from columns import add_tree_options, alternate, answered_as_worker
from engine import BETAS, EPS, LR, MODEL, RANK, SEED, cross_entropy_pass
from shared_prefix import cpu_model


def worker(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.torch_backend import TorchBackend

    cache = Path("~/.cache/tuneloop").expanduser()
    backend = TorchBackend([MODEL], cache_dir=cache, device="cpu", dtype=getattr(torch, args.dtype))
    backend.create_adapter(t.AdapterSpec("a", MODEL, rank=RANK, seed=SEED))
    count, low, high = (int(x) for x in args.shape.split(":"))
    rng = np.random.default_rng(SEED)
    rows = [
        [int(v) for v in rng.integers(0, 49000, int(rng.integers(low, high + 1)))]
        for _ in range(count)
    ]
    step = t.AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.0, 0.0)

    def train() -> None:
        cross_entropy_pass(backend, rows)
        backend.optim_step("a", step)

    train()  # warm-up: kernels and buffers made here, not timed
    start = time.perf_counter()
    for _ in range(args.steps):
        train()
    wall = (time.perf_counter() - start) / args.steps
    tokens = sum(len(r) - 1 for r in rows)
    return {"step_s": wall, "tok_per_s": tokens / wall, "tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default="128:9:13,32:38:50,8:64:256")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per measurement")
    parser.add_argument("--dtype", default="bfloat16", help="the base weights' dtype, both trees")
    parser.add_argument("--shape", help=argparse.SUPPRESS)  # a worker's one shape
    add_tree_options(parser)
    args = parser.parse_args()
    if answered_as_worker(args, worker):
        return 0
    print(f"cpu: {cpu_model()}  {args.dtype}  threads {args.threads}  load {os.getloadavg()}")
    report: dict[str, object] = {
        "cpu": cpu_model(),
        "config": {k: str(v) for k, v in vars(args).items()},
    }
    for shape in args.shapes.split(","):
        passed = [f"--{k}={getattr(args, k)}" for k in ("threads", "steps", "dtype")] + [
            f"--before-src={args.before_src}",
            f"--shape={shape}",
            "--worker",
        ]
        runs = alternate(Path(__file__), args.before_src, passed, args.rounds)
        ratios = [
            a["tok_per_s"] / b["tok_per_s"]
            for a, b in zip(runs["after"], runs["before"], strict=True)
        ]
        medians = {n: statistics.median(r["tok_per_s"] for r in rs) for n, rs in runs.items()}
        print(
            f"{shape} ({int(runs['after'][0]['tokens'])} tokens): before "
            f"{medians['before']:.1f} tok/s, after {medians['after']:.1f} tok/s, "
            f"after/before {statistics.median(ratios):.2f}x (rounds "
            f"{', '.join(f'{r:.2f}' for r in ratios)})",
            flush=True,
        )
        report[shape] = {"median_tok_per_s": medians, "ratios": ratios, "runs": runs}
    print(f"load: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
