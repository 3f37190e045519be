"""The compiled RMSNorm (engine/compiled.py) against transformers' eager norms, in engine steps.

One in-process `TorchBackend` of SmolLM2-135M (rank-32 LoRA on every linear layer and the head,
as bench/engine.py); before every measurement one piece is switched between what it was and
what the engine does now, alternating, so that machine noise hits both alike (`--variant
norm`: transformers' eager RMSNorms against the compiled one). What is measured:
- train: forward_backward of one batch of 8 x 64-256 tokens (bench/engine.py's batches);
- decode: one decode step of 128 rows (32 prompts x 4 samples from a lone sampler snapshot): a
  call of `--new` tokens minus a call of 2, per step, so the prefill is left out;
- micro: one RMSNorm at SmolLM2's width, training (forward + backward of 1,408 tokens) and
  decoding (forward of 128 rows); also the gated MLP's SiLU product, compiled the same way
  (not adopted: slower than eager).
Prints the CPU model, the load, each side's median and their ratio.

    python bench/step_variants.py train [--variant norm] [--rounds 5]
    python bench/step_variants.py decode [--variant norm] [--rounds 3] [--new 24]
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

from engine import MODEL, SEED, adapted_backend, cpu_model, cross_entropy_pass, make_batches


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
    norm = compiled._Compiled.get()

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


class _Switch:
    """Puts one side of a variant in place."""

    def __init__(self, backend: Any, variant: str) -> None:
        self.model = next(iter(backend.resident_models().values()))
        self.variant = variant
        self.sides = {"norm": ("eager", "compiled")}[variant]

    def __call__(self, side: str) -> None:
        from tuneloop.server.engine import compiled

        compiled.uninstall(self.model)
        if side == "compiled":
            compiled.install(self.model)


def _alternate(
    switch: _Switch, rounds: int, measure: Callable[[], float], unit: str
) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {side: [] for side in switch.sides}
    for _ in range(rounds):
        for side in results:
            switch(side)
            results[side].append(measure())
        print(
            {k: round(v[-1], 1) for k, v in results.items()},
            unit,
            f"load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    switch(switch.sides[1])  # what the engine does now
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["train", "decode", "micro"])
    parser.add_argument("--variant", choices=["norm"], default="norm")
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
    backend = adapted_backend(torch.bfloat16)  # compiles the glue while loading (compiled.py)
    print(f"backend loaded and compiled in {time.perf_counter() - begin:.1f} s")
    if args.what == "train":
        stream = list(np.random.default_rng(SEED).integers(100, 40000, 200_000))
        warm, batch = make_batches(stream, 2, 8, 64, 256)
        cross_entropy_pass(backend, warm)

        def measure() -> float:
            start = time.perf_counter()
            cross_entropy_pass(backend, batch)
            return (time.perf_counter() - start) * 1e3

        results = _alternate(_Switch(backend, "norm"), args.rounds, measure, "ms per step")
    else:
        from tuneloop.server.engine import types as t

        backend.create_sampler("s", MODEL, adapter_id="a")
        rng = np.random.default_rng(SEED)
        prompts = [rng.integers(0, 49_000, size=int(rng.integers(16, 48))) for _ in range(32)]

        def call(new: int) -> float:
            works = [t.SampleWork("s", p, 4, new, 1.0, -1, 1.0, SEED, (), ()) for p in prompts]
            start = time.perf_counter()
            backend.sample(works)
            return time.perf_counter() - start

        call(4)

        def measure() -> float:
            return (call(args.new) - call(2)) / (args.new - 2) * 1e3

        switch = _Switch(backend, args.variant)
        results = _alternate(switch, args.rounds, measure, "ms per decode step")
    medians = {k: statistics.median(v) for k, v in results.items()}
    (before, b), (after, a) = medians.items()
    print(
        f"{args.what}, {args.variant}: {before} {b:.1f} ms, {after} {a:.1f} ms, {b / a:.2f}x "
        f"(medians of {args.rounds}); load {os.getloadavg()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
