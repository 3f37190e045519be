"""The sampling part of one decode step, two engine trees side by side (no model).

Per step: every row's next token from random fp32 logits [rows, vocab] as the paged decoder
draws it (`sampler.sample_rows`, plus, in trees that check it apart, `nonfinite_rows`), with
its logprob and stop checks; `--rows` rows of SmolLM2's vocabulary size by default. Workloads:
`plain` (temperature 1), `filtered` (top-k 50 and top-p 0.9 on every row), `mixed` (a quarter
greedy, a quarter filtered, the rest plain, 5 top-k logprobs on a quarter). Each column runs in
its own process (bench/columns.py), rounds alternating; the figure is ms per step and the
median ratio before / after.

`--head-dtype bfloat16`: the logits arrive as a bf16 head's output, and the timed step includes
what the tree's `ModelRunner._logits` does with them: the copy to fp32, except in a tree whose
native draw reads them as they are (native_draw.py).

    python bench/draw_step.py --before-src /tmp/before/src [--rounds 3] [--json out.json]
    python bench/draw_step.py --before-src /tmp/before/src --head-dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# siblings: a script's folder is on sys.path
from columns import add_tree_options, run_column, this_tree_src

WORKLOADS = ("plain", "filtered", "mixed")


def _settings(workload: str, i: int) -> dict[str, Any]:
    if workload == "plain":
        return {}
    if workload == "filtered" or i % 4 == 1:
        return {"top_k": 50, "top_p": 0.9}
    if i % 4 == 0:
        return {"temperature": 0.0, "topk_sample_logprobs": 5}
    return {}


def worker(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    from tuneloop.server.engine import sampler
    from tuneloop.server.engine.types import SampleWork

    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits = logits.to(getattr(torch, args.head_dtype))
    try:
        from tuneloop.server.engine import native_draw

        reads_head = native_draw.takes(logits)
    except ImportError:  # a tree before the native draw
        reads_head = False

    def as_drawn(head: torch.Tensor) -> torch.Tensor:  # what `ModelRunner._logits` hands on
        return head if reads_head else head.float()

    out: dict[str, float] = {}
    for workload in WORKLOADS:
        rows = []
        for i in range(args.rows):
            kw: dict[str, Any] = {"temperature": 1.0, "top_k": -1, "top_p": 1.0}
            kw.update(_settings(workload, i))
            work = SampleWork(
                "s", np.arange(4), 1, 10**6, seed=i, stop_token_ids=(2,), stop_strings=(), **kw
            )
            if hasattr(sampler, "row_seed"):
                rows.append(sampler.Row(work, sampler.row_seed(i, 0)))
            else:  # the tree of per-row torch generators
                rows.append(sampler.Row(work, sampler._generator(i, 0)))
        params = None
        if hasattr(sampler, "draw_params"):  # the decoder keeps them while its rows stay
            params = sampler.draw_params(rows, args.vocab, logits.device)
        times = []
        for _ in range(args.warmup + args.steps):
            start = time.perf_counter()
            drawn = as_drawn(logits)
            if params is None:
                sampler.nonfinite_rows(drawn)  # the decoder's separate finiteness check
                sampler.sample_rows(drawn, rows, lambda tokens: "")
            else:
                sampler.sample_rows(drawn, rows, lambda tokens: "", params)
            times.append(time.perf_counter() - start)
        out[f"{workload}_ms"] = 1000 * statistics.median(times[args.warmup :])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--head-dtype", choices=("float32", "bfloat16"), default="float32", help="the logits' dtype"
    )
    add_tree_options(parser)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    here = Path(__file__).resolve()
    sources = {"before": str(args.before_src.resolve()), "after": this_tree_src()}
    keys = ("threads", "rows", "vocab", "steps", "warmup", "head_dtype")
    passed = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    passed += [f"--before-src={args.before_src}", "--worker"]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sources}
    for _ in range(args.rounds):
        for name, src in sources.items():
            runs[name].append(run_column(here, src, passed))
            print(name, runs[name][-1], flush=True)
    medians = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    ratios = {
        k: statistics.median(
            b[k] / a[k] for a, b in zip(runs["after"], runs["before"], strict=True)
        )
        for k in medians["after"]
    }
    report = {
        "cpu": _cpu(),
        "config": {k: str(v) for k, v in vars(args).items()},
        "median_ms": medians,
        "before_over_after_median": ratios,
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _cpu() -> str:
    from shared_prefix import cpu_model

    return str(cpu_model())


if __name__ == "__main__":
    sys.exit(main())
