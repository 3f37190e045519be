"""Compiled kernels against their eager forms, in engine steps: the RMSNorm (engine/compiled.py)
against transformers' norms, the decode attention (kv/decode_attention.py) against gather + SDPA.

One in-process `TorchBackend` of SmolLM2-135M (rank-32 LoRA on every linear layer and the head,
as bench/engine.py); before every measurement its norms are switched between transformers'
eager forward and the compiled one, alternating, so that machine noise hits both alike. What
is measured:
- train: forward_backward of one batch of 8 x 64-256 tokens (bench/engine.py's batches);
- decode: one decode step of 128 rows (32 prompts x 4 samples from a lone sampler snapshot): a
  call of `--new` tokens minus a call of 2, per step, so the prefill is left out;
- decode-attention: the same decode step, switching the decode rows' attention instead of
  the norms: gathered for SDPA ("eager") or the kernel the engine picked ("compiled");
- decode-native: the same, inductor's decode kernel (kv/decode_attention.py) against the
  native one (kv/native_decode.py; bf16 on CPUs with AVX512-BF16);
- lora-columns: the same, a lone adapter's [x | x @ A.T] by oneDNN's matmul and a
  concatenation against the native kernel (lora/native_columns.py);
- silu-product, rotary: the same, the gated MLPs' SiLU product (gated_mlp.py) or the
  rotary embedding (rotary.py) eager against the native loop;
- micro: one RMSNorm at SmolLM2's width, training (forward + backward of 1,408 tokens) and
  decoding (forward of 128 rows); also the gated MLP's SiLU product, compiled the same way
  (not adopted: slower than eager).
Prints the CPU model, the load, each side's median and their ratio.

    python bench/step_variants.py train [--rounds 5]
    python bench/step_variants.py decode [--rounds 3] [--new 24]
    python bench/step_variants.py decode-attention [--rounds 3] [--new 64]
    python bench/step_variants.py decode-native [--rounds 5] [--new 64]
    python bench/step_variants.py lora-columns [--rounds 5] [--new 64]
    python bench/step_variants.py silu-product|rotary [--rounds 5] [--new 64]
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


def _switch_norms(backend: Any) -> Callable[[str], None]:
    """Sides: the model's norms eager, or compiled (as the engine runs them)."""
    from tuneloop.server.engine import compiled

    model = next(iter(backend.resident_models().values()))

    def switch(side: str) -> None:
        compiled.uninstall(model)
        if side == "compiled":
            compiled.install(model)

    return switch


def _switch_decode_attention(backend: Any) -> Callable[[str], None]:
    """Sides: decode rows gathered for SDPA ("eager"), or the decode kernel the engine picked
    (kv/native_decode.py or kv/decode_attention.py); the norms compiled on both."""
    [runtime] = backend._runtimes.values()
    assert runtime.compiled_decode, "no decode kernel warmed up"
    kernel = runtime.decode_kernel

    def switch(side: str) -> None:
        runtime.decode_kernel = kernel if side == "compiled" else None

    return switch


def _switch_native(backend: Any) -> Callable[[str], None]:
    """Sides: inductor's decode kernel, or the native one."""
    from tuneloop.server.engine.kv import decode_attention, native_decode

    [runtime] = backend._runtimes.values()
    assert runtime.decode_kernel is native_decode.attend, "the native kernel is not in use"
    heads, kv_heads, dim = 9, 3, 64  # SmolLM2's
    assert decode_attention.warm_up(
        heads, kv_heads, dim, dim, dim**-0.5, torch.bfloat16, torch.device("cpu")
    )

    def switch(side: str) -> None:
        native = side == "native"
        runtime.decode_kernel = native_decode.attend if native else decode_attention.compiled()

    return switch


def _switch_columns(backend: Any) -> Callable[[str], None]:
    """Sides: the lone adapter's LoRA columns by oneDNN and `torch.cat`, or natively; the
    fused weights are made again at each switch (the next step builds them)."""
    from tuneloop.server.engine.lora import fused, native_columns

    [runtime] = backend._runtimes.values()
    available = native_columns.available
    assert available(torch.bfloat16, torch.device("cpu")), "no native LoRA columns kernel here"

    def switch(side: str) -> None:
        native = side == "native"
        fused.native_columns.available = available if native else lambda *_: False  # type: ignore[method-assign]
        runtime.bank.release_lone()
        if runtime.decoder is not None:
            runtime.decoder.runner.forget_routings()

    return switch


def _switch_silu_product(backend: Any) -> Callable[[str], None]:
    """Sides: the gated MLPs' own forward, or the native SiLU product in sampling steps."""
    from tuneloop.server.engine import gated_mlp

    model = next(iter(backend.resident_models().values()))
    assert gated_mlp.uninstall(model), "no gated MLP takes the native product here"

    def switch(side: str) -> None:
        gated_mlp.uninstall(model)
        if side == "native":
            gated_mlp.install(model)

    return switch


def _switch_rotary(backend: Any) -> Callable[[str], None]:
    """Sides: the model family's own rotary function, or the native loop in sampling steps."""
    from tuneloop.server.engine import rotary

    model = next(iter(backend.resident_models().values()))
    assert rotary.installed(), "the native rotary is not in use here"

    def switch(side: str) -> None:
        rotary.uninstall()
        if side == "native":
            rotary.install(model)

    return switch


def _alternate(
    switch: Callable[[str], None],
    rounds: int,
    measure: Callable[[], float],
    unit: str,
    sides: tuple[str, str] = ("eager", "compiled"),
) -> dict[str, list[float]]:
    """`measure()` on the first side, then the second, `rounds` times; per side."""
    results: dict[str, list[float]] = {side: [] for side in sides}
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
    return results  # the second side again, as the engine runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "what",
        choices=[
            "train",
            "decode",
            "decode-attention",
            "decode-native",
            "lora-columns",
            "silu-product",
            "rotary",
            "micro",
        ],
    )
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

        results = _alternate(
            _switch_norms(backend), args.rounds, measure, "ms per forward_backward"
        )
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

        switches = {
            "decode": _switch_norms,
            "decode-attention": _switch_decode_attention,
            "decode-native": _switch_native,
            "lora-columns": _switch_columns,
            "silu-product": _switch_silu_product,
            "rotary": _switch_rotary,
        }
        named = {
            "decode-native": ("inductor", "native"),
            "lora-columns": ("onednn", "native"),
            "silu-product": ("eager", "native"),
            "rotary": ("eager", "native"),
        }
        sides = named.get(args.what, ("eager", "compiled"))
        switch = switches[args.what](backend)
        results = _alternate(switch, args.rounds, measure, "ms per decode step", sides)
    medians = {k: statistics.median(v) for k, v in results.items()}
    (first, before), (second, after) = medians.items()
    print(
        f"{args.what}: {first} {before:.1f} ms, {second} {after:.1f} ms, {before / after:.2f}x "
        f"(medians of {args.rounds}); load {os.getloadavg()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
