"""Side-by-side benchmark columns, each measured in a process of its own.

A column is one engine tree (`src` put first on the path) and a worker flag of the calling
script; `run_column` runs the script again as that worker and returns the JSON object the
worker printed last. Running every measurement in a fresh process keeps one column's warm caches,
threads and allocator out of the next, and callers alternate columns round by round so that
machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "add_tree_options",
    "alternate",
    "answered_as_worker",
    "run_column",
    "stolen_seconds",
    "this_tree_src",
]

BENCH = Path(__file__).resolve().parent


def this_tree_src() -> str:
    """This checkout's `src/`."""
    return str(BENCH.parent / "src")


def stolen_seconds() -> float | None:
    """The CPU time the hypervisor gave other guests so far, summed over this guest's CPUs
    (/proc/stat's steal column), or None where it cannot be read. On a shared virtual
    machine it comes in bursts (0-30 % of a step's CPU time in one round of the same
    benchmark), so the two-tree scripts report each process's share beside its wall time."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run_column(script: Path | str, src: str, args: Sequence[str]) -> dict[str, Any]:
    """Run `script args` with `src` (and bench/, for the sibling scripts) first on the path;
    the last line it prints is the column's JSON result."""
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{BENCH}"}
    out = subprocess.run(
        [sys.executable, str(script), *args], env=env, check=True, capture_output=True, text=True
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def alternate(
    script: Path | str, before_src: Path, args: Sequence[str], rounds: int
) -> dict[str, list[dict[str, Any]]]:
    """`rounds` rounds of `script args` with `before_src` ("before") and then this tree's
    src ("after"), each in a process of its own: each side's results in round order."""
    sources = {"before": str(Path(before_src).resolve()), "after": this_tree_src()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sources}
    for _ in range(rounds):
        for name, src in sources.items():
            runs[name].append(run_column(script, src, args))
    return runs


def add_tree_options(parser: argparse.ArgumentParser, rounds: int = 3) -> None:
    """The options of a script comparing two trees: `--rounds`, `--before-src` (the other
    tree's src), `--json` (the report) and the hidden `--worker` that `run_column` passes."""
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--before-src", type=Path, required=True)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)


def answered_as_worker(args: Any, worker: Any) -> bool:
    """Where the script runs as a column's worker (`--worker`): `worker(args)` run and its
    JSON printed, the line `run_column` reads; False otherwise."""
    if not args.worker:
        return False
    print(json.dumps(worker(args)))
    return True
