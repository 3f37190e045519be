"""A long training loop on new batches: ms per token and the process's memory every 10 steps.

forward_backward + optim_step of SmolLM2-135M (rank-32 LoRA on every linear layer and the LM
head, `--dtype`, bf16 by default) on one `TorchBackend`, each step a new batch of 8 sequences
of 64-256 tokens, as bench/engine.py's training. With `--no-buckets` the packed row and the
attention's sequences run at their own lengths (packing.BUCKETS_PER_OCTAVE = 0,
causal_cpu.LENGTH_GRANULE = 1), as before they were bucketed. Run it once per variant, each in
its own process (in one process the unbucketed steps' new kernels and fragmented heap slow the
other variant's steps too), and under the allocator to compare, e.g. the one `tuneloop serve`
preloads:

    LD_PRELOAD=libjemalloc.so.2 MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1 \\
        PYTHONPATH=../src python train_long.py --steps 60 [--no-buckets | --buckets-per-octave 16]

Prints the CPU model, then every 10 steps: the mean ms per token of those steps, the resident
size (VmRSS), and with jemalloc its allocated and resident bytes and how many times the
engine's `release_fragmentation` purged.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from engine import (
    BETAS,
    DTYPES,
    EPS,
    LR,
    SEED,
    adapted_backend,
    cpu_model,
    cross_entropy_pass,
    make_batches,
    rss_mib,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-buckets", action="store_true")
    parser.add_argument(
        "--buckets-per-octave",
        type=int,
        default=None,
        help="packing.BUCKETS_PER_OCTAVE for this run (the engine's own by default)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from tuneloop.server.engine import causal_cpu, host_allocator, packing
    from tuneloop.server.engine import types as t

    if args.no_buckets:
        packing.BUCKETS_PER_OCTAVE, causal_cpu.LENGTH_GRANULE = 0, 1
    elif args.buckets_per_octave is not None:
        packing.BUCKETS_PER_OCTAVE = args.buckets_per_octave
    purges = 0
    release = host_allocator.release_fragmentation

    def counted() -> bool:
        nonlocal purges
        purged = release()
        purges += purged
        return purged

    host_allocator.release_fragmentation = counted  # (the backend calls it by module attribute)
    backend = adapted_backend(DTYPES[args.dtype])
    step = t.AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.0, 0.0)
    stream = list(np.random.default_rng(SEED).integers(100, 40000, 60 * args.steps * 256))
    batches = make_batches(stream, args.steps, 8, 64, 256)
    je = host_allocator._find_jemalloc()
    print(
        f"cpu: {cpu_model()}  {args.dtype}  threads {args.threads}  "
        f"buckets {packing.BUCKETS_PER_OCTAVE} an octave  "
        f"jemalloc {je is not None}  MALLOC_CONF {os.environ.get('MALLOC_CONF', '')}"
    )
    per_token: list[float] = []
    for i, rows in enumerate(batches):
        begin = time.perf_counter()
        cross_entropy_pass(backend, rows)
        backend.optim_step("a", step)
        per_token.append((time.perf_counter() - begin) / sum(len(r) for r in rows) * 1e3)
        if i % 10 == 9:
            line = (
                f"steps {i + 1:4d}  ms/token {np.mean(per_token[-10:]):.3f}  "
                f"rss {rss_mib(os.getpid())['VmRSS']:.0f} MiB"
            )
            if je is not None:
                je.refresh()
                allocated, resident = je.read("stats.allocated"), je.read("stats.resident")
                line += f"  jemalloc allocated {allocated >> 20} resident {resident >> 20} MiB"
                line += f"  purges {purges}"
            print(line, flush=True)
    print("load:", os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
