"""The native linear kernel against oneDNN's packed weights, in a decode step (measured).

Two parts, each alternating the two sides round by round so that machine noise hits both
alike, and printing the CPU model, the load and its measured peaks' context:
- "linears": the 121 linears of a SmolLM2-135M decode step (q/k/v with rank-32 LoRA columns,
  o, gate/up, down, the head), each layer's weights distinct so that they stream from memory
  as in a step, through `native_linear.linear` and through `mkldnn._linear_pointwise` on
  oneDNN's packed weights, at several row counts: ms a step and GB/s of weights read;
- "steps": one in-process `TorchBackend` (bench/engine.py's adapter, a snapshot sampler), a
  decode step's time (a call of `--new` tokens minus a call of 2, per step) with the lone
  copy's weights in the kernel's layout and with `TUNELOOP_NATIVE_LINEAR=0` (oneDNN's), at
  1, 4, 32 and 128 rows. In the kernel's layout a step of decode rows alone runs its layers
  as one C++ call (native_layers.py); on oneDNN's weights, the Python lean loop
  (decode_layers.py): the side's whole difference;
- "spans" (bf16 only, not part of "both"): a lone key's decode groups as lora/fused.py builds
  them, each block multiplying only the input pairs that hold weights against every pair
  (calls of more than 16 rows skip; fewer multiply every pair either way), then decode steps
  of 128 rows on a lone copy packed with and without the spans, the sides alternated.

On a CPU with AMX the kernel runs on the tile unit (native_linear.tiles). `--dtype float32`
measures the fp32 kernel (linear_fp32.cpp: AVX-512 tiles where the CPU has them, AVX2 tiles
under TUNELOOP_CPU_ISA=avx2 or on an AVX2 CPU) on the merged weights an fp32 lone copy holds
(no LoRA columns).

    python bench/native_linear.py [--rounds 3] [--new 34] [--part linears|steps|spans|both]
                                  [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from engine import DTYPES, MODEL, RANK, SEED, adapted_backend, cpu_model, random_prompts

# SmolLM2-135M's decode groups: (outputs, inputs with the LoRA columns), 30 layers, the head
SHAPES = [(960, 576 + 96), (576, 576 + 32), (3072, 576 + 64), (576, 1536 + 32)]
HEAD = (49152, 576 + 32)
# fp32: the merged weights (an fp32 lone copy merges its adapter: torch_backend.py)
MERGED_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
MERGED_HEAD = (49152, 576)
LAYERS = 30


def _time(run: Callable[[], object], repeat: int) -> float:
    run()
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - start) / repeat


def linears(rounds: int, dtype: torch.dtype) -> None:
    from tuneloop.server.engine import native_linear

    gen = torch.Generator().manual_seed(SEED)
    shapes, head_shape = (SHAPES, HEAD) if dtype == torch.bfloat16 else (MERGED_SHAPES, MERGED_HEAD)
    plain = [[torch.randn(n, k, generator=gen).to(dtype) for n, k in shapes] for _ in range(LAYERS)]
    head = torch.randn(*head_shape, generator=gen).to(dtype)
    ours = [[native_linear.pack(w) for w in ws] for ws in plain]
    ours_head = native_linear.pack(head)
    reorder = torch.ops.mkldnn._reorder_linear_weight
    theirs = [[reorder(w) for w in ws] for ws in plain]
    theirs_head = reorder(head)
    del plain, head
    size = torch.finfo(dtype).bits // 8
    read = (sum(n * k for n, k in shapes) * LAYERS + head_shape[0] * head_shape[1]) * size
    pointwise = torch.ops.mkldnn._linear_pointwise
    print(f"linears of a decode step: {read / 1e6:.0f} MB of {dtype} weights")
    print("rows | native ms | GB/s | oneDNN ms | GB/s | oneDNN / native")
    for rows in (1, 2, 4, 8, 16, 32, 128):
        xs = [torch.randn(rows, k, generator=gen).to(dtype) for _, k in shapes]
        xh = torch.randn(rows, head_shape[1], generator=gen).to(dtype)

        def native_step(xs: list[torch.Tensor] = xs, xh: torch.Tensor = xh) -> None:
            for layer in ours:
                for w, x in zip(layer, xs, strict=True):
                    native_linear.linear(x, w)
            native_linear.linear(xh, ours_head)

        def onednn_step(xs: list[torch.Tensor] = xs, xh: torch.Tensor = xh) -> None:
            for layer in theirs:
                for w, x in zip(layer, xs, strict=True):
                    pointwise(x, w, None, "none", [], "")
            pointwise(xh, theirs_head, None, "none", [], "")

        repeat = 8 if rows <= 32 else 3
        a, b = [], []
        for _ in range(rounds):
            a.append(_time(native_step, repeat))
            b.append(_time(onednn_step, repeat))
        na, nb = statistics.median(a), statistics.median(b)
        print(
            f"{rows:4d} | {na * 1e3:8.2f} | {read / na / 1e9:5.1f} | {nb * 1e3:8.2f} | "
            f"{read / nb / 1e9:5.1f} | {nb / na:.2f}x",
            flush=True,
        )


def spans(rounds: int) -> None:
    """A decode step's bf16 groups as a lone key's copy holds them (lora/fused.py: q/k/v and
    gate/up stacked, each member's scale * B in its own rank's extra columns, zeros in the
    others'; 30 layers and the head), each block multiplying only its pairs that hold weights
    (`NativeWeight.spans`) against every pair (the same weights, spans None): ms a step, the
    TFLOP/s of the products that hold weights, and the ratio."""
    import dataclasses

    from torch import nn

    from tuneloop.server.engine import native_linear
    from tuneloop.server.engine.lora.fused import FusedLinear
    from tuneloop.server.engine.native_linear import NativeWeight

    gen = torch.Generator().manual_seed(SEED)
    members = [((576, 192, 192), 576), ((576,), 576), ((1536, 1536), 576), ((576,), 1536)]

    def group(sizes: tuple[int, ...], k: int) -> NativeWeight:
        bases = [
            nn.Linear(k, n, bias=False).to(torch.bfloat16).requires_grad_(False) for n in sizes
        ]
        factors = [
            (
                torch.randn(RANK, k, generator=gen).bfloat16(),
                torch.randn(n, RANK, generator=gen).bfloat16(),
                2.0,
            )
            for n in sizes
        ]
        weight = FusedLinear.build(bases, factors).weight
        assert isinstance(weight, NativeWeight)
        return weight

    groups = [group(sizes, k) for _ in range(LAYERS) for sizes, k in members]
    groups.append(group((HEAD[0],), HEAD[1] - RANK))
    every = [dataclasses.replace(g, spans=None) for g in groups]
    # multiply-adds a row that hold weights: the base's and each member's own rank's
    macs = LAYERS * sum(sum(sizes) * (k + RANK) for sizes, k in members) + HEAD[0] * HEAD[1]
    print(f"a lone key's decode groups: {sum(g.spans is not None for g in groups)} of "
          f"{len(groups)} with zero pairs to leave out")  # fmt: skip
    print("rows | spans ms | TFLOP/s | every pair ms | TFLOP/s | every / spans")
    for rows in (1, 4, 8, 16, 32, 128):
        xs = {
            g.in_features: torch.randn(rows, g.in_features, generator=gen).bfloat16()
            for g in groups
        }

        def step(weights: list[NativeWeight], xs: dict[int, torch.Tensor] = xs) -> None:
            for w in weights:
                native_linear.linear(xs[w.in_features], w)

        repeat = 8 if rows <= 32 else 3
        a, b = [], []
        for index in range(rounds):  # (which side goes first alternates: at <= 16 rows, where
            # both run the same code, spans-first rounds read 0.93-0.99x)
            for skip in (True, False) if index % 2 == 0 else (False, True):
                (a if skip else b).append(
                    _time(lambda s=skip: step(groups if s else every), repeat)
                )
        na, nb = statistics.median(a), statistics.median(b)
        flops = 2 * macs * rows
        print(
            f"{rows:4d} | {na * 1e3:8.2f} | {flops / na / 1e12:.3f} | {nb * 1e3:8.2f} | "
            f"{flops / nb / 1e12:.3f} | {nb / na:.3f}x",
            flush=True,
        )


def span_steps(rounds: int, new: int) -> None:
    """Decode steps of 128 rows (bench/engine.py's adapter, a snapshot sampler) on a lone copy
    packed with its zero pairs' spans and without them (`native_linear._ZERO_SPANS`, the copy
    made again for each side), a call of `new` tokens minus a call of 2, per step."""
    from tuneloop.server.engine import native_linear

    runtime, call, prompts = _sampler(torch.bfloat16)

    def side(skip: bool) -> float:
        native_linear._ZERO_SPANS = skip
        runtime.bank.release_lone()  # the lone copy made again with this side's spans
        call(2, len(prompts), 4)
        return (call(new, len(prompts), 4) - call(2, len(prompts), 4)) / (new - 2)

    a, b = [], []
    for index in range(rounds):
        for skip in (True, False) if index % 2 == 0 else (False, True):
            (a if skip else b).append(side(skip))
    native_linear._ZERO_SPANS = True
    na, nb = statistics.median(a), statistics.median(b)
    print(f"decode step, {len(prompts) * 4} rows: spans {na * 1e3:.1f} ms, every pair "
          f"{nb * 1e3:.1f} ms, every / spans {nb / na:.3f}x "
          f"(per round: {[round(y / x, 3) for x, y in zip(a, b, strict=True)]})")  # fmt: skip


def _sampler(dtype: torch.dtype) -> tuple[Any, Callable[[int, int, int], float], list[Any]]:
    """An in-process backend's runtime with a snapshot sampler of bench/engine.py's adapter, a
    timed sampling call (new tokens, prompts, samples each) and the prompts."""
    from tuneloop.server.engine import types as t

    backend = adapted_backend(dtype)
    backend.create_sampler("s", MODEL, adapter_id="a")
    [runtime] = backend._runtimes.values()
    prompts = random_prompts()

    def call(tokens: int, count: int, samples: int) -> float:
        works = [
            t.SampleWork("s", p, samples, tokens, 1.0, -1, 1.0, SEED, (), ())
            for p in prompts[:count]
        ]
        start = time.perf_counter()
        backend.sample(works)
        return time.perf_counter() - start

    return runtime, call, prompts


def steps(rounds: int, new: int, dtype: torch.dtype) -> None:
    runtime, call, _ = _sampler(dtype)

    def side(native: bool, count: int, samples: int) -> float:
        os.environ["TUNELOOP_NATIVE_LINEAR"] = "1" if native else "0"
        runtime.bank.release_lone()  # the lone copy made again in this side's layout
        call(2, count, samples)
        return (call(new, count, samples) - call(2, count, samples)) / (new - 2)

    print("rows | native ms a step | oneDNN ms a step | oneDNN / native")
    for count, samples in ((1, 1), (1, 4), (8, 4), (32, 4)):
        a, b = [], []
        for _ in range(rounds):
            a.append(side(True, count, samples))
            b.append(side(False, count, samples))
        na, nb = statistics.median(a), statistics.median(b)
        rows = count * samples
        print(f"{rows:4d} | {na * 1e3:8.2f} | {nb * 1e3:8.2f} | {nb / na:.2f}x", flush=True)
    os.environ.pop("TUNELOOP_NATIVE_LINEAR", None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=34, help="new tokens per timed call")
    parser.add_argument("--part", choices=["linears", "steps", "spans", "both"], default="both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tuneloop.server.engine import native, native_linear

    dtype = DTYPES[args.dtype]
    flags = "amx" if "amx_bf16" in native.cpu_flags() else "no amx"
    print(f"cpu: {cpu_model()} ({flags})  threads {args.threads}  load {os.getloadavg()}")
    if dtype == torch.float32:
        if native_linear.fp32_kernel() is None:
            print("the fp32 native linear kernel is not built on this CPU (it needs AVX2, FMA)")
            return 1
        tiles = "AVX-512" if "avx512f" in native.cpu_flags() else "AVX2"
        print(f"fp32 native kernel (linear_fp32.cpp, {tiles} tiles)")
    else:
        form = "the AMX tile unit" if native_linear.tiles(True) else "AVX-512 loops"
        print(f"native kernel on {form}")
        if native_linear.native_kernel() is None:
            print("the native linear kernel is not built on this CPU (it needs AVX512-BF16)")
            return 1
    if args.part == "spans":
        if dtype != torch.bfloat16:
            print("--part spans measures the bf16 kernel (fp32 copies merge their adapter)")
            return 1
        spans(args.rounds)
        span_steps(args.rounds, args.new)
    if args.part in ("linears", "both"):
        linears(args.rounds, dtype)
    if args.part in ("steps", "both"):
        steps(args.rounds, args.new, dtype)
    print("load:", os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
