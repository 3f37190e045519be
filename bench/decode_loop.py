"""A decode step's layers as the lean loop (engine/decode_layers.py) against the modules' forward.

In-process `TorchBackend`, SmolLM2-135M (bf16, or fp32 with `--dtype float32`), a rank-32 LoRA
snapshot on every linear layer and the head (bench/engine.py's adapter), 2 threads; needs a
CPU where the loop runs (bf16: AVX512-BF16; fp32: AVX2). For each row count (prompts x
samples), calls alternate between the loop and the other side, one call each per round, which
side goes first alternating by round; a decode step's time is a call of `--new` tokens less a
call of 2, over the steps between. `--against modules` (the default) compares the loop with
the modules' forward; `--against python-loop` the layers' one C++ call (native_layers.py)
with the loop's Python form (`TUNELOOP_NATIVE_LAYERS=0`). Prints the CPU model, the load,
every round and the medians with their ratio. Every form gives the same bits
(tests/unit/engine/test_decode_layers.py, test_decode_layers_fp32.py).

    python bench/decode_loop.py [--rows 1x1,1x4,8x4,32x4] [--new 34] [--rounds 3]
                                [--dtype bfloat16|float32] [--against modules|python-loop]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from engine import DTYPES, MODEL, SEED, adapted_backend, cpu_model, random_prompts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1x1,1x4,8x4,32x4", help="prompts x samples, ...")
    parser.add_argument("--new", type=int, default=34, help="new tokens per timed call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--against", choices=["modules", "python-loop"], default="modules")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from tuneloop.server.engine import types as t

    backend = adapted_backend(DTYPES[args.dtype])
    backend.create_sampler("s", MODEL, adapter_id="a")
    [runtime] = backend._runtimes.values()
    plan = runtime.layers_plan
    if plan is None:
        print(f"the lean loop does not run on this CPU (no {args.dtype} kernels)")
        return 1
    prompts = random_prompts()
    print(f"cpu: {cpu_model()}  {args.dtype}  threads 2  load {os.getloadavg()}", flush=True)
    other = args.against
    mine = "loop" if other == "modules" else "C++ call"

    def call(prompts_n: int, samples: int, new: int) -> float:
        works = [
            t.SampleWork("s", p, samples, new, 1.0, -1, 1.0, SEED, (), ())
            for p in prompts[:prompts_n]
        ]
        begin = time.perf_counter()
        backend.sample(works)
        return time.perf_counter() - begin

    def step_ms(lean: bool, prompts_n: int, samples: int) -> float:
        if other == "modules":
            runtime.layers_plan = plan if lean else None
            runtime.decoder.runner.layers = runtime.layers_plan
        else:  # the C++ call, or the loop's Python form
            os.environ["TUNELOOP_NATIVE_LAYERS"] = "1" if lean else "0"
        long, short = call(prompts_n, samples, args.new), call(prompts_n, samples, 2)
        return (long - short) / (args.new - 2) * 1e3

    call(2, 2, 4)  # the pool and the lone weights made
    for shape in args.rows.split(","):
        prompts_n, samples = (int(v) for v in shape.split("x"))
        times: dict[str, list[float]] = {mine: [], other: []}
        for i in range(args.rounds):
            for name in list(times)[:: 1 if i % 2 == 0 else -1]:
                times[name].append(step_ms(name == mine, prompts_n, samples))
            print(shape, {k: round(v[-1], 2) for k, v in times.items()}, flush=True)
        loop, against = (statistics.median(times[k]) for k in (mine, other))
        print(
            f"{prompts_n * samples} rows: decode step {loop:.2f} ms ({mine}) against "
            f"{against:.2f} ms ({other}), {against / loop:.2f}x",
            flush=True,
        )
    print("load:", os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
