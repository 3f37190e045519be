"""A decode step's layers as the lean loop (engine/decode_layers.py) against the modules' forward.

In-process `TorchBackend`, SmolLM2-135M bf16, a rank-32 LoRA snapshot on every linear layer
and the head (bench/engine.py's adapter), 2 threads; needs a CPU where the loop runs
(AVX512-BF16). For each row count (prompts x samples), calls alternate between the loop and
the modules, one call each per round; a decode step's time is a call of `--new` tokens less a
call of 2, over the steps between. Prints the CPU model, the load, every round and the medians
with their ratio. Both forms give the same bits (tests/unit/engine/test_decode_layers.py).

    python bench/decode_loop.py [--rows 1x1,1x4,8x4,32x4] [--new 34] [--rounds 3]
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
    args = parser.parse_args()
    torch.set_num_threads(2)
    from tuneloop.server.engine import types as t

    backend = adapted_backend(DTYPES["bfloat16"])
    backend.create_sampler("s", MODEL, adapter_id="a")
    [runtime] = backend._runtimes.values()
    plan = runtime.layers_plan
    if plan is None:
        print("the lean loop does not run on this CPU (no AVX512-BF16 kernels)")
        return 1
    prompts = random_prompts()
    print(f"cpu: {cpu_model()}  bfloat16  threads 2  load {os.getloadavg()}", flush=True)

    def call(prompts_n: int, samples: int, new: int) -> float:
        works = [
            t.SampleWork("s", p, samples, new, 1.0, -1, 1.0, SEED, (), ())
            for p in prompts[:prompts_n]
        ]
        begin = time.perf_counter()
        backend.sample(works)
        return time.perf_counter() - begin

    def step_ms(lean: bool, prompts_n: int, samples: int) -> float:
        runtime.layers_plan = plan if lean else None
        runtime.decoder.runner.layers = runtime.layers_plan
        long, short = call(prompts_n, samples, args.new), call(prompts_n, samples, 2)
        return (long - short) / (args.new - 2) * 1e3

    call(2, 2, 4)  # the pool and the lone weights made
    for shape in args.rows.split(","):
        prompts_n, samples = (int(v) for v in shape.split("x"))
        times: dict[str, list[float]] = {"loop": [], "modules": []}
        for _ in range(args.rounds):
            for name in times:
                times[name].append(step_ms(name == "loop", prompts_n, samples))
            print(shape, {k: round(v[-1], 2) for k, v in times.items()}, flush=True)
        loop, modules = (statistics.median(times[k]) for k in ("loop", "modules"))
        print(
            f"{prompts_n * samples} rows: decode step {loop:.2f} ms (loop) against "
            f"{modules:.2f} ms (modules), {modules / loop:.2f}x",
            flush=True,
        )
    print("load:", os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
