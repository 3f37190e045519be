"""Tenancy benchmark: N tenants training and sampling at once vs. 1 tenant, same total work.

A real `tuneloop serve --backend torch` (SmolLM2-135M-Instruct, fp32) and N tenants, each with
its own API key, session and LoRA adapter (rank 32, all linear layers), driven from N client
threads through our SDK. Per scenario the total work is fixed: a training step is 8 sequences
of 64-128 tokens in all, split evenly between the tenants (each submits its share concurrently);
a sampling round is 8 prompts x 32 new tokens in all. Reported: aggregate tokens/s of N tenants
over 1 tenant (the service batches several tenants' rows into one forward/backward and one
decode batch, so the target is >= 0.9x), and the server's resident memory added per tenant.

    python bench/tenancy.py [--tenants 1 4 8] [--steps 3] [--cache-dir ~/.cache/tuneloop]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import tuneloop
from tuneloop import AdamParams, Datum, ModelInput, SamplingParams
from tuneloop._local_server import create_key, live_server

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ROWS, PROMPTS, NEW_TOKENS = 8, 8, 32


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def make_rows(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [
        [int(t) for t in rng.integers(100, 40000, size=int(rng.integers(64, 129)))]
        for _ in range(count)
    ]


class Tenant:
    def __init__(self, url: str, key: str) -> None:
        self.service = tuneloop.ServiceClient(base_url=url, api_key=key)
        self.training = self.service.create_lora_training_client(MODEL, rank=32, seed=0)
        self.sampler = self.training.save_weights_and_get_sampling_client()

    def train(self, rows: list[list[int]]) -> int:
        data = [
            Datum(model_input=ModelInput.from_ints(r[:-1]), loss_fn_inputs={"target_tokens": r[1:]})
            for r in rows
        ]
        fwd = self.training.forward_backward(data, "cross_entropy")
        step = self.training.optim_step(AdamParams(learning_rate=1e-5))
        fwd.result()
        step.result()
        return sum(len(r) - 1 for r in rows)

    def sample(self, prompts: list[list[int]]) -> int:
        params = SamplingParams(max_tokens=NEW_TOKENS, stop=[], seed=0)
        futures = [self.sampler.sample(ModelInput.from_ints(p), 1, params) for p in prompts]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)


def run_round(tenants: list[Tenant], work: list[list[list[int]]], kind: str) -> tuple[int, float]:
    """Every tenant does its share at once; returns (tokens, seconds)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(tenants)) as pool:
        done = pool.map(lambda tw: getattr(tw[0], kind)(tw[1]), zip(tenants, work, strict=True))
        tokens = sum(done)
    return tokens, time.perf_counter() - start


def scenario(url: str, keys: list[str], pid: int, steps: int) -> dict[str, Any]:
    before = rss_mib(pid)
    tenants = [Tenant(url, key) for key in keys]
    added = (rss_mib(pid) - before) / len(tenants)
    n = len(tenants)
    train_tokens = train_seconds = 0.0
    for step in range(steps + 1):  # the first step warms up
        rows = make_rows(ROWS, seed=step)
        tokens, seconds = run_round(tenants, [rows[i::n] for i in range(n)], "train")
        if step:
            train_tokens, train_seconds = train_tokens + tokens, train_seconds + seconds
    prompts = [r[:24] for r in make_rows(PROMPTS, seed=99)]
    # Warm up with the timed round's own shape: the engine learns that clients send concurrently.
    run_round(tenants, [prompts[i::n] for i in range(n)], "sample")
    sample_tokens, sample_seconds = run_round(tenants, [prompts[i::n] for i in range(n)], "sample")
    for tenant in tenants:
        tenant.service.close()
    return {
        "tenants": n,
        "train_tok_per_s": round(train_tokens / train_seconds, 1),
        "sample_tok_per_s": round(sample_tokens / sample_seconds, 1),
        "rss_added_per_tenant_mib": round(added, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tenants", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/tuneloop"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = []
    with (
        tempfile.TemporaryDirectory() as data_dir,
        live_server(
            Path(data_dir),
            "--cache-dir",
            str(args.cache_dir.expanduser()),
            backend="torch",
            models=(MODEL,),
        ) as server,
    ):
        for n in args.tenants:
            keys = [create_key(server.data_dir, f"tenant{n}x{i}") for i in range(n)]
            results.append(scenario(server.url, keys, server.process.pid, args.steps))
            print(json.dumps(results[-1]), flush=True)
    base = results[0]
    for r in results:
        r["train_ratio_vs_1"] = round(r["train_tok_per_s"] / base["train_tok_per_s"], 2)
        r["sample_ratio_vs_1"] = round(r["sample_tok_per_s"] / base["sample_tok_per_s"], 2)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
