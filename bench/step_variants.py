"""The compiled RMSNorm (engine/compiled.py) against transformers' eager norms, in engine steps.

One in-process `TorchBackend` of SmolLM2-135M (rank-32 LoRA on every linear layer and the head,
as bench/engine.py); before every measurement its norms are switched between transformers'
eager forward and the compiled one, alternating, so that machine noise hits both alike. What
is measured:
- train: forward_backward of one batch of 8 x 64-256 tokens (bench/engine.py's batches);
- decode: one decode step of 128 rows (32 prompts x 4 samples from a lone sampler snapshot): a
  call of `--new` tokens minus a call of 2, per step, so the prefill is left out;
- micro: one RMSNorm at SmolLM2's width, training (forward + backward of 1,408 tokens) and
  decoding (forward of 128 rows); also the gated MLP's SiLU product, compiled the same way
  (not adopted: slower than eager).
Prints the CPU model, the load, each side's median and their ratio.

    python bench/step_variants.py train [--rounds 5]
    python bench/step_variants.py decode [--rounds 3] [--new 24]
    python bench/step_variants.py micro
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engine import (
    MODEL,
    SEED,
    adapted_backend,
    cpu_model,
    cross_entropy_pass,
    make_batches,
    random_prompts,
)


def _best_ms(fn: Callable[[], Any], repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def _micro() -> None:
    from tuneloop.server.engine import compiled
    from tuneloop.server.engine.host_allocator import tune_for_cpu_engine

    tune_for_cpu_engine()
    norm = compiled._compiled_norm()

    def silu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(gate) * up

    product = torch.compile(silu_product, dynamic=True)
    w = torch.ones(576, dtype=torch.bfloat16)
    for label, rows, grad in (("decode, 128 rows", 128, False), ("training, 1,408", 1408, True)):
        x = torch.randn((1, rows, 576), dtype=torch.bfloat16, requires_grad=grad)
        g, u = (
            torch.randn((1, rows, 1536), dtype=torch.bfloat16, requires_grad=grad) for _ in "gu"
        )

        def run(
            fn: Callable[..., torch.Tensor], *args: Any, grad: bool = grad
        ) -> Callable[[], None]:
            def call() -> None:
                if grad:
                    fn(*args).sum().backward()
                else:
                    with torch.no_grad():
                        fn(*args)

            return call

        pairs = (
            ("rms_norm", run(compiled.rms_norm, x, w, 1e-5), run(norm, x, w, 1e-5)),
            ("silu_product", run(silu_product, g, u), run(product, g, u)),
        )
        for name, eager, fused in pairs:
            e, c = _best_ms(eager), _best_ms(fused)
            print(f"{name:13s} {label:17s} eager {e:7.3f} ms  compiled {c:7.3f} ms  {e / c:.2f}x")


def _alternate(
    backend: Any, rounds: int, measure: Callable[[], float], unit: str
) -> dict[str, list[float]]:
    """`measure()` with the model's norms eager, then compiled, `rounds` times; per side."""
    from tuneloop.server.engine import compiled

    model = next(iter(backend.resident_models().values()))
    results: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(rounds):
        for side in results:
            compiled.uninstall(model)
            if side == "compiled":
                compiled.install(model)
            results[side].append(measure())
        print(
            {k: round(v[-1], 1) for k, v in results.items()},
            unit,
            f"load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    return results  # the norms are compiled again, as the engine runs them


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["train", "decode", "micro"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=24, help="decode: new tokens per call")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_model()}  bfloat16  threads {args.threads}  load {os.getloadavg()}")
    if args.what == "micro":
        _micro()
        return 0
    begin = time.perf_counter()
    backend = adapted_backend(torch.bfloat16)  # compiles the norms while loading (compiled.py)
    print(f"backend loaded and compiled in {time.perf_counter() - begin:.1f} s")
    if args.what == "train":
        stream = list(np.random.default_rng(SEED).integers(100, 40000, 200_000))
        warm, batch = make_batches(stream, 2, 8, 64, 256)
        cross_entropy_pass(backend, warm)

        def measure() -> float:
            start = time.perf_counter()
            cross_entropy_pass(backend, batch)
            return (time.perf_counter() - start) * 1e3

        results = _alternate(backend, args.rounds, measure, "ms per forward_backward")
    else:
        from tuneloop.server.engine import types as t

        backend.create_sampler("s", MODEL, adapter_id="a")
        prompts = random_prompts()

        def call(new: int) -> float:
            works = [t.SampleWork("s", p, 4, new, 1.0, -1, 1.0, SEED, (), ()) for p in prompts]
            start = time.perf_counter()
            backend.sample(works)
            return time.perf_counter() - start

        call(4)

        def measure() -> float:
            return (call(args.new) - call(2)) / (args.new - 2) * 1e3

        results = _alternate(backend, args.rounds, measure, "ms per decode step")
    medians = {k: statistics.median(v) for k, v in results.items()}
    eager, fused = medians["eager"], medians["compiled"]
    print(
        f"{args.what}: eager {eager:.1f} ms, compiled {fused:.1f} ms, {eager / fused:.2f}x "
        f"(medians of {args.rounds}); load {os.getloadavg()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
