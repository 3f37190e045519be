"""The bf16 decode linear kernel of two engine trees side by side, in one process.

Builds `linear_avx512.cpp` from this tree and from `--before-src` (another checkout's `src/`)
for this CPU (engine/native.py's build, each source with the headers beside it), packs random
weights of SmolLM2-135M's decode step with a lone adapter's rank-32 LoRA columns (lora/fused.py:
q/k/v 576 + 96 inputs, o 576 + 32, gate/up 576 + 64, down 1,536 + 32, 30 layers of each, and
the LM head 576 + 32 by 49,152) in the kernel's blocks layout, and times the step's 121 calls
at `--rows` rows on `--threads` threads, the two libraries alternating call set by call set
(which goes first alternating too). Both must give the same bits. Prints the CPU model, each
side's median ms and TFLOP/s (and the fraction of `--peak-json`'s bf16 peak, from
bench/machine_peak.py) and the ratio before / after. Needs AVX512-BF16.

    python bench/linear_ab.py --before-src /tmp/before/src [--rows 1,8,32,128] [--rounds 20]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine import cpu_model
from tuneloop.server.engine import native, native_linear

SOURCE = "tuneloop/server/engine/linear_avx512.cpp"
LAYER = [(576 + 96, 960), (576 + 32, 576), (576 + 64, 3072), (1536 + 32, 576)]
SHAPES = LAYER * 30 + [(576 + 32, 49152)]  # (inputs, outputs) of each call


def kernel(src: Path) -> Any:
    """`src`'s linear_bf16, built for this CPU, with the engine's signature for it."""
    fn = native.function(
        (src / SOURCE).resolve(),
        "linear_bf16",
        native_linear._SIGNATURE,
        ctypes.c_int,
        native_linear._NEEDS,
    )
    if fn is None:
        raise SystemExit(f"{src / SOURCE} could not be built here (AVX512-BF16 needed)")
    return fn


def calls(fn: Any, x: torch.Tensor, y: torch.Tensor, weights: dict, threads: int) -> None:
    """The step's 121 calls of `fn` on x's rows, each into y."""
    rows = x.shape[0]
    for k, n in SHAPES:
        code = fn(x.data_ptr(), x.shape[1], rows, k, weights[(k, n)].data_ptr(), None, n,
                  y.data_ptr(), n, threads, None)  # fmt: skip
        if code:
            raise RuntimeError(f"linear_bf16 refused [{rows}, {k}] x [{n}]: {code}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before-src", type=Path, required=True)
    parser.add_argument("--rows", default="1,8,32,128")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peak-json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    here = Path(__file__).resolve().parents[1] / "src"
    sides = {"before": kernel(args.before_src), "after": kernel(here)}
    peak = None
    if args.peak_json is not None:
        peak = float(json.loads(args.peak_json.read_text())["matmul_tflops"]["bfloat16"])
    gen = torch.Generator().manual_seed(0)
    weights = {
        s: torch.randn(((s[1] + 63) // 64, (s[0] + 1) // 2, 64, 2), generator=gen).bfloat16()
        for s in set(SHAPES)
    }
    print(f"cpu: {cpu_model()}  threads {args.threads}  peak bf16 {peak} TFLOP/s")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn((rows, 1568), generator=gen).bfloat16()
        ys = {n: torch.empty((rows, 49152), dtype=torch.bfloat16) for n in sides}
        times: dict[str, list[float]] = {n: [] for n in sides}
        for i in range(args.rounds + 1):
            for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
                begin = time.perf_counter()
                calls(sides[name], x, ys[name], weights, args.threads)
                if i:  # the first round warms both up
                    times[name].append(time.perf_counter() - begin)
        # the last call of each side wrote the head's outputs over its whole buffer
        if not torch.equal(ys["before"], ys["after"]):
            raise SystemExit("the two kernels' outputs differ")
        flops = sum(2 * rows * k * n for k, n in SHAPES)
        line = f"rows {rows:4d}"
        for name in sides:
            ms = statistics.median(times[name]) * 1e3
            rate = flops / ms / 1e9
            line += f"  {name} {ms:7.2f} ms {rate:.3f} TFLOP/s"
            if peak:
                line += f" ({rate / peak:.0%} of peak)"
        ratio = statistics.median(times["before"]) / statistics.median(times["after"])
        print(f"{line}  before/after {ratio:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
