"""One decoder layer's seven adapted linears at a decode step's size, four ways (measured).

SmolLM2-135M's layer shapes (hidden 576, MLP 1536, k/v 192), rank-32 factors on every linear,
`--rows` rows (128: 32 prompts x 4 samples), one adapter over every row:
- "products": each base layer, then its delta added by `ops.add_lora` (shrink, then `addmm_`
  into the output), what a decode step of several keys runs;
- "fused": `lora/fused.py`, q/k/v and gate/up stacked, each group one packed matmul with the
  delta's up-projection in extra columns (the default for one key where the CPU packs);
- "merged": the same groups with the delta merged into the rows (`serve --merged-sampling`);
- "merged, one matmul a layer": merged weights packed layer by layer, no groups (how merged
  sampling ran before the groups).
Calls alternate round by round; per way the median of `--rounds` rounds of `--calls` calls, and
how much of the adapter's delta its outputs carry (`_kept`). The CPU model and
a quick measure of its peaks come first.

    python bench/fused_linears.py [--dtype bfloat16] [--rows 128] [--rounds 7] [--json out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from event_loop import cpu_model  # siblings: a script's folder is on sys.path
from machine_peak import measure as measure_peak
from tuneloop.server.engine import packed
from tuneloop.server.engine.lora import ops
from tuneloop.server.engine.lora.fused import FusedLinear

HIDDEN, MLP, KV, RANK = 576, 1536, 192, 32
# name -> (out, in); the groups as `sibling_groups` makes them for a Llama layer
SHAPES = {
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (KV, HIDDEN),
    "v_proj": (KV, HIDDEN),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (MLP, HIDDEN),
    "up_proj": (MLP, HIDDEN),
    "down_proj": (HIDDEN, MLP),
}
GROUPS = [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    peak = measure_peak("cpu", args.threads, quick=True)
    g = torch.Generator().manual_seed(0)
    layers: dict[str, nn.Linear] = {}
    factors: dict[str, ops.Factors] = {}
    for name, (out, inp) in SHAPES.items():
        layer = nn.Linear(inp, out, bias=False).to(dtype).requires_grad_(False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(out, inp, generator=g) * inp**-0.5)
        layers[name] = layer
        a = torch.randn(RANK, inp, generator=g) * inp**-0.5
        # A young adapter's delta: |B @ A| ~ 1e-3 |W| (SmolLM2-135M after 2 AdamW steps at lr
        # 1e-3: 0.13 % median, docs/benchmarks.md), below the bf16 weights' last bit.
        b = torch.randn(out, RANK, generator=g) * (1e-3 / RANK**0.5)
        factors[name] = (a.to(dtype), b.to(dtype), 1.0)
    inputs = {n: torch.randn(args.rows, SHAPES[n][1], generator=g).to(dtype) for n in SHAPES}
    for name in ("k_proj", "v_proj"):
        inputs[name] = inputs["q_proj"]  # siblings read the same tensor
    inputs["up_proj"] = inputs["gate_proj"]

    def products() -> None:
        for name, layer in layers.items():
            ops.add_lora(layer(inputs[name]), inputs[name], [args.rows], [factors[name]], {})

    def grouped(merge: bool) -> Callable[[], None]:
        built = [
            (
                FusedLinear.build(
                    [layers[n] for n in names], [factors[n] for n in names], merge=merge
                ),
                names,
            )
            for names in GROUPS
        ]

        def run() -> None:
            for group, names in built:
                for index, name in enumerate(names):
                    group.output(index, inputs[name])

        return run

    per_layer = {
        name: packed.pack(
            (factors[name][1].float() @ factors[name][0].float())
            .add_(layer.weight.float())
            .to(dtype)
        )
        for name, layer in layers.items()
    }

    def merged_layers() -> None:
        for name in layers:
            packed.linear(inputs[name], per_layer[name], None)

    ways: dict[str, Callable[[], None]] = {
        "products": products,
        "fused": grouped(False),
        "merged": grouped(True),
        "merged, one matmul a layer": merged_layers,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for fn in ways.values():
        for _ in range(5):
            fn()
    for _ in range(args.rounds):
        for name, fn in ways.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - start) / args.calls * 1e3)
    kept = _kept(layers, factors, inputs, ways)
    flops = 2 * args.rows * sum(o * i for o, i in SHAPES.values())
    report: dict[str, object] = {
        "cpu": cpu_model(),
        "peak": peak,
        "dtype": args.dtype,
        "rows": args.rows,
        "rank": RANK,
    }
    base = statistics.median(times["products"])
    print(f"{cpu_model()}; peak {peak['matmul_tflops']} TFLOP/s, read {peak['read_gb_per_s']} GB/s")
    for name in ways:
        ms = statistics.median(times[name])
        report[name] = {
            "ms_per_layer": ms,
            "x_products": base / ms,
            "base_tflops": flops / ms / 1e9,
            "delta_kept": kept[name],
        }
        print(
            f"{name:28s} {ms:7.3f} ms a layer  {base / ms:5.2f}x  "
            f"({flops / ms / 1e9:.3f} TFLOP/s of base products)  delta kept {kept[name]:.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _kept(
    layers: dict[str, nn.Linear],
    factors: dict[str, ops.Factors],
    inputs: dict[str, torch.Tensor],
    ways: dict[str, Callable[[], None]],
) -> dict[str, float]:
    """How much of the delta each way's q/k/v outputs (the first group) carry: the projection
    of (output - fp64's base product) on fp64's delta, over the delta's squared norm. 1: kept
    (the output's own rounding is noise across the delta); near 0: rounded away."""
    names = GROUPS[0]
    x = inputs[names[0]]
    bases = [x.double() @ layers[n].weight.double().t() for n in names]
    deltas = [(x.double() @ factors[n][0].double().t()) @ factors[n][1].double().t() for n in names]
    got: dict[str, list[torch.Tensor]] = {
        "products": [ops.add_lora(layers[n](x), x, [x.shape[0]], [factors[n]], {}) for n in names]
    }
    for label, merge in (("fused", False), ("merged", True)):
        group = FusedLinear.build(
            [layers[n] for n in names], [factors[n] for n in names], merge=merge
        )
        got[label] = [group.output(i, x) for i in range(len(names))]
    dtype = x.dtype
    got["merged, one matmul a layer"] = [
        packed.linear(
            x,
            (factors[n][1].float() @ factors[n][0].float())
            .add_(layers[n].weight.float())
            .to(dtype),
            None,
        )
        for n in names
    ]
    norm = sum(float((d * d).sum()) for d in deltas)
    return {
        label: sum(
            float(((o.double() - b) * d).sum()) for o, b, d in zip(outs, bases, deltas, strict=True)
        )
        / norm
        for label, outs in got.items()
        if label in ways
    }


if __name__ == "__main__":
    sys.exit(main())
