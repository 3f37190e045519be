"""Long-prompt join benchmark: what a long prompt joining a running decode batch costs the rows
already decoding.

A decode run of `--prompts` x `--samples` sampled rows (prompts of 32-96 tokens, `--new` new
tokens) runs; after `--join-after` steps a request with a `--long`-token prompt joins. Measured
per decode step (the time between two `admit()` calls of `TorchBackend.sample_continuous`, one
step of every running row), side by side in one run, runs alternating:
  - before:   the joining prompt prefilled whole before the next step and left-padded into the
              running batch (one bucket, no padding limit): the engine before this work;
  - chunked:  prefilled 256 tokens per step, still left-padded into the running batch;
  - buckets:  prefilled 256 tokens per step into a length bucket of its own (the default).
Reported per column: the running rows' longest step (the stall) and median step, the running
requests' total time, the joiner's time from admission to its result, and the peak KV-cache
tokens held (rows x padded width, summed over buckets).

    python bench/prefill_stall.py [--long 1024] [--chunk 256] [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import MODEL, RANK, SEED, corpus_text  # a sibling: a script's folder is on sys.path


def run_once(
    backend: Any,
    t: Any,
    running: list[Any],
    long_prompt: list[int],
    join_after: int,
    setting: dict[str, Any],
) -> dict[str, float]:
    from tuneloop.server.engine import sampler

    for name, value in setting.items():
        setattr(backend, name, value)
    held: dict[int, int] = {}
    peak = [0]
    step = sampler.DecodeBatch.step

    def watched(self: Any, **kw: Any) -> Any:
        out = step(self, **kw)
        held[id(self)] = self.kv_tokens()
        peak[0] = max(peak[0], sum(held.values()))
        return out

    sampler.DecodeBatch.step = watched  # type: ignore[method-assign]
    joiner = t.SampleWork("s", np.asarray(long_prompt), 1, 16, 1.0, -1, 1.0, SEED, (), ())
    ticks: list[float] = []
    joined_at: list[float] = []
    finished: dict[int, float] = {}

    def admit() -> list[Any]:
        ticks.append(time.perf_counter())
        if len(ticks) == join_after:
            joined_at.append(ticks[-1])
            return [joiner]
        return []

    def deliver(work: Any, result: Any) -> None:
        if isinstance(result, Exception):
            raise result
        finished[id(work)] = time.perf_counter()

    start = time.perf_counter()
    try:
        backend.sample_continuous(running, admit, deliver)
    finally:
        sampler.DecodeBatch.step = step  # type: ignore[method-assign]
    # Steps while the running request decodes (its end is known from its delivery).
    end_running = max(finished[id(w)] for w in running)
    steps = [b - a for a, b in itertools.pairwise(ticks) if b <= end_running]
    return {
        "max_step_s": max(steps),
        "median_step_s": statistics.median(steps),
        "running_total_s": end_running - start,
        "joiner_latency_s": finished[id(joiner)] - joined_at[0],
        "peak_kv_tokens": float(peak[0]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--long", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--join-after", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.torch_backend import TorchBackend

    cache = Path("~/.cache/tuneloop").expanduser()  # where the server and bench/engine.py keep it
    backend = TorchBackend([MODEL], cache_dir=cache, dtype=torch.float32)
    backend.create_adapter(t.AdapterSpec("a", MODEL, rank=RANK, seed=SEED))
    backend.create_sampler("s", MODEL, adapter_id="a")
    from transformers import AutoTokenizer

    from tuneloop.server.engine import models

    tokenizer = AutoTokenizer.from_pretrained(models._smollm2_folder(cache))
    _, text = corpus_text()
    stream: list[int] = tokenizer(text)["input_ids"]
    rng = np.random.default_rng(SEED)
    running = []
    for _ in range(args.prompts):
        n = int(rng.integers(32, 97))
        start = int(rng.integers(0, len(stream) - n))
        running.append(
            t.SampleWork(
                "s",
                np.asarray(stream[start : start + n]),
                args.samples,
                args.new,
                1.0,
                -1,
                1.0,
                SEED,
                (),
                (),
            )
        )
    long_prompt = stream[: args.long]
    budget = backend.sample_token_budget
    columns: dict[str, dict[str, Any]] = {
        # The engine before: no padding limit, and a KV budget that did not count padding (so
        # it admitted the long prompt into the running batch).
        "before": {
            "prefill_chunk": 10**9,
            "max_buckets": 1,
            "pad_factor": float("inf"),
            "sample_token_budget": 10**9,
        },
        "chunked": {
            "prefill_chunk": args.chunk,
            "max_buckets": 1,
            "pad_factor": float("inf"),
            "sample_token_budget": 10**9,
        },
        "buckets": {
            "prefill_chunk": args.chunk,
            "max_buckets": 4,
            "pad_factor": 2.0,
            "sample_token_budget": budget,
        },
    }
    run_once(backend, t, running[:2], long_prompt[:64], 2, columns["buckets"])  # warm-up
    results: dict[str, list[dict[str, float]]] = {name: [] for name in columns}
    for _ in range(args.repeats):
        for name, setting in columns.items():
            results[name].append(
                run_once(backend, t, running, long_prompt, args.join_after, setting)
            )
            print(name, results[name][-1], flush=True)
    summary = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for name, runs in results.items()
    }
    ratios = {
        name: {k: summary["before"][k] / summary[name][k] for k in summary[name]}
        for name in ("chunked", "buckets")
    }
    report = {
        "config": vars(args) | {"json": str(args.json) if args.json else None},
        "rows": args.prompts * args.samples,
        "median_of_runs": summary,
        "before_over": ratios,
        "runs": results,
    }
    print(json.dumps({"median_of_runs": summary, "before_over": ratios}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
