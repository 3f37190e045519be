"""Sampling throughput of two engine trees side by side: bench/engine.py's sampling workload.

32 prompts of 16-48 tokens (SmolLM2's corpus text, as bench/engine.py makes them) x 4 samples x
64 new tokens, temperature 1 (`--top-k`, `--top-p`: none by default), no early stop, through
`TorchBackend.sample` from a rank-32 LoRA adapter on every linear layer and the LM head,
`--dtype` (fp32 by default), `--threads` threads.
Each measurement runs in its own process with one tree's `src/` first on the path
(`--before-src`: a checkout of the engine to compare with; the other is this tree), rounds
alternating between the two, so machine noise hits both alike; reported per round and as the
median ratio.

    python bench/sampling_ab.py --before-src /tmp/before/src [--rounds 3] [--json out.json]
    python bench/sampling_ab.py --before-src /tmp/before/src --top-p 0.9 --top-k 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# siblings: a script's folder is on sys.path
from columns import add_tree_options, run_column, this_tree_src
from engine import MODEL, RANK, SEED, corpus_text, make_prompts
from shared_prefix import cpu_model


def worker(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from tuneloop.server.engine import models
    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.torch_backend import TorchBackend

    cache = Path("~/.cache/tuneloop").expanduser()
    dtype = getattr(torch, args.dtype)
    backend = TorchBackend([MODEL], cache_dir=cache, device="cpu", dtype=dtype)
    backend.create_adapter(t.AdapterSpec("a", MODEL, rank=RANK, seed=SEED))
    backend.create_sampler("s", MODEL, adapter_id="a")
    tokenizer = AutoTokenizer.from_pretrained(models._smollm2_folder(cache))
    _, text = corpus_text()
    prompts = make_prompts(tokenizer(text)["input_ids"], args.prompts, 16, 48)

    def works(n: int, new: int) -> list[t.SampleWork]:
        return [
            t.SampleWork("s", np.asarray(p), n, new, 1.0, args.top_k, args.top_p, SEED, (), ())
            for p in prompts
        ]

    backend.sample(works(args.samples, 4))  # warm-up
    start = time.perf_counter()
    out = backend.sample(works(args.samples, args.new))
    wall = time.perf_counter() - start
    tokens = sum(len(s.tokens) for r in out for s in r.sequences)  # type: ignore[union-attr]
    assert tokens == args.prompts * args.samples * args.new
    return {"wall_s": wall, "tok_per_s": tokens / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--dtype", default="float32", help="the base weights' dtype, both trees")
    parser.add_argument("--top-k", type=int, default=-1, help="every request's top-k (-1: none)")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's top-p")
    add_tree_options(parser)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    here = Path(__file__).resolve()
    sources = {"before": str(args.before_src.resolve()), "after": this_tree_src()}
    passed = [
        f"--{k}={getattr(args, k)}" for k in ("threads", "prompts", "samples", "new", "dtype")
    ] + [
        f"--top-k={args.top_k}",
        f"--top-p={args.top_p}",
        f"--before-src={args.before_src}",
        "--worker",
    ]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sources}
    for _ in range(args.rounds):
        for name, src in sources.items():
            runs[name].append(run_column(here, src, passed))
            print(name, runs[name][-1], flush=True)
    ratios = [
        a["tok_per_s"] / b["tok_per_s"] for a, b in zip(runs["after"], runs["before"], strict=True)
    ]
    report = {
        "cpu": cpu_model(),
        "config": {k: str(v) for k, v in vars(args).items()},
        "median_tok_per_s": {
            n: statistics.median(r["tok_per_s"] for r in rs) for n, rs in runs.items()
        },
        "after_over_before_per_round": ratios,
        "after_over_before_median": statistics.median(ratios),
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
