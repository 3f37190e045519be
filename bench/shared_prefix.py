"""Shared-prefix sampling: many samples of a long prompt, prefilled once or once per sample.

`--prompts` prompts of `--prompt-len` tokens (SmolLM2's corpus text), `--samples` samples each,
`--new` new tokens (temperature 1, no early stop), from the base model, side by side in one
run, rounds alternating:
  - engine: `TorchBackend.sample` (paged KV cache: each prompt prefilled once, its blocks shared
    by its samples; a fresh pool per round so that no round finds the last one's prompts);
  - hf:     `model.generate(num_return_sequences=S)` on the left-padded prompts, which repeats
    every prompt S times before its prefill.
Reported: prefill tokens (counted in the model's forward passes), prefill model FLOPs (2 x the
linear weights per token, LM head excluded as neither computes logits of every prompt token,
plus causal attention 2 x L(L+1) x heads x head_dim per layer and prefilled sequence), wall
time per round and the ratios hf / engine.

    python bench/shared_prefix.py [--prompts 8 --prompt-len 512 --samples 8 --new 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import MODEL, SEED, corpus_text  # a sibling: a script's folder is on sys.path


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def count_tokens(model: torch.nn.Module) -> tuple[list[tuple[int, int]], Any]:
    """(rows, tokens per row) of every forward pass of the model's transformer body."""
    seen: list[tuple[int, int]] = []
    decoder: Any = model.get_decoder()  # type: ignore[operator]
    hook = decoder.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    return seen, hook


def prefill_flops(config: Any, lengths: list[int], linear_params: int) -> float:
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or head_dim
    attention = sum(2 * n * (n + 1) * heads * head_dim for n in lengths)
    return 2.0 * linear_params * sum(lengths) + attention * config.num_hidden_layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from tuneloop.server.engine import models
    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.torch_backend import TorchBackend

    cache = Path("~/.cache/tuneloop").expanduser()
    backend = TorchBackend([MODEL], cache_dir=cache, device="cpu", dtype=torch.float32)
    backend.create_sampler("base", MODEL)
    runtime = backend._runtimes[MODEL]
    model = runtime.model
    tokenizer = AutoTokenizer.from_pretrained(models._smollm2_folder(cache))
    _, text = corpus_text()
    stream: list[int] = tokenizer(text)["input_ids"]
    rng = np.random.default_rng(SEED)
    starts = rng.integers(0, len(stream) - args.prompt_len, size=args.prompts)
    prompts = [stream[s : s + args.prompt_len] for s in starts]
    works = [
        t.SampleWork("base", np.asarray(p), args.samples, args.new, 1.0, -1, 1.0, SEED + i, (), ())
        for i, p in enumerate(prompts)
    ]
    linear = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in name
    )
    rows = args.prompts * args.samples

    def engine_round() -> dict[str, float]:
        runtime.decoder = None  # a fresh pool: no prompt cached by the last round
        seen, hook = count_tokens(model)
        start = time.perf_counter()
        try:
            results = backend.sample(works)
        finally:
            hook.remove()
        wall = time.perf_counter() - start
        assert all(len(s.tokens) == args.new for r in results for s in r.sequences)  # type: ignore[union-attr]
        total = sum(r * n for r, n in seen)
        prefill = total - rows * (args.new - 1)
        return {
            "wall_s": wall,
            "prefill_tokens": float(prefill),
            "prefill_gflop": prefill_flops(model.config, [args.prompt_len] * args.prompts, linear)
            / 1e9,
        }

    pad = runtime.pad_id

    def hf_round() -> dict[str, float]:
        ids = torch.tensor(prompts)  # equal lengths: no padding needed
        seen, hook = count_tokens(model)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                out = model.generate(  # type: ignore[operator]
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    num_return_sequences=args.samples,
                    max_new_tokens=args.new,
                    min_new_tokens=args.new,
                    pad_token_id=pad,
                )
        finally:
            hook.remove()
        wall = time.perf_counter() - start
        assert out.shape == (rows, args.prompt_len + args.new)
        prefill_rows, prefill_len = seen[0]
        return {
            "wall_s": wall,
            "prefill_tokens": float(prefill_rows * prefill_len),
            "prefill_gflop": prefill_flops(model.config, [prefill_len] * prefill_rows, linear)
            / 1e9,
        }

    columns = {"engine": engine_round, "hf": hf_round}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in columns}
    for _ in range(args.rounds):
        for name, fn in columns.items():
            runs[name].append(fn())
            print(name, runs[name][-1], flush=True)
    summary = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    ratios = {k: summary["hf"][k] / summary["engine"][k] for k in summary["engine"]}
    report = {
        "cpu": cpu_model(),
        "threads": args.threads,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "median_of_rounds": summary,
        "hf_over_engine": ratios,
        "runs": runs,
    }
    print(
        json.dumps({k: report[k] for k in ("cpu", "median_of_rounds", "hf_over_engine")}, indent=2)
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
