"""Sharded weights (FSDP2) vs. replicated workers vs. one process, on the CPU.

Engine level, in one run, rounds alternating between the settings so that machine noise hits
all of them:
  1. one process (`TorchBackend`, torch on every core),
  2. 2 replicated workers (`--workers 2`: each a whole model, the batch split by tokens, the
     LoRA gradients all-reduced; sampling requests split between them),
  3. 2 sharded workers (`--workers 2 --shard-weights fsdp`: each holds half of the base
     weights, every rank runs the whole batch and all-gathers each layer as it runs it).
Each round: one forward_backward + optim_step of ROWS x TOKENS tokens on one LoRA adapter, then
one sampling batch (SAMPLES requests, PROMPT tokens of prompt, NEW tokens each, seeded).
Reported: training and sampling tokens/s (median over rounds), per-rank memory (base weights
measured from the parameters' storages, and each worker process's resident set), and the
communication per step, counted by wrapping torch.distributed's collectives inside each worker
of a sharded group (bytes each rank receives: (N-1)/N of what an all-gather produces).

    PYTHONPATH=src python bench/sharded.py [--model NAME] [--rows 4] [--tokens 128] \
        [--samples 4] [--new 32] [--rounds 3] [--dtype bfloat16|float32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from workers_scaling import DEFAULT, batch, cpu_model  # a sibling: a script's folder is on sys.path
from workers_scaling import step as train_step

MIB = 2**20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def samples(n: int, prompt: int, new: int, vocab: int, seed: int) -> list[Any]:
    from tuneloop.server.engine.types import SampleWork

    rng = np.random.default_rng(seed)
    return [
        SampleWork(
            "bench-s",
            rng.integers(0, vocab, prompt).astype(np.int64),
            1,
            new,
            1.0,
            -1,
            1.0,
            i,
            (),
            (),
        )
        for i in range(n)
    ]


def sample_step(backend: Any, works: list[Any]) -> tuple[float, int]:
    from tuneloop.server.engine.types import EngineError

    start = time.perf_counter()
    results = backend.sample(works)
    elapsed = time.perf_counter() - start
    for r in results:
        if isinstance(r, EngineError):
            raise r
    return elapsed, sum(len(s.tokens) for r in results for s in r.sequences)


def _counted_collectives() -> dict[str, int]:
    """Wrap torch.distributed's collectives in this process; the dict counts bytes produced
    (all-gathers: the gathered output; all-reduces: the reduced tensor)."""
    import torch.distributed as dist

    counts = {"all_gather": 0, "all_reduce": 0, "calls": 0}

    def wrap(name: str, key: str, output_arg: int) -> None:
        original = getattr(dist, name, None)
        if original is None:
            return

        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[output_arg] if len(args) > output_arg else None
            if tensor is not None and hasattr(tensor, "numel"):
                counts[key] += tensor.numel() * tensor.element_size()
            counts["calls"] += 1
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    wrap("all_gather_into_tensor", "all_gather", 0)
    wrap("all_gather_single", "all_gather", 0)
    wrap("all_reduce", "all_reduce", 0)
    return counts


def _comm_rank(
    rank: int, size: int, port: int, model: str, cache: str, out: str, dtype: str
) -> None:
    """One rank of a bare sharded model: collectives counted over one training step (forward,
    backward, optim step) and one decode step of the benchmark's shapes."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tuneloop.server.engine.parallel.fsdp import shard_model
    from tuneloop.server.engine.torch_backend import TorchBackend
    from tuneloop.server.engine.types import AdapterSpec

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    named = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    backend = TorchBackend([model], cache_dir=Path(cache), device="cpu", dtype=named[dtype])
    info = shard_model(backend.resident_models()[model], init_device_mesh("cpu", (size,)))
    backend.create_adapter(AdapterSpec("bench", model, 16, 0))
    vocab = backend.models()[0].vocab_size
    counts = _counted_collectives()
    train_step(backend, batch(1, 64, vocab, 0))
    training = dict(counts)
    counts.update(dict.fromkeys(counts, 0))
    backend.create_sampler("bench-s", model, adapter_id="bench")
    sample_step(backend, samples(1, 8, 1, vocab, 0))  # one prefill step with its first token
    one = dict(counts)
    counts.update(dict.fromkeys(counts, 0))
    sample_step(backend, samples(1, 8, 2, vocab, 0))  # the same plus one decode step
    decode = {k: counts[k] - one[k] for k in counts}
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "training_step": training,
                    "decode_step": decode,
                    "sharded_bytes": info.total_bytes - info.replicated_bytes,
                    "replicated_bytes": info.replicated_bytes,
                }
            )
        )
    dist.destroy_process_group()


