"""What the scheduler's policy buys, measured side by side in one process, runs alternating.

1. Tenant round-robin (fake backend, no model): tenant A queues a flood of samples, then
   tenant B queues one. Reported: B's latency (submitted -> answered) and the time to drain
   A's flood, with sampling admitted round-robin by tenant (`fair`, as the queue is) and in
   plain arrival order (`fifo`, the obvious alternative: one FIFO for everyone).
2. A training step behind a long decode batch (torch engine, the built-in tiny Qwen3, CPU): a
   batch of samples of one sampler decodes `--new` tokens; a training step of an unrelated
   adapter (forward_backward of 4 x 64 tokens, then optim_step) arrives once it runs.
   Reported: the step's latency (until the optim_step is answered) and the batch's duration,
   with training work that touches nothing the batch reads run between its decode steps
   (`between`, as the scheduler does) and held until the batch ends (`after`: the scheduler
   with `train_between_steps` off, what a worker group does).

    python bench/scheduler_fairness.py [--flood 400] [--repeats 3] [--new 256] [--json out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from event_loop import cpu_model  # a sibling: a script's folder is on sys.path
from tuneloop.server.engine.operations import CreateAdapter, OptimStep
from tuneloop.server.engine.types import (
    AdamStep,
    AdapterSpec,
    Example,
    ForwardBackwardWork,
    SampleWork,
)
from tuneloop.server.scheduler.fair_queue import RoundRobin
from tuneloop.server.scheduler.futures import FutureTable, Outcome
from tuneloop.server.scheduler.loop import EngineLoop
from tuneloop.server.scheduler.queue import Operation, OperationQueue, kind_of

TINY = "tuneloop/tiny-qwen3"
STEP = AdamStep(1e-3, 0.9, 0.95, 1e-8, 0.0, 1.0)


def _finish(_result: Any) -> Outcome:
    return Outcome(b"{}", "application/json")


def _sample(sampler_id: str, max_tokens: int, seed: int, num_samples: int = 1) -> SampleWork:
    prompt = np.random.default_rng(seed).integers(0, 250, size=16).astype(np.int64)
    return SampleWork(sampler_id, prompt, num_samples, max_tokens, 1.0, -1, 1.0, seed, (), ())


async def _answered(futures: FutureTable, request_id: str) -> float:
    outcome = await futures.wait(request_id, "t", 600.0)
    if outcome is None or outcome.failed:
        raise RuntimeError(f"request {request_id} failed: {outcome}")
    return time.perf_counter()


async def fairness_once(fair: bool, flood: int) -> dict[str, float]:
    from tuneloop.server.engine.fake import FAKE_MODEL_NAME, FakeBackend

    backend = FakeBackend()
    backend.create_sampler("a", FAKE_MODEL_NAME)
    backend.create_sampler("b", FAKE_MODEL_NAME)
    queue, futures = OperationQueue(), FutureTable()
    if not fair:  # one key for every tenant: plain arrival order
        queue._samples = RoundRobin(lambda op: "")
    loop = EngineLoop(backend, queue, futures)
    started = time.perf_counter()
    flood_ids = []
    for i in range(flood):
        request_id = futures.create("t", "Sample")
        queue.submit_sample(
            Operation(request_id, "sample", _sample("a", 32, i), _finish, tenant="A")
        )
        flood_ids.append(request_id)
    lone = futures.create("t", "Sample")
    queue.submit_sample(Operation(lone, "sample", _sample("b", 32, 7), _finish, tenant="B"))
    loop.start()
    loop.notify("sample")
    lone_at = await _answered(futures, lone)
    drained_at = max([await _answered(futures, r) for r in flood_ids])
    await loop.stop()
    return {"lone_s": lone_at - started, "flood_s": drained_at - started}


async def training_once(between: bool, new: int, cache: Path) -> dict[str, float]:
    from tuneloop.server.engine.torch_backend import TorchBackend

    backend = TorchBackend([TINY], cache_dir=cache, device="cpu")
    backend.create_sampler("s", TINY)
    queue, futures = OperationQueue(), FutureTable()
    loop = EngineLoop(backend, queue, futures)
    # `after`: nothing runs mid-batch, and ready training keeps new samples out so it ends.
    loop.scheduler.train_between_steps = between
    batch = []
    for i in range(8):
        request_id = futures.create("t", "Sample")
        queue.submit_sample(Operation(request_id, "sample", _sample("s", new, i, 2), _finish))
        batch.append(request_id)
    loop.start()
    loop.notify("sample")
    started = time.perf_counter()
    for _ in range(10_000):  # bounded: the batch starts within milliseconds
        if loop.running is not None:
            break
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.05)
    ids = []
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 250, size=65).astype(np.int64) for _ in range(4)]
    ones = np.ones(64, np.float32)
    examples = tuple(Example(r[:-1], {"target_tokens": r[1:], "weights": ones}) for r in rows)
    step: list[Any] = [
        CreateAdapter(AdapterSpec("x", TINY, 8, 0)),
        ForwardBackwardWork("x", examples, "cross_entropy", {}, False),
        OptimStep("x", STEP),
    ]
    for seq_id, op in enumerate(step):
        request_id = futures.create("t", "op")
        queue.submit_training(
            Operation(request_id, kind_of(op), op, _finish, "x", seq_id, str(seq_id))
        )
        ids.append(request_id)
    arrived = time.perf_counter()
    loop.notify("single")
    stepped_at = await _answered(futures, ids[-1])
    batch_done = max([await _answered(futures, r) for r in batch])
    await loop.stop()
    return {"optim_s": stepped_at - arrived, "batch_s": batch_done - started}


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flood", type=int, default=400)
    parser.add_argument("--new", type=int, default=256, help="tokens the long batch decodes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    runs: dict[str, list[dict[str, float]]] = {"fair": [], "fifo": [], "between": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # the two sides alternate, so load hits both alike
            runs["fair"].append(asyncio.run(fairness_once(True, args.flood)))
            runs["fifo"].append(asyncio.run(fairness_once(False, args.flood)))
            runs["between"].append(asyncio.run(training_once(True, args.new, Path(tmp))))
            runs["after"].append(asyncio.run(training_once(False, args.new, Path(tmp))))
    report = {
        "cpu": cpu_model(),
        "load_average": os.getloadavg(),
        "flood": args.flood,
        "new_tokens": args.new,
        "lone_sample_s": {k: _median(runs[k], "lone_s") for k in ("fair", "fifo")},
        "flood_drain_s": {k: _median(runs[k], "flood_s") for k in ("fair", "fifo")},
        "training_step_s": {k: _median(runs[k], "optim_s") for k in ("between", "after")},
        "decode_batch_s": {k: _median(runs[k], "batch_s") for k in ("between", "after")},
    }
    report["lone_sample_ratio_fifo_over_fair"] = (
        report["lone_sample_s"]["fifo"] / report["lone_sample_s"]["fair"]
    )
    report["training_step_ratio_after_over_between"] = (
        report["training_step_s"]["after"] / report["training_step_s"]["between"]
    )
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
