"""What per-request failure isolation costs the torch engine (SmolLM2-135M, CPU by default).

Measured side by side in one process, runs alternating, the engine as it is (`guarded`) next to
the same engine with the guards taken out (`bare`, the obvious alternative: what it did before
they existed):
  - training: forward_backward of 8 datums (64-192 tokens) + optim_step, rank-32 LoRA. Guarded:
    each micro-batch's gradients computed apart and added only if finite (one norm per adapter
    per micro-batch), optim_step's closed-form overflow bounds. Bare: gradients accumulated in
    place unchecked, the step applied unchecked;
  - sampling: 16 prompts x 4 samples x 32 new tokens in one decode batch. Guarded: each decode
    step checks every row's logits for NaN / infinity. Bare: no check.
  - optim_step alone on LoRA-sized fp32 tensors (SmolLM2-135M's shapes, rank 32: 9.3M values):
    `AdapterOptimizer.step` (guarded) next to torch's clip + `torch.optim.AdamW` (bare).
Reported: the median time of each, and the ratio guarded / bare. `--optim-only` skips the
engine columns (no model load).

    python bench/isolation_overhead.py [--threads 2] [--repeats 3] [--json out.json]
        [--datums 8] [--prompts 16] [--samples 4] [--new 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import MODEL, RANK, SEED  # a sibling: a script's folder is on sys.path


def _bare(enabled: bool) -> Any:
    """Take the guards out (enabled) or put them back; returns the originals to restore."""
    # The sampler's finiteness check travels in the step's one device-to-host copy (draw.py):
    # there is no separate guard left to take out there.
    from tuneloop.server.engine import optim, training

    if not hasattr(_bare, "originals"):
        _bare.originals = (  # type: ignore[attr-defined]
            training._isolated_micro_batch,
            optim.AdapterOptimizer._bounds_after,
        )
    isolated, bounds = _bare.originals  # type: ignore[attr-defined]
    if enabled:
        training._isolated_micro_batch = training._run_micro_batch  # type: ignore[assignment]
        optim.AdapterOptimizer._bounds_after = (  # type: ignore[method-assign]
            lambda self, step, largest, b: (0.0, 0.0, 0.0)
        )
    else:
        training._isolated_micro_batch = isolated
        optim.AdapterOptimizer._bounds_after = bounds  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--datums", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--optim-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = optim_columns(args.repeats)
    if not args.optim_only:
        report |= engine_columns(args)
    for key, value in report.items():
        print(f"{key:16s} {value:.4f}" + ("" if "ratio" in key else " s"))
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, **report}, indent=1))
    return 0


def optim_columns(repeats: int) -> dict[str, float]:
    from tuneloop.server.engine.optim import AdapterOptimizer
    from tuneloop.server.engine.types import AdamStep

    shapes = [(RANK, 576), (576, RANK)] * 7 * 30 + [(RANK, 576), (49152, RANK)]
    step = AdamStep(1e-3, 0.9, 0.95, 1e-8, 0.0, 1.0)

    def params() -> list[torch.nn.Parameter]:
        generator = torch.Generator().manual_seed(SEED)
        return [torch.nn.Parameter(torch.randn(s, generator=generator) * 0.01) for s in shapes]

    mine, theirs = params(), params()
    guard = AdapterOptimizer(mine)
    plain = torch.optim.AdamW(theirs, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def bare() -> None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in theirs])
        torch.nn.utils.clip_grads_with_norm_(theirs, 1.0, norm)
        float(norm)
        plain.step()
        plain.zero_grad()

    times: dict[str, list[float]] = {"optim bare": [], "optim guarded": []}
    for i in range(2 + 4 * repeats):  # alternating, so machine noise hits both alike
        for name, group, call in (
            ("optim bare", theirs, bare),
            ("optim guarded", mine, lambda: guard.step(step)),
        ):
            for p in group:
                p.grad = torch.full_like(p, 1e-3 * (i + 1))
            start = time.perf_counter()
            call()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    columns = {k: statistics.median(v) for k, v in times.items()}
    columns["optim ratio"] = columns["optim guarded"] / columns["optim bare"]
    return columns


def engine_columns(args: argparse.Namespace) -> dict[str, float]:
    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.torch_backend import TorchBackend

    cache = Path(tempfile.gettempdir()) / "tuneloop-bench-cache"
    backend = TorchBackend([MODEL], cache_dir=cache, dtype=torch.float32)
    backend.create_adapter(t.AdapterSpec("a", MODEL, rank=RANK, seed=SEED))
    rng = np.random.default_rng(SEED)
    examples = []
    for n in rng.integers(64, 192, size=args.datums):
        tokens = rng.integers(0, 30000, size=int(n) + 1).astype(np.int64)
        examples.append(t.Example(tokens[:-1], {"target_tokens": tokens[1:]}))
    work = t.ForwardBackwardWork("a", tuple(examples), "cross_entropy", {}, False)
    step = t.AdamStep(1e-4, 0.9, 0.95, 1e-8, 0.0, 1.0)
    backend.create_sampler("s", MODEL, adapter_id="a")
    prompts = [
        rng.integers(0, 30000, size=int(n)).astype(np.int64)
        for n in rng.integers(16, 48, args.prompts)
    ]
    samples = [
        t.SampleWork("s", p, args.samples, args.new, 1.0, -1, 1.0, SEED + i, (), ())
        for i, p in enumerate(prompts)
    ]

    def train() -> float:
        start = time.perf_counter()
        [result] = backend.forward_backward([work])
        assert not isinstance(result, t.EngineError), result
        backend.optim_step("a", step)
        return time.perf_counter() - start

    def sample() -> float:
        start = time.perf_counter()
        results = backend.sample(samples)
        assert not any(isinstance(r, t.EngineError) for r in results)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {}
    train(), sample()  # warm-up
    for _ in range(args.repeats):
        for column in ("guarded", "bare"):
            _bare(column == "bare")
            times.setdefault(f"train {column}", []).append(train())
            times.setdefault(f"sample {column}", []).append(sample())
    _bare(False)
    report = {k: statistics.median(v) for k, v in times.items()}
    for kind in ("train", "sample"):
        report[f"{kind} ratio"] = report[f"{kind} guarded"] / report[f"{kind} bare"]
    return report


if __name__ == "__main__":
    sys.exit(main())
