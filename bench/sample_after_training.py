"""Sampling calls before and after training steps in the same process (an RL loop's rhythm).

In-process `TorchBackend`, SmolLM2-135M, rank-32 LoRA on every linear layer and the head (as
bench/engine.py), `--dtype` weights (bf16 by default), 2 threads. A sampler snapshot of the
adapter is made first; then `--calls` sampling calls of 32 prompts x 4 samples x 64 tokens,
`--steps` training steps (forward_backward of 8 x 64-256 tokens + optim_step) on the adapter,
and `--calls` calls of the same snapshot again: same work, same weights, only the process's
history differs. Prints each call's seconds, their medians and the ratio, with the CPU model.

The host's speed drifts over minutes, and "after" always comes later, so `--paired` runs the
two sides as two processes instead, one that sampled only and one that trained after its
first calls (the same warm-up calls in both), and alternates their calls (each waits while
the other runs), so that each "after" call has a "fresh" call beside it in time; it prints the
median of the pairs' ratios. Both processes use the allocator the command runs with
(`LD_PRELOAD`, `MALLOC_CONF`).

    python bench/sample_after_training.py [--calls 3] [--steps 4]
    python bench/sample_after_training.py --paired --calls 6 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from engine import (
    BETAS,
    DTYPES,
    EPS,
    LR,
    MODEL,
    SEED,
    adapted_backend,
    cpu_model,
    cross_entropy_pass,
    make_batches,
    random_prompts,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--calls", type=int, default=3, help="sampling calls on each side")
    parser.add_argument("--steps", type=int, default=4, help="training steps between them")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paired", action="store_true", help="two processes, calls alternated")
    parser.add_argument("--worker", choices=("fresh", "trained"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.paired:
        return paired(args)
    torch.set_num_threads(args.threads)
    from tuneloop.server.engine import types as t

    backend = adapted_backend(DTYPES[args.dtype])
    backend.create_sampler("s", MODEL, adapter_id="a")
    prompts = random_prompts()

    def sample() -> float:
        works = [t.SampleWork("s", p, 4, 64, 1.0, -1, 1.0, SEED, (), ()) for p in prompts]
        start = time.perf_counter()
        backend.sample(works)
        return time.perf_counter() - start

    def train() -> None:
        stream = list(np.random.default_rng(SEED).integers(100, 40000, 200_000))
        step = t.AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.0, 0.0)
        for batch in make_batches(stream, args.steps, 8, 64, 256):
            cross_entropy_pass(backend, batch)
            backend.optim_step("a", step)

    if args.worker:  # --paired's side: warm up (and train), then one call per line read
        sample()
        sample()
        if args.worker == "trained":
            train()
        print("ready", flush=True)
        for _ in sys.stdin:
            print(json.dumps(sample()), flush=True)
        return 0
    print(f"cpu: {cpu_model()}  {args.dtype}  threads {args.threads}  load {os.getloadavg()}")
    sample()  # the pool's first pages, the compiled kernels' first calls
    before = [sample() for _ in range(args.calls)]
    print("before training:", [round(s, 2) for s in before], flush=True)
    train()
    after = [sample() for _ in range(args.calls)]
    print("after training: ", [round(s, 2) for s in after])
    ratio = statistics.median(after) / statistics.median(before)
    print(
        f"median call {statistics.median(before):.2f} s before, "
        f"{statistics.median(after):.2f} s after: {ratio:.2f}x"
    )
    return 0


def paired(args: argparse.Namespace) -> int:
    sides = ("fresh", "trained")
    passed = [f"--dtype={args.dtype}", f"--steps={args.steps}", f"--threads={args.threads}"]
    workers = {
        side: subprocess.Popen(
            [sys.executable, __file__, *passed, f"--worker={side}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for side in sides
    }
    try:
        for worker in workers.values():
            assert worker.stdout is not None
            while (line := worker.stdout.readline()) and line.strip() != "ready":
                pass
            if not line:
                raise SystemExit("a worker exited before it was ready")
        print(f"cpu: {cpu_model()}  {args.dtype}  threads {args.threads}  load {os.getloadavg()}")
        times: dict[str, list[float]] = {side: [] for side in sides}
        for call in range(args.calls):
            for side in sides if call % 2 == 0 else sides[::-1]:
                worker = workers[side]
                assert worker.stdin is not None
                assert worker.stdout is not None
                worker.stdin.write("call\n")
                worker.stdin.flush()
                times[side].append(float(json.loads(worker.stdout.readline())))
            print({side: round(t[-1], 2) for side, t in times.items()}, flush=True)
    finally:
        for worker in workers.values():
            if worker.stdin is not None:
                worker.stdin.close()
            worker.wait(timeout=60)
    ratios = [a / f for f, a in zip(times["fresh"], times["trained"], strict=True)]
    print(
        f"median call {statistics.median(times['fresh']):.2f} s fresh, "
        f"{statistics.median(times['trained']):.2f} s after training; "
        f"median of the pairs' ratios {statistics.median(ratios):.3f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
