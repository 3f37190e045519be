"""Control-plane benchmark: the cost of the service around the engine, with the fake backend.

Measured side by side in one run (machines are noisy; compare ratios):
  1. the same operations called directly on an in-process FakeBackend (the floor: no HTTP,
     no queue, no futures);
  2. our SDK against a real `tuneloop serve` on loopback;
  3. the official `tinker` SDK against the same server (when installed).
For each: submit+result round-trip latency p50/p99 of forward_backward and sample, futures
completed per second with many in flight, and 1,000 futures in flight from 16 client threads
with no timeout, checking that none is lost.

    python bench/control_plane.py [--rounds 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import tuneloop
from tuneloop import AdamParams, Datum, ModelInput, SamplingParams
from tuneloop._local_server import live_server

MODEL = "tuneloop/fake-tiny"
TOKENS = list(range(10, 74))  # a 64-token datum
PROMPT = list(range(10, 42))  # a 32-token prompt, 16 sampled tokens


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    return {
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3),
    }


def timed(fn: Callable[[], Any], rounds: int) -> dict[str, float]:
    fn()  # warm up
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return percentiles(samples)


def direct_backend(rounds: int) -> dict[str, Any]:
    from tuneloop.server.engine.fake import FakeBackend
    from tuneloop.server.engine.types import (
        AdapterSpec,
        Example,
        ForwardBackwardWork,
        SampleWork,
    )

    backend = FakeBackend()
    backend.create_adapter(AdapterSpec("a", MODEL, rank=8, seed=0))
    backend.create_sampler("s", MODEL)
    tokens = np.asarray(TOKENS[:-1])
    example = Example(tokens, {"target_tokens": np.asarray(TOKENS[1:])})
    work = ForwardBackwardWork("a", (example,), "cross_entropy", {}, False)
    sample = SampleWork("s", np.asarray(PROMPT), 1, 16, 1.0, -1, 1.0, 0, (), ())
    return {
        "forward_backward": timed(lambda: backend.forward_backward([work]), rounds),
        "sample": timed(lambda: backend.sample([sample]), rounds),
    }


def in_flight(submit: Callable[[int], Any], total: int, threads: int) -> dict[str, Any]:
    """`threads` client threads each submit their share without waiting, then wait for all."""
    done = [0] * threads
    lost: list[str] = []

    def worker(index: int) -> None:
        futures = [submit(i) for i in range(index, total, threads)]
        for future in futures:
            try:
                future.result()  # no timeout: every future must complete
                done[index] += 1
            except Exception as exc:
                lost.append(repr(exc))

    start = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    return {
        "submitted": total,
        "completed": sum(done),
        "lost": len(lost),
        "seconds": round(elapsed, 2),
        "futures_per_s": round(sum(done) / elapsed, 1),
        "errors": lost[:3],
    }


def our_sdk(url: str, key: str, rounds: int) -> dict[str, Any]:
    service = tuneloop.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(MODEL, rank=8, seed=0)
    datum = Datum(
        model_input=ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={"target_tokens": TOKENS[1:]}
    )
    sampler = service.create_sampling_client(base_model=MODEL)
    prompt = ModelInput.from_ints(PROMPT)
    params = SamplingParams(max_tokens=16, stop=[], seed=0)
    result = {
        "forward_backward": timed(
            lambda: training.forward_backward([datum], "cross_entropy").result(), rounds
        ),
        "optim_step": timed(
            lambda: training.optim_step(AdamParams(learning_rate=1e-4)).result(), rounds
        ),
        "sample": timed(lambda: sampler.sample(prompt, 1, params).result(), rounds),
        "in_flight_1000x16": in_flight(lambda _i: sampler.sample(prompt, 1, params), 1000, 16),
    }
    service.close()
    return result


def official_sdk(url: str, key: str, rounds: int) -> dict[str, Any] | None:
    try:
        import tinker
    except ImportError:
        return None
    os.environ["TINKER_TELEMETRY"] = "0"
    types = tinker.types
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:]},
    )
    sampler = service.create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=16, stop=[], seed=0)
    return {
        "forward_backward": timed(
            lambda: training.forward_backward([datum], "cross_entropy").result(), rounds
        ),
        "sample": timed(lambda: sampler.sample(prompt, 1, params).result(), rounds),
        "in_flight_1000x16": in_flight(lambda _i: sampler.sample(prompt, 1, params), 1000, 16),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report: dict[str, Any] = {"rounds": args.rounds, "cpus": os.cpu_count()}
    report["direct_backend"] = direct_backend(args.rounds)
    with tempfile.TemporaryDirectory() as data_dir, live_server(Path(data_dir)) as server:
        report["tuneloop_sdk"] = our_sdk(server.url, server.key, args.rounds)
        report["official_sdk"] = official_sdk(server.url, server.key, args.rounds)
    floor = report["direct_backend"]
    for client in ("tuneloop_sdk", "official_sdk"):
        if report[client]:
            report[client]["overhead_ratio_p50"] = {
                op: round(report[client][op]["p50_ms"] / floor[op]["p50_ms"], 1)
                for op in ("forward_backward", "sample")
            }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    ok = all(
        report[c] is None or report[c]["in_flight_1000x16"]["lost"] == 0
        for c in ("tuneloop_sdk", "official_sdk")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
