"""Sampling calls before and after training steps in the same process (an RL loop's rhythm).

In-process `TorchBackend`, SmolLM2-135M, rank-32 LoRA on every linear layer and the head (as
bench/engine.py), `--dtype` weights (bf16 by default), 2 threads. A sampler snapshot of the
adapter is made first; then `--calls` sampling calls of 32 prompts x 4 samples x 64 tokens,
`--steps` training steps (forward_backward of 8 x 64-256 tokens + optim_step) on the adapter,
and `--calls` calls of the same snapshot again: same work, same weights, only the process's
history differs. Prints each call's seconds, their medians and the ratio, with the CPU model.

    python bench/sample_after_training.py [--calls 3] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
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
    args = parser.parse_args()
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

    print(f"cpu: {cpu_model()}  {args.dtype}  threads {args.threads}  load {os.getloadavg()}")
    sample()  # the pool's first pages, the compiled kernels' first calls
    before = [sample() for _ in range(args.calls)]
    print("before training:", [round(s, 2) for s in before], flush=True)
    stream = list(np.random.default_rng(SEED).integers(100, 40000, 200_000))
    step = t.AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.0, 0.0)
    for batch in make_batches(stream, args.steps, 8, 64, 256):
        cross_entropy_pass(backend, batch)
        backend.optim_step("a", step)
    after = [sample() for _ in range(args.calls)]
    print("after training: ", [round(s, 2) for s in after])
    ratio = statistics.median(after) / statistics.median(before)
    print(
        f"median call {statistics.median(before):.2f} s before, "
        f"{statistics.median(after):.2f} s after: {ratio:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
