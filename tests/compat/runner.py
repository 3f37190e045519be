"""Runs one of this package's official-SDK scripts against a live server, in a child process of
its own (the official SDK's global state and event loop stay out of the test process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_official(
    module: str, *args: str, timeout: float = 240, package: str = "tests.compat"
) -> subprocess.CompletedProcess[str]:
    """`python -m tests.compat.<module> ARGS...` from the repository root, telemetry off."""
    env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-m", f"{package}.{module}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
