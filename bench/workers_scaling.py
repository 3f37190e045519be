"""Worker groups on the CPU: 2 data-parallel workers vs. 1 process, and recovery after a kill.

Engine level, in one run, side by side (rounds alternate between the settings so that machine
noise hits all): the same fixed global batch (ROWS sequences of TOKENS tokens, one LoRA adapter) as
forward_backward + optim_step through
  1. the single-process `TorchBackend` with torch using every core,
  1b. the same process with one torch thread (on a shared machine, idle-spinning OpenMP threads
      of a process using every core can be far slower than one thread: the control), and
  2. a `WorkerGroupBackend` of 2 local worker processes (gloo), each with cores // 2 threads,
     the batch sharded by tokens and the LoRA gradients all-reduced.
Reported: training tokens/s of each and the ratio of the group to the faster single setting.
Then recovery: a worker SIGKILLed while a forward_backward call is running; timed from the kill
to the death being seen (detect), to the group being whole again with the adapter restored and
its gradients replayed (restored), and to the interrupted call's answer (answered).

Sampling on the same 2-worker group (with --sample-requests N, default 0: skipped): N seeded
requests (prompts of 16-48 tokens, 8-64 new tokens each, run to max_tokens) arriving one every
--sample-gap-ms, served (rounds alternating) with continuous batching (`sample_continuous`:
each rank decodes its share, arrivals join at once) and as before it, whole batches in turn
(`continuous.sample_in_batches`: arrivals wait for the running batch). Reported: sampled
tokens/s over the whole run, mean and p90 latency from arrival to answer, and the ratios.
--skip-training runs the sampling part alone.

    python bench/workers_scaling.py [--model NAME] [--rows 8] [--tokens 256] [--rounds 3]
        [--sample-requests 32] [--sample-gap-ms 50] [--skip-training]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT = "HuggingFaceTB/SmolLM2-135M-Instruct"


def batch(rows: int, tokens: int, vocab: int, seed: int) -> list[Any]:
    from tuneloop.server.engine.types import Example, ForwardBackwardWork

    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(rows):
        sequence = rng.integers(0, vocab, tokens + 1).astype(np.int64)
        examples.append(
            Example(
                sequence[:-1],
                {"target_tokens": sequence[1:], "weights": np.ones(tokens, np.float32)},
            )
        )
    return [ForwardBackwardWork("bench", tuple(examples), "cross_entropy", {}, False)]


def step(backend: Any, work: list[Any]) -> float:
    from tuneloop.server.engine.types import AdamStep, EngineError

    start = time.perf_counter()
    [result] = backend.forward_backward(work)
    if isinstance(result, EngineError):
        raise result
    backend.optim_step("bench", AdamStep(1e-4, 0.9, 0.999, 1e-8, 0.0, 1.0))
    return time.perf_counter() - start


def cpu_model() -> str:
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def arrivals(requests: int, gap_s: float, vocab: int, seed: int) -> list[tuple[float, Any]]:
    from tuneloop.server.engine.types import SampleWork

    rng = np.random.default_rng(seed)
    out = []
    for i in range(requests):
        prompt = rng.integers(0, vocab, int(rng.integers(16, 49))).astype(np.int64)
        max_tokens = int(rng.integers(8, 65))
        work = SampleWork("bench-base", prompt, 1, max_tokens, 1.0, -1, 1.0, i, (), ())
        out.append((i * gap_s, work))
    return out


def serve_arrivals(group: Any, workload: list[tuple[float, Any]], continuous: bool) -> dict:
    """Serve requests as they arrive; continuous batching or whole batches in turn."""
    from tuneloop.server.engine.types import EngineError
    from tuneloop.server.engine.workers.continuous import sample_in_batches

    pending = list(workload)
    answered: dict[int, float] = {}
    tokens = 0
    start = time.monotonic()

    def admit() -> list[Any]:
        now = time.monotonic() - start
        out = []
        while pending and pending[0][0] <= now:
            out.append(pending.pop(0)[1])
        return out

    def deliver(work: Any, result: Any) -> None:
        nonlocal tokens
        if isinstance(result, EngineError):
            raise result
        answered[id(work)] = time.monotonic() - start
        tokens += sum(len(s.tokens) for s in result.sequences)

    while pending:
        time.sleep(max(0.0, pending[0][0] - (time.monotonic() - start)))
        first = admit()
        if continuous:
            group.sample_continuous(first, admit, deliver, frozenset)
        else:
            sample_in_batches(group.sample, first, admit, deliver, frozenset)
    wall = time.monotonic() - start
    latencies = [answered[id(w)] - at for at, w in workload]
    return {
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "latency_mean_s": float(np.mean(latencies)),
        "latency_p90_s": float(np.percentile(latencies, 90)),
    }


def sampling(group: Any, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    group.create_sampler("bench-base", args.model)
    serve_arrivals(group, arrivals(4, 0.0, vocab, 0), True)  # warm-up
    runs: dict[str, list[dict[str, float]]] = {"continuous": [], "whole_batches": []}
    for round_ in range(args.rounds):
        workload = arrivals(args.sample_requests, args.sample_gap_ms / 1000, vocab, round_ + 1)
        order = (
            ("continuous", "whole_batches") if round_ % 2 == 0 else ("whole_batches", "continuous")
        )
        for mode in order:
            runs[mode].append(serve_arrivals(group, workload, mode == "continuous"))
    median = {
        mode: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for mode, rs in runs.items()
    }
    return {
        "requests": args.sample_requests,
        "gap_ms": args.sample_gap_ms,
        "runs": {m: [{k: round(v, 3) for k, v in r.items()} for r in rs] for m, rs in runs.items()},
        "median": {m: {k: round(v, 3) for k, v in r.items()} for m, r in median.items()},
        "throughput_ratio_continuous_vs_whole": round(
            median["continuous"]["tokens_per_s"] / median["whole_batches"]["tokens_per_s"], 3
        ),
        "mean_latency_ratio_whole_vs_continuous": round(
            median["whole_batches"]["latency_mean_s"] / median["continuous"]["latency_mean_s"], 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "tuneloop")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sample-requests", type=int, default=0)
    parser.add_argument("--sample-gap-ms", type=float, default=50.0)
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args()
    print("cpu:", cpu_model(), "| load:", os.getloadavg(), flush=True)
    if args.skip_training:
        from tuneloop.server.engine.workers.build import worker_group

        with tempfile.TemporaryDirectory() as state:
            group = worker_group(
                (args.model,),
                workers=2,
                cache_dir=args.cache_dir,
                device="cpu",
                state_dir=Path(state),
            )
            vocab = group.models()[0].vocab_size
            report = {"model": args.model, "sampling": sampling(group, vocab, args)}
            group.close()
        report["load_after"] = list(os.getloadavg())
        print(json.dumps(report, indent=1))
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        return

    import torch

    from tuneloop.server.engine.torch_backend import TorchBackend
    from tuneloop.server.engine.types import AdapterSpec
    from tuneloop.server.engine.workers.build import worker_group

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    spec = AdapterSpec("bench", args.model, args.rank, 0)
    with tempfile.TemporaryDirectory() as state:
        started = time.perf_counter()
        single = TorchBackend([args.model], cache_dir=args.cache_dir, device="cpu")
        single_load_s = time.perf_counter() - started
        started = time.perf_counter()
        group = worker_group(
            (args.model,), workers=2, cache_dir=args.cache_dir, device="cpu", state_dir=Path(state)
        )
        group_start_s = time.perf_counter() - started
        vocab = single.models()[0].vocab_size
        for backend in (single, group):
            backend.create_adapter(spec)
            step(backend, batch(args.rows, args.tokens, vocab, 0))  # warm-up
        times: dict[str, list[float]] = {"single": [], "single_1_thread": [], "group": []}
        for round_ in range(args.rounds):
            work = batch(args.rows, args.tokens, vocab, round_ + 1)
            torch.set_num_threads(cores)
            times["single"].append(step(single, work))
            torch.set_num_threads(1)
            times["single_1_thread"].append(step(single, work))
            times["group"].append(step(group, work))
        single.close()
        tokens = args.rows * args.tokens
        rates = {k: tokens / float(np.median(v)) for k, v in times.items()}

        # Recovery: kill a worker while a call runs on the group.
        work = batch(args.rows, args.tokens, vocab, 99)
        answered: list[float] = []

        def call() -> None:
            group.forward_backward(work)
            answered.append(time.monotonic())

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.3)  # the call is under way (a step takes seconds on SmolLM2)
        in_flight = thread.is_alive()
        killed_at = time.monotonic()
        os.kill(group.worker_pids()[1], signal.SIGKILL)
        thread.join(timeout=600)
        deadline = time.monotonic() + 600
        while group.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # killed between calls: the watchdog restarts the group
        if not in_flight:
            call()  # the first request answered after the restart
        assert group.last_detected_at is not None
        assert group.last_restored_at is not None
        recovery = {
            "detect_s": group.last_detected_at - killed_at,
            "restore_s": group.last_restored_at - group.last_detected_at,
            "answer_s": answered[-1] - group.last_restored_at,
            "kill_to_answer_s": answered[-1] - killed_at,
        }
        sampled = sampling(group, vocab, args) if args.sample_requests else None
        group.close()
    report = {
        "model": args.model,
        "cores": cores,
        "global_batch": f"{args.rows} x {args.tokens} tokens",
        "single_load_s": round(single_load_s, 1),
        "group_start_s": round(group_start_s, 1),
        "step_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
        "ratio_2_workers_vs_1": round(
            rates["group"] / max(rates["single"], rates["single_1_thread"]), 3
        ),
        "recovery": {k: round(v, 2) for k, v in recovery.items()},
        "killed_during_a_call": in_flight,
        "sampling": sampled,
        "load_after": list(os.getloadavg()),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
