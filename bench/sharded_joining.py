"""A request joining a sharded group's running decode: continuous batching vs. whole batches.

On one 2-rank sharded group (`--workers 2 --shard-weights fsdp`, CPU, gloo) each round runs one
scenario both ways, the order alternating between rounds: a long request (LONG new tokens)
starts alone, and a short one (SHORT new tokens) arrives DELAY of the long one's own time later.
  - continuous: the group's `sample_continuous`, which takes the short one into the running
    decode at the next step (workers/sharded_session.py);
  - whole batches: `sample_in_batches` over the group's `sample`, how a sharded group sampled
    before: the short one waits for the long one to finish and runs as the next batch.
Reported, medians over the rounds: the short request's latency (arrival -> answer), the long
one's time, and the long one's time alone on each path (what asking the group at every decode
step costs); each worker's peak resident set (VmHWM).

    PYTHONPATH=src python bench/sharded_joining.py [--model NAME] [--long 48] [--short 4] \
        [--delay 0.25] [--rounds 3] [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from workers_scaling import DEFAULT, cpu_model  # a sibling: a script's folder is on sys.path

MIB = 2**20


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def request(new: int, prompt: int, vocab: int, seed: int) -> Any:
    from tuneloop.server.engine.types import SampleWork

    tokens = np.random.default_rng(seed).integers(0, vocab, prompt).astype(np.int64)
    return SampleWork("bench-s", tokens, 1, new, 1.0, -1, 1.0, seed, (), ())


def scenario(group: Any, continuous: bool, long: Any, short: Any, delay: float) -> dict[str, float]:
    """The short request's latency (its arrival -> its answer) and the long one's time from
    the start, in seconds."""
    from tuneloop.server.engine.types import EngineError
    from tuneloop.server.engine.workers.continuous import sample_in_batches

    start = time.perf_counter()
    arrival = start + delay
    answered: dict[int, float] = {}
    given: list[bool] = []

    def admit() -> list[Any]:
        if not given and time.perf_counter() >= arrival:
            given.append(True)
            return [short]
        return []

    def deliver(work: Any, result: Any) -> None:
        if isinstance(result, EngineError):
            raise result
        answered[id(work)] = time.perf_counter()

    def run(batch: list[Any]) -> None:
        if continuous:
            group.sample_continuous(batch, admit, deliver)
        else:
            sample_in_batches(group.sample, batch, admit, deliver, frozenset)

    run([long])
    if not given:  # the long one was done before the short one arrived
        time.sleep(max(0.0, arrival - time.perf_counter()))
        given.append(True)
        run([short])
    return {
        "joiner_latency": answered[id(short)] - arrival,
        "long": answered[id(long)] - start,
    }


def alone(group: Any, continuous: bool, work: Any) -> float:
    start = time.perf_counter()
    if continuous:
        group.sample_continuous([work], list, lambda w, r: None)
    else:
        group.sample([work])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--long", type=int, default=48)
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--delay", type=float, default=0.25, help="of the long one's own time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "tuneloop")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"])
    args = parser.parse_args()

    from tuneloop.server.engine.workers.build import worker_group

    print(f"CPU: {cpu_model()}; cores: {len(os.sched_getaffinity(0))}; load: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as state:
        group = worker_group(
            (args.model,),
            workers=2,
            cache_dir=args.cache_dir,
            device="cpu",
            dtype=args.dtype,
            state_dir=Path(state),
            shard_weights="fsdp",
        )
        try:
            vocab = group.models()[0].vocab_size
            group.create_sampler("bench-s", args.model)
            long = request(args.long, args.prompt, vocab, 1)
            [result] = group.sample([long])
            drawn = len(result.sequences[0].tokens)
            if drawn < args.long:
                raise SystemExit(f"the long request stopped at {drawn} tokens: change its seed")
            own = alone(group, True, long)  # also the warm-up of the continuous path
            times: dict[str, list[float]] = {}
            for round_ in range(args.rounds):
                short = request(args.short, args.prompt, vocab, 100 + round_)
                order = (True, False) if round_ % 2 == 0 else (False, True)
                for continuous in order:
                    name = "continuous" if continuous else "whole batches"
                    got = scenario(group, continuous, long, short, args.delay * own)
                    got["alone"] = alone(group, continuous, long)
                    for key, value in got.items():
                        times.setdefault(f"{name} {key}", []).append(value)
                print(f"round {round_}: load {os.getloadavg()}", flush=True)
            peaks = [peak_rss(pid) for pid in group.worker_pids()]
        finally:
            group.close()
    print(f"\n{args.model}, 2 sharded ranks, load now {os.getloadavg()}")
    print(f"long {args.long} new tokens, short {args.short}, arriving after {args.delay:.0%}")
    print("| path | short request's latency | long request | long request alone |")
    print("|---|---|---|---|")
    for name in ("continuous", "whole batches"):
        cells = [
            statistics.median(times[f"{name} {k}"]) for k in ("joiner_latency", "long", "alone")
        ]
        print(f"| {name} | " + " | ".join(f"{c:.2f} s" for c in cells) + " |")
    print("peak resident set per worker: " + ", ".join(f"{p / MIB:.0f} MiB" for p in peaks))


if __name__ == "__main__":
    main()
