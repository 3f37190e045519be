"""Long-prompt join benchmark: what a long prompt joining a running decode batch costs the rows
already decoding.

A decode run of `--prompts` x `--samples` sampled rows (prompts of 32-96 tokens, `--new` new
tokens) runs; after `--join-after` steps a request with a `--long`-token prompt joins. Measured
per decode step (the time between two `admit()` calls of `TorchBackend.sample_continuous`, one
step of every running row), side by side in one run, each column in its own process, rounds
alternating:
  - before:  the engine of `--before-src` (a checkout of the dense, left-padded cache) with the
             joining prompt prefilled whole and left-padded into the running batch;
  - buckets: the same engine as it ships there: 256-token prefill chunks into a length bucket
             of its own (padding bounded by 2x);
  - paged:   this tree's engine: paged KV cache, 256-token chunks in the running rows' steps.
Reported per column: the running rows' longest step (the stall) and median step, the running
requests' total time, the joiner's time from admission to its result, and the peak KV-cache
tokens held (dense: rows x padded width, summed over buckets; paged: blocks in use x block
size) with their bytes. Without `--before-src` only the paged column runs.

    python bench/prefill_stall.py --before-src /tmp/before/src [--long 1024] [--repeats 2]
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

from columns import run_column, this_tree_src  # siblings: a script's folder is on sys.path
from engine import MODEL, RANK, SEED, corpus_text
from shared_prefix import cpu_model

# Settings of each column, applied as attributes of the TorchBackend it runs on.
COLUMNS: dict[str, dict[str, Any]] = {
    # The dense engine with no padding limit, and a KV budget that did not count padding (so
    # it admitted the long prompt into the running batch), prefilling it whole.
    "before": {
        "prefill_chunk": 10**9,
        "max_buckets": 1,
        "pad_factor": float("inf"),
        "sample_token_budget": 10**9,
    },
    "buckets": {"prefill_chunk": 256, "max_buckets": 4, "pad_factor": 2.0},
    "paged": {"prefill_chunk": 256},
}


class KVWatch:
    """Peak KV-cache tokens held, read at every admit() call (once per step)."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.peak = backend, 0
        self.held: dict[int, int] = {}
        self.restore: Any = None
        if not hasattr(backend, "kv_usage"):  # the dense engine: rows x padded width
            from tuneloop.server.engine import sampler

            step = sampler.DecodeBatch.step  # type: ignore[attr-defined]

            def watched(batch: Any, **kw: Any) -> Any:
                out = step(batch, **kw)
                self.held[id(batch)] = batch.kv_tokens()
                self.peak = max(self.peak, sum(self.held.values()))
                return out

            sampler.DecodeBatch.step = watched  # type: ignore[attr-defined]
            self.restore = lambda: setattr(sampler.DecodeBatch, "step", step)

    def tick(self) -> None:
        if self.restore is None:
            usage = self.backend.kv_usage()[MODEL]
            self.peak = max(self.peak, usage.blocks_used * usage.block_size)

    def close(self) -> None:
        if self.restore is not None:
            self.restore()


def run_once(
    backend: Any, t: Any, running: list[Any], long_prompt: list[int], join_after: int
) -> dict[str, float]:
    joiner = t.SampleWork("s", np.asarray(long_prompt), 1, 16, 1.0, -1, 1.0, SEED, (), ())
    ticks: list[float] = []
    joined_at: list[float] = []
    finished: dict[int, float] = {}
    watch = KVWatch(backend)

    def admit() -> list[Any]:
        ticks.append(time.perf_counter())
        watch.tick()
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
        watch.close()
    # Steps while the running request decodes (its end is known from its delivery).
    end_running = max(finished[id(w)] for w in running)
    steps = [b - a for a, b in itertools.pairwise(ticks) if b <= end_running]
    return {
        "max_step_s": max(steps),
        "median_step_s": statistics.median(steps),
        "running_total_s": end_running - start,
        "joiner_latency_s": finished[id(joiner)] - joined_at[0],
        "peak_kv_tokens": float(watch.peak),
    }


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One column's measured run (after a short warm-up), in this process."""
    torch.set_num_threads(args.threads)
    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.torch_backend import TorchBackend

    cache = Path("~/.cache/tuneloop").expanduser()  # where the server and bench/engine.py keep it
    backend = TorchBackend([MODEL], cache_dir=cache, device="cpu", dtype=torch.float32)
    backend.create_adapter(t.AdapterSpec("a", MODEL, rank=RANK, seed=SEED))
    backend.create_sampler("s", MODEL, adapter_id="a")
    for name, value in COLUMNS[args.worker].items():
        setattr(backend, name, value)
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
        prompt = np.asarray(stream[start : start + n])
        running.append(
            t.SampleWork("s", prompt, args.samples, args.new, 1.0, -1, 1.0, SEED, (), ())
        )
    long_prompt = stream[: args.long]
    run_once(backend, t, running[:2], long_prompt[:64], 2)  # warm-up
    if hasattr(backend, "kv_usage"):  # a fresh pool: the warm-up's prompt is not cached
        backend._runtimes[MODEL].decoder = None
    result = run_once(backend, t, running, long_prompt, args.join_after)
    config = backend._runtimes[MODEL].model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # fp32
    result["peak_kv_mb"] = result["peak_kv_tokens"] * per_token / 1e6
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--long", type=int, default=1024)
    parser.add_argument("--join-after", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--before-src", type=Path, help="src/ of a checkout of the dense engine")
    parser.add_argument("--worker", choices=sorted(COLUMNS), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    here = Path(__file__).resolve()
    mine = this_tree_src()
    sources = {"paged": mine}
    if args.before_src:
        before = str(args.before_src.resolve())
        sources = {"before": before, "buckets": before, "paged": mine}
    passed = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("threads", "prompts", "samples", "new", "long", "join_after")
    ]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sources}
    for _ in range(args.repeats):
        for name, src in sources.items():
            results[name].append(run_column(here, src, [*passed, f"--worker={name}"]))
            print(name, results[name][-1], flush=True)
    summary = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for name, runs in results.items()
    }
    base = "before" if "before" in summary else "paged"
    ratios = {
        name: {k: summary[base][k] / summary[name][k] for k in summary[name]} for name in summary
    }
    report = {
        "cpu": cpu_model(),
        "config": {k: str(v) for k, v in vars(args).items()},
        "rows": args.prompts * args.samples,
        "median_of_runs": summary,
        f"{base}_over": ratios,
        "runs": results,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
