"""The engine's model built on the thread that runs it, against built on another thread.

The server runs its backend on one engine thread. torch's CPU kernels run on libgomp, which
keeps a pool of worker threads per thread that has run a parallel region; with more such
threads in the process than cores it lets idle workers spin only ~100 iterations before
sleeping, so every operation of a step waits for its workers to wake. Before, the server loaded
the model on its main thread (a pool there) and ran it on the engine thread (a second pool).

Each round starts two fresh processes (libgomp's state is per process), alternating:
- split: `TorchBackend` built on the main thread, every call on a worker thread (before);
- same: built and called on the worker thread (the server now, scheduler/loop.py).
Each process runs bench/engine.py's in-process training step (forward_backward + optim_step,
8 x 64-256 tokens, SmolLM2-135M bf16, rank-32 LoRA everywhere) and a decode step of 128 rows
(32 prompts x 4 samples: a call of `--new` tokens minus a call of 2, per step), and reports its
CPU time over wall time (near the thread count when both cores work). Prints the CPU model.

    python bench/engine_thread.py [--rounds 3] [--steps 3] [--new 18]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np


def _child(layout: str, steps: int, new: int, threads: int) -> dict[str, Any]:
    import torch

    from engine import (
        BETAS,
        EPS,
        LR,
        MODEL,
        SEED,
        adapted_backend,
        cross_entropy_pass,
        make_batches,
        random_prompts,
    )
    from tuneloop.server.engine import types as t

    torch.set_num_threads(threads)
    worker = ThreadPoolExecutor(1, thread_name_prefix="engine")

    def on_worker(fn: Any, *args: Any) -> Any:
        return worker.submit(fn, *args).result()

    if layout == "same":
        backend = on_worker(adapted_backend, torch.bfloat16)
    else:
        backend = adapted_backend(torch.bfloat16)
    stream = list(np.random.default_rng(SEED).integers(100, 40000, 200_000))
    batches = make_batches(stream, steps + 1, 8, 64, 256)
    adam = t.AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.0, 0.0)

    def train_step(rows: list[list[int]]) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        cross_entropy_pass(backend, rows)
        backend.optim_step("a", adam)
        return time.perf_counter() - wall, time.process_time() - cpu

    on_worker(train_step, batches[0])
    trained = [on_worker(train_step, b) for b in batches[1:]]

    on_worker(lambda: backend.create_sampler("s", MODEL, adapter_id="a"))
    prompts = random_prompts()

    def call(tokens: int) -> tuple[float, float]:
        works = [t.SampleWork("s", p, 4, tokens, 1.0, -1, 1.0, SEED, (), ()) for p in prompts]
        wall, cpu = time.perf_counter(), time.process_time()
        backend.sample(works)
        return time.perf_counter() - wall, time.process_time() - cpu

    on_worker(call, 4)
    long, short = on_worker(call, new), on_worker(call, 2)
    return {
        "train_ms": statistics.median(w for w, _ in trained) * 1e3,
        "train_cpu_per_wall": sum(c for _, c in trained) / sum(w for w, _ in trained),
        "decode_step_ms": (long[0] - short[0]) / (new - 2) * 1e3,
        "decode_cpu_per_wall": (long[1] - short[1]) / (long[0] - short[0]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per process")
    parser.add_argument("--new", type=int, default=18, help="decode: new tokens per call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=["split", "same"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.steps, args.new, args.threads)))
        return 0

    from engine import cpu_model
    from processes import alternate_in_processes

    print(f"cpu: {cpu_model()}  bfloat16  threads {args.threads}  load {os.getloadavg()}")
    results: dict[str, list[dict[str, float]]] = alternate_in_processes(
        __file__,
        ("split", "same"),
        args.rounds,
        args.threads,
        ["--steps", str(args.steps), "--new", str(args.new)],
        lambda row: {k: round(v, 2) for k, v in row.items()},
    )
    for key in ("train_ms", "decode_step_ms"):
        split = statistics.median(r[key] for r in results["split"])
        same = statistics.median(r[key] for r in results["same"])
        print(
            f"{key}: built on another thread {split:.1f}, on the engine thread {same:.1f}, "
            f"{split / same:.2f}x (medians of {args.rounds})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
