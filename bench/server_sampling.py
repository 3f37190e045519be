"""Sampling through the server alone, the official tinker SDK as the client, trees alternated.

The sampling half of bench/engine.py's server column (SmolLM2-135M, rank-32 LoRA snapshot,
32 prompts of 16-48 tokens from the offline corpus x 4 samples x 64 new tokens, all requests
in flight at once), without the training columns before it, so a change to the sampling path
can be measured against the tree before it in minutes: each `--tree` (a source folder, e.g.
a `git worktree`'s src) serves in its own server process, the trees take turns for
`--pairs` turns, each turn one warm-up call and `--rounds` timed calls. Prints the CPU model,
every call's tokens per second and each tree's median. With `--tenants N`, N training clients
each freeze a sampler of their own adapter and the prompts are dealt among them, all in flight
at once: decode steps of N keys (tenants sampling together).

    git worktree add /tmp/before <commit>
    python bench/server_sampling.py --tree /tmp/before/src --tree src --pairs 3 --rounds 3
    python bench/server_sampling.py --tree /tmp/before/src --tree src --tenants 2
    python bench/server_sampling.py --tree /tmp/before/src --tree src --prompt-tokens 100,200 \
        --new-tokens 384          # an RL-sized call: longer prompts, math_rl's max_tokens
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from engine import MODEL, SEED, TinkerColumn, corpus_text, cpu_model, drain, make_prompts

CHILD = "--child"


def _child(args: argparse.Namespace) -> None:
    """One tree's turn: a server from the tree on sys.path, a warm-up call, timed calls."""
    from transformers import AutoTokenizer

    from tuneloop._local_server import live_server
    from tuneloop.server.engine import models

    cache = Path(args.cache_dir).expanduser()
    folder = models._smollm2_folder(cache)
    _, text = corpus_text()
    stream = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    low, high = (int(n) for n in args.prompt_tokens.split(","))
    prompts = make_prompts(stream, args.prompts, low, high)
    with tempfile.TemporaryDirectory() as data:
        options = ("--cache-dir", str(cache), "--dtype", args.dtype, "--device", "cpu")
        with live_server(Path(data), *options, backend="torch", models=(MODEL,)) as server:
            tail: list[str] = []
            threading.Thread(target=drain, args=(server.process.stdout, tail), daemon=True).start()
            pid = server.process.pid
            clients = [
                TinkerColumn(server.url, server.key, pid, MODEL) for _ in range(args.tenants)
            ]
            for client in clients:
                client.freeze_sampler()
            _sample(clients, prompts, args.samples, 8)
            for _ in range(args.rounds):
                begin = time.perf_counter()
                tokens = _sample(clients, prompts, args.samples, args.new_tokens)
                print(f"RESULT {tokens / (time.perf_counter() - begin):.1f}", flush=True)


def _sample(clients: list[TinkerColumn], prompts: list[list[int]], n: int, new: int) -> int:
    """Prompt i through sampler i mod len(clients), every request in flight at once."""
    if len(clients) == 1:
        return clients[0].sample(prompts, n, new)
    futures = []
    for index, prompt in enumerate(prompts):
        client = clients[index % len(clients)]
        params = client.types.SamplingParams(max_tokens=new, stop=[], temperature=1.0, seed=SEED)
        model_input = client.types.ModelInput.from_ints(prompt)
        futures.append(client.sampler.sample(model_input, n, params))  # type: ignore[attr-defined]
    return sum(len(s.tokens) for f in futures for s in f.result().sequences)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="a source folder (src)")
    parser.add_argument("--pairs", type=int, default=2, help="turns of every tree")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls per turn")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument(
        "--tenants", type=int, default=1, help="LoRA samplers, the prompts dealt among them"
    )
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", default="16,48", help="prompt lengths: min,max")
    parser.add_argument("--cache-dir", default="~/.cache/tuneloop")
    parser.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return 0
    trees = [str(Path(t).resolve()) for t in args.tree] or [str(Path("src").resolve())]
    print(f"cpu: {cpu_model()}  {args.dtype}  load {os.getloadavg()}", flush=True)
    rates: dict[str, list[float]] = {tree: [] for tree in trees}
    forwarded = ["--rounds", str(args.rounds), "--dtype", args.dtype]
    forwarded += ["--prompts", str(args.prompts), "--samples", str(args.samples)]
    forwarded += ["--new-tokens", str(args.new_tokens), "--tenants", str(args.tenants)]
    forwarded += ["--cache-dir", args.cache_dir, "--prompt-tokens", args.prompt_tokens]
    for _ in range(args.pairs):
        for tree in trees:
            # the server is a child of the child: both import the tree through PYTHONPATH
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "2"}
            command = [sys.executable, __file__, CHILD, *forwarded]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            turn = [float(line.split()[1]) for line in out.stdout.splitlines() if "RESULT" in line]
            rates[tree].extend(turn)
            print(tree, "tok/s:", turn, f"load {os.getloadavg()[0]:.2f}", flush=True)
    for tree, values in rates.items():
        print(f"{tree}: median {statistics.median(values):.1f} tok/s over {len(values)} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
