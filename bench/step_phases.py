"""Where one engine step's wall time goes: a decode step's phases, a training step's passes.

In-process `TorchBackend`, SmolLM2-135M, rank-32 LoRA on every linear layer and the head (as
bench/engine.py), `--dtype` weights (bf16 by default), 2 threads.
- decode: 32 prompts x 4 samples (`--prompts`, `--samples`) from a lone sampler snapshot
  (merged weights where the dtype allows); per decode step, the whole step and, timed
  around their functions, the model's forward (`ModelRunner.run`), its decoder body where the
  lean loop runs it (`decode_layers.run`) and of that the layers' one C++ call where it runs
  (`native_layers.Loop.run`), the reference paged attention where it runs instead of the
  native or compiled kernels (`_reference`, all layers), the LM head (`ModelRunner._logits`)
  and the draw (`sample_rows`). A call of 2 new tokens is subtracted, so the prefill is left
  out of the totals; a phase that did not run reads 0.
- train: one batch of 8 x 64-256 tokens: forward only, forward + backward, optim_step.
Prints the CPU model and the load with the medians of `--rounds`.

    python bench/step_phases.py decode [--new 24] [--rounds 3] [--prompts 1 --samples 1]
    python bench/step_phases.py train [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

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


def _timed(owner: Any, name: str, label: str, into: dict[str, float]) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into[label] += time.perf_counter() - begin

    setattr(owner, name, wrapper)


def _decode(backend: Any, args: argparse.Namespace) -> None:
    from tuneloop.server.engine import decode_layers, decoder, model_runner, native_layers
    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.kv import paged_attention

    backend.create_sampler("s", MODEL, adapter_id="a")
    prompts = random_prompts(args.prompts)
    spent: dict[str, float] = collections.defaultdict(float)
    _timed(model_runner.ModelRunner, "run", "forward", spent)
    _timed(decode_layers, "run", "decoder body (lean loop)", spent)
    _timed(native_layers.Loop, "run", "layers' C++ call", spent)
    _timed(paged_attention, "_reference", "reference attention", spent)
    _timed(model_runner.ModelRunner, "_logits", "head", spent)
    _timed(decoder, "sample_rows", "draw", spent)

    def call(new: int) -> dict[str, float]:
        spent.clear()
        works = [
            t.SampleWork("s", p, args.samples, new, 1.0, -1, 1.0, SEED, (), ()) for p in prompts
        ]
        begin = time.perf_counter()
        backend.sample(works)
        return {"step": time.perf_counter() - begin, **spent}

    call(4)
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        long, short = call(args.new), call(2)
        steps = args.new - 2
        rounds.append({k: (long[k] - short.get(k, 0.0)) / steps * 1e3 for k in long})
        print({k: round(v, 1) for k, v in rounds[-1].items()}, flush=True)
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    rows = args.prompts * args.samples
    print(f"decode step of {rows} rows, ms (median):", {k: round(v, 1) for k, v in medians.items()})


def _train(backend: Any, args: argparse.Namespace) -> None:
    from tuneloop.server.engine import types as t

    step = t.AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.0, 0.0)
    stream = list(np.random.default_rng(SEED).integers(100, 40000, 200_000))
    warm, batch = make_batches(stream, 2, 8, 64, 256)

    cross_entropy_pass(backend, warm)
    backend.optim_step("a", step)
    tokens = sum(len(r) - 1 for r in batch)
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        marks = [time.perf_counter()]
        cross_entropy_pass(backend, batch, forward_only=True)
        marks.append(time.perf_counter())
        cross_entropy_pass(backend, batch)
        marks.append(time.perf_counter())
        backend.optim_step("a", step)
        marks.append(time.perf_counter())
        names = ("forward only", "forward + backward", "optim_step")
        rounds.append({n: (b - a) * 1e3 for n, a, b in zip(names, marks, marks[1:], strict=False)})
        print({k: round(v) for k, v in rounds[-1].items()}, flush=True)
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(
        f"training step of {tokens} tokens, ms (median):", {k: round(v) for k, v in medians.items()}
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["decode", "train"])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--new", type=int, default=24, help="decode: new tokens per call")
    parser.add_argument("--prompts", type=int, default=32, help="decode: prompts per call")
    parser.add_argument("--samples", type=int, default=4, help="decode: samples per prompt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backend = adapted_backend(DTYPES[args.dtype])
    print(f"cpu: {cpu_model()}  {args.dtype}  threads {args.threads}  load {os.getloadavg()}")
    (_decode if args.what == "decode" else _train)(backend, args)
    print("load:", os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
