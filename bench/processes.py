"""Variants measured in fresh processes, alternated round by round.

For what a process keeps once set (torch's OpenMP pools, its allocator's pages): each variant
runs as `python SCRIPT --child VARIANT ARGS...` in a new process, which prints one JSON value on
its last line of output; the rounds alternate the variants so that machine noise hits all alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def alternate_in_processes(
    script: str,
    variants: Sequence[str],
    rounds: int,
    threads: int,
    args: Sequence[str],
    show: Callable[[Any], Any] = lambda value: value,
) -> dict[str, list[Any]]:
    """Per variant, the JSON value each of its `rounds` processes printed (`show` formats the
    line printed after each)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    results: dict[str, list[Any]] = {variant: [] for variant in variants}
    for _ in range(rounds):
        for variant in variants:
            command = [sys.executable, str(Path(script).resolve()), "--child", variant]
            command += [*args, "--threads", str(threads)]
            out = subprocess.run(
                command, env=env, cwd=HERE, check=True, capture_output=True, text=True
            )
            value = json.loads(out.stdout.strip().splitlines()[-1])
            results[variant].append(value)
            print(f"{variant:5s} {show(value)}  load {os.getloadavg()[0]:.2f}", flush=True)
    return results
