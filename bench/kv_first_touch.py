"""The sampler's KV pool zero-filled when made, against left to be faulted in block by block.

`KVPool` makes each layer's keys and values at the layer's first write, by `torch.empty`: the
memory is only reserved, each page is faulted in (and zeroed by the kernel) when a block is
first written, and blocks are handed out oldest-freed first, so a new pool's first few
thousand decode steps keep landing on untouched pages. The variant measured here fills the
pools with zeros when they are made, faulting every page in at the pool's first step.

Each round starts two fresh processes, alternating `empty` (engine/kv/paged_attention.py) and
`zeros` (the variant, patched in by this script). Each builds bench/engine.py's
in-process engine (SmolLM2-135M bf16, rank-32 LoRA everywhere, a lone sampler snapshot) and
times its first `--calls` sampling calls of 32 prompts x 4 samples x 64 tokens (the first call
includes the pool's making). Prints the CPU model.

    python bench/kv_first_touch.py [--rounds 2] [--calls 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any


def _zero_filled(pool: Any, index: int, keys: Any, values: Any) -> tuple[Any, Any]:
    """`KVPool.layer` with its pools made by `torch.zeros`."""
    import torch

    if index not in pool.keys:
        for pools, like in ((pool.keys, keys), (pool.values, values)):
            pools[index] = torch.zeros(
                (pool.pad_slot + 1, *like.shape[1:]), dtype=pool.dtype, device=pool.device
            )
    return pool.keys[index], pool.values[index]


def _child(layout: str, calls: int, new: int, threads: int) -> list[float]:
    import torch

    from engine import MODEL, SEED, adapted_backend, random_prompts
    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.kv.paged_attention import KVPool

    if layout == "zeros":
        KVPool.layer = _zero_filled
    torch.set_num_threads(threads)
    backend = adapted_backend(torch.bfloat16)
    backend.create_sampler("s", MODEL, adapter_id="a")
    prompts = random_prompts()
    seconds = []
    for _ in range(calls):
        works = [t.SampleWork("s", p, 4, new, 1.0, -1, 1.0, SEED, (), ()) for p in prompts]
        start = time.perf_counter()
        for result in backend.sample(works):
            if isinstance(result, Exception):
                raise result
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=["empty", "zeros"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.calls, args.new, args.threads)))
        return 0

    from engine import cpu_model
    from processes import alternate_in_processes

    print(f"cpu: {cpu_model()}  bfloat16  threads {args.threads}  load {os.getloadavg()}")
    results: dict[str, list[list[float]]] = alternate_in_processes(
        __file__,
        ("empty", "zeros"),
        args.rounds,
        args.threads,
        ["--calls", str(args.calls), "--new", str(args.new)],
        lambda seconds: f"seconds per call {[round(s, 2) for s in seconds]}",
    )
    tokens = 32 * 4 * args.new
    for layout, runs in results.items():
        per_call = [statistics.median(run[i] for run in runs) for i in range(args.calls)]
        rates = [round(tokens / s) for s in per_call]
        print(f"{layout}: tok/s per call (medians of {args.rounds}) {rates}")
    first = [sum(run) for run in results["empty"]], [sum(run) for run in results["zeros"]]
    before, after = statistics.median(first[0]), statistics.median(first[1])
    print(
        f"all {args.calls} calls: empty {before:.2f} s, zeros {after:.2f} s, {before / after:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
