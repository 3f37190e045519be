"""A decode step whose rows use several adapters, against a step of one adapter (measured).

One in-process `TorchBackend` of SmolLM2-135M (rank-32 LoRA on every linear layer and the head,
as bench/engine.py), 32 prompts x 4 samples. Sides, alternated round by round so that machine
noise hits all alike:
- "lone": every prompt through one sampler (the fused decode weights, lora/fused.py);
- "mixed": the prompts alternate between `--samplers` samplers of the same adapter's snapshot
  (tenants sampling at once, their requests interleaved), rows grouped by adapter in the
  decode batch (decoder.py's `_grouped_by_key`);
- "mixed, rows by request": the same requests, each request's rows where it joined (the
  decoder before the grouping): one LoRA segment per request;
- "mixed, own base weights": grouped, but each layer's base output from the model's own weight
  (`functional.linear`, what ran before `AdapterBank.shared_weights`) instead of the shared,
  sibling-stacked copy packed for the CPU's kernels;
- "mixed, products per layer": grouped, on the shared copy, but each adapted layer's LoRA
  products made by the layer (ops.add_lora, in the modules) instead of each key's delta added
  per sibling group (lora/segments.py, `AdapterBank.deltas`; the lean loop takes those steps).
"mixed" adds each key's delta per group;
Per side the median of `--rounds` decode-step times (a call of `--new` tokens minus a call of
2, per step) and its ratio to "lone". Prints the CPU model and the load.

    python bench/mixed_decode.py [--rounds 3] [--new 24] [--samplers 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from engine import DTYPES, MODEL, SEED, adapted_backend, cpu_model, random_prompts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=24, help="new tokens per call")
    parser.add_argument("--samplers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tuneloop.server.engine import decoder
    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.lora.bank import AdapterBank

    backend = adapted_backend(DTYPES[args.dtype])
    print(f"cpu: {cpu_model()}  {args.dtype}  threads {args.threads}  load {os.getloadavg()}")
    names = [f"s{i}" for i in range(args.samplers)]
    for name in names:
        backend.create_sampler(name, MODEL, adapter_id="a")
    prompts = random_prompts()

    def call(new: int, samplers: list[str]) -> float:
        works = [
            t.SampleWork(samplers[i % len(samplers)], p, 4, new, 1.0, -1, 1.0, SEED, (), ())
            for i, p in enumerate(prompts)
        ]
        start = time.perf_counter()
        backend.sample(works)
        return time.perf_counter() - start

    shared_weights, deltas = AdapterBank.shared_weights, AdapterBank.deltas

    def side(
        samplers: list[str], grouped: bool, shared: bool = True, per_group: bool = True
    ) -> Callable[[], float]:
        def measure() -> float:
            decoder._GROUP_BY_KEY = grouped
            if not shared:
                AdapterBank.shared_weights = lambda self: None  # type: ignore[method-assign]
            if not per_group:
                AdapterBank.deltas = lambda self, key: None  # type: ignore[method-assign]
            try:
                return (call(args.new, samplers) - call(2, samplers)) / (args.new - 2) * 1e3
            finally:
                decoder._GROUP_BY_KEY = True
                AdapterBank.shared_weights = shared_weights  # type: ignore[method-assign]
                AdapterBank.deltas = deltas  # type: ignore[method-assign]

        return measure

    sides = {
        "lone": side(names[:1], True),
        "mixed": side(names, True),
        "mixed, rows by request": side(names, False),
        "mixed, own base weights": side(names, True, shared=False),
        "mixed, products per layer": side(names, True, per_group=False),
    }
    for measure in sides.values():  # warm-up: every path built once
        call(4, names[:1])
        measure()
    results: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, measure in sides.items():
            results[name].append(measure())
        print({k: round(v[-1], 1) for k, v in results.items()}, "ms per step", flush=True)
    lone = statistics.median(results["lone"])
    print(f"decode step of 128 rows, {args.samplers} samplers, medians of {args.rounds}:")
    for name, values in results.items():
        ms = statistics.median(values)
        print(f"  {name:24s} {ms:7.1f} ms  {ms / lone:.2f}x the lone step")
    print("load:", os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
