"""A training step's host time: a deep, narrow random Qwen3 whose kernels cost next to nothing.

On a GPU a training step of a large model can be bound by the host issuing its kernels (the
H200 runs in docs/benchmarks.md: a Qwen3-8B step's wall twice its device time). What the host
does per layer is measurable on a CPU: a Qwen3 of `--layers` layers 64 wide (2 heads of 32, one
key head, MLP 128, vocabulary 1024; built in code, random weights), a rank-32 LoRA on every
linear layer and the head, a batch of `--sequences` sequences of `--lengths` tokens; its
forward_backward and optim_step take the time of the Python, the dispatch and the autograd
bookkeeping, with each kernel a few microseconds, as a GPU's launches are. Per layer: the
difference between `--layers` and 2 layers over the layers between. `--dtype float32` (the
default) runs the paths a GPU runs (SDPA attention, torch's matmuls); bfloat16 the CPU's half
precision paths. Each measurement in its own process with one tree's `src/` first on the path
(`--before-src`; the other is this tree), rounds alternating; medians and their ratio.
Besides the times, the aten calls of one more forward_backward, counted by a dispatch mode (the
same difference per layer): a count that this host's noise does not move, for changes whose
effect on the times is within it.

    python bench/train_host.py --before-src /tmp/before/src [--rounds 3]
    python bench/train_host.py --before-src /tmp/before/src --sequences 128 --lengths 8:16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# siblings: a script's folder is on sys.path
from columns import add_tree_options, alternate, answered_as_worker
from engine import BETAS, EPS, LR, RANDOM_INIT, SEED, build_random_model, cross_entropy_pass
from shared_prefix import cpu_model

NARROW = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 1024,
    "tie_word_embeddings": False,
}


class _Counted(TorchDispatchMode):
    """Counts the aten calls made inside it, the backward pass's included."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def worker(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.torch_backend import TorchBackend

    dtype = getattr(torch, args.dtype)
    low, high = (int(x) for x in args.lengths.split(":"))
    rng = np.random.default_rng(SEED)
    rows = [
        [int(v) for v in rng.integers(0, 1000, int(rng.integers(low, high + 1)))]
        for _ in range(args.sequences)
    ]
    step = t.AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.0, 0.0)
    result: dict[str, float] = {}
    for layers in (2, args.layers):
        RANDOM_INIT["narrow"] = {**NARROW, "num_hidden_layers": layers}
        scratch = Path(tempfile.mkdtemp())
        try:
            folder = scratch / "narrow"
            folder.mkdir()
            build_random_model("narrow", folder, dtype, "cpu")
            backend = TorchBackend([str(folder)], cache_dir=scratch, device="cpu", dtype=dtype)
            backend.create_adapter(t.AdapterSpec("a", str(folder), rank=32, seed=SEED))
            passes, steps = [], []
            for i in range(args.steps + 2):  # the first two untimed: kernels made, buffers grown
                start = time.perf_counter()
                cross_entropy_pass(backend, rows)
                middle = time.perf_counter()
                backend.optim_step("a", step)
                end = time.perf_counter()
                if i >= 2:
                    passes.append(middle - start)
                    steps.append(end - middle)
            result[f"forward_backward_{layers}"] = statistics.median(passes)
            result[f"optim_step_{layers}"] = statistics.median(steps)
            with _Counted() as counted:
                cross_entropy_pass(backend, rows)
            result[f"aten_calls_{layers}"] = counted.calls
            backend.optim_step("a", step)
            del backend
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    between = args.layers - 2
    for name in ("forward_backward", "optim_step", "aten_calls"):
        result[f"{name}_per_layer"] = (
            result[f"{name}_{args.layers}"] - result[f"{name}_2"]
        ) / between
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=36, help="Qwen3-8B's 36 by default")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--lengths", default="8:16", help="min:max tokens a sequence")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    parser.add_argument("--dtype", default="float32", help="the weights' dtype, both trees")
    add_tree_options(parser)
    args = parser.parse_args()
    if args.layers <= 2:
        parser.error("--layers must be more than 2 (the difference with 2 layers is measured)")
    if answered_as_worker(args, worker):
        return 0
    passed = [
        f"--{k}={getattr(args, k)}"
        for k in ("threads", "layers", "sequences", "lengths", "steps", "dtype")
    ] + [f"--before-src={args.before_src}", "--worker"]
    print(f"cpu: {cpu_model()}  {args.dtype}  threads {args.threads}  load {os.getloadavg()}")
    runs = alternate(Path(__file__), args.before_src, passed, args.rounds)
    keys = list(runs["after"][0])
    medians = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in runs.items()}
    for key in keys:
        before, after = medians["before"][key], medians["after"][key]
        if key.startswith("aten_calls"):
            print(
                f"{key}: before {before:.1f}, after {after:.1f}, "
                f"before / after {before / after:.2f}x"
            )
            continue
        print(
            f"{key}: before {before * 1e3:.2f} ms, after {after * 1e3:.2f} ms, "
            f"before / after {before / after:.2f}x"
        )
    print(f"load: {os.getloadavg()}")
    if args.json:
        report = {"cpu": cpu_model(), "config": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps(report | {"medians": medians, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