def communication(model: str, cache: Path, dtype: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from tuneloop.server.engine.workers.placement import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "comm.json")
        mp.spawn(_comm_rank, args=(2, free_port(), model, str(cache), out, dtype), nprocs=2)
        result: dict[str, Any] = json.loads(Path(out).read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "tuneloop")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch

    from tuneloop.server.engine.models import default_dtype

    # One dtype for every setting: the default is a timed probe that each process runs for
    # itself, and on a busy machine they can disagree (seen: fp32 in two settings, bf16 in one).
    if args.dtype is None:
        chosen = default_dtype(args.model, torch.device("cpu"))
        args.dtype = "bfloat16" if chosen == torch.bfloat16 else "float32"
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]

    from tuneloop.server.engine.parallel.fsdp import local_bytes
    from tuneloop.server.engine.torch_backend import TorchBackend
    from tuneloop.server.engine.types import AdapterSpec
    from tuneloop.server.engine.workers.build import worker_group

    print(f"CPU: {cpu_model()}; cores: {len(os.sched_getaffinity(0))}; load: {os.getloadavg()}")
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    spec = AdapterSpec("bench", args.model, 16, 0)
    report: dict[str, Any] = {"cpu": cpu_model(), "args": vars(args) | {"cache_dir": None}}
    with tempfile.TemporaryDirectory() as state:
        sides: dict[str, Any] = {
            "one process": TorchBackend(
                [args.model], cache_dir=args.cache_dir, device="cpu", dtype=dtype
            )
        }
        for name, mode in (("2 replicated", "none"), ("2 sharded", "fsdp")):
            sides[name] = worker_group(
                (args.model,),
                workers=2,
                cache_dir=args.cache_dir,
                device="cpu",
                dtype=args.dtype,
                state_dir=Path(state) / mode,
                shard_weights=mode,
            )
        vocab = sides["one process"].models()[0].vocab_size
        for backend in sides.values():
            backend.create_adapter(spec)
            train_step(backend, batch(args.rows, args.tokens, vocab, 0))  # warm-up
            backend.create_sampler("bench-s", args.model, adapter_id="bench")
        train_s: dict[str, list[float]] = {k: [] for k in sides}
        sample_rate: dict[str, list[float]] = {k: [] for k in sides}
        for round_ in range(args.rounds):
            work = batch(args.rows, args.tokens, vocab, round_ + 1)
            works = samples(args.samples, args.prompt, args.new, vocab, round_)
            for name, backend in sides.items():
                train_s[name].append(train_step(backend, work))
                elapsed, tokens = sample_step(backend, works)
                sample_rate[name].append(tokens / elapsed)
            print(f"round {round_}: load {os.getloadavg()}", flush=True)
        model = sides["one process"].resident_models()[args.model]
        whole = local_bytes(model)
        memory = {
            "one process": {"weights": [whole], "rss": [rss(os.getpid())]},
            "2 replicated": {
                "weights": [whole, whole],
                "rss": [rss(p) for p in sides["2 replicated"].worker_pids()],
            },
            "2 sharded": {
                "weights": [
                    r["models"][args.model]["weights"] for r in sides["2 sharded"].memory()
                ],
                "rss": [rss(p) for p in sides["2 sharded"].worker_pids()],
            },
        }
        for backend in sides.values():
            backend.close()
    tokens = args.rows * args.tokens
    print(f"\n{args.model}, dtype {next(model.parameters()).dtype}, load now {os.getloadavg()}")
    print("| setting | train tokens/s | sample tokens/s | base weights per rank | RSS per rank |")
    print("|---|---|---|---|---|")
    rows = {}
    for name in sides:
        train = tokens / statistics.median(train_s[name])
        sample = statistics.median(sample_rate[name])
        weights = ", ".join(f"{w / MIB:.0f}" for w in memory[name]["weights"])
        resident = ", ".join(f"{r / MIB:.0f}" for r in memory[name]["rss"])
        print(f"| {name} | {train:.1f} | {sample:.1f} | {weights} MiB | {resident} MiB |")
        rows[name] = {"train_tokens_s": train, "sample_tokens_s": sample, **memory[name]}
    report["results"] = rows
    comm = communication(args.model, args.cache_dir, args.dtype)
    report["communication"] = comm
    print(
        f"\nsharded communication per rank (2 ranks): training step (1 x 64 tokens) "
        f"all-gathers {comm['training_step']['all_gather'] / MIB:.0f} MiB in "
        f"{comm['training_step']['calls']} collectives; a decode step "
        f"{comm['decode_step']['all_gather'] / MIB:.0f} MiB in {comm['decode_step']['calls']}; "
        f"sharded weights {comm['sharded_bytes'] / MIB:.0f} MiB "
        f"(+{comm['replicated_bytes'] / MIB:.0f} MiB replicated)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
