"""Model packages and checkpoint TTLs through the unmodified official `tinker` SDK."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tuneloop._local_server import live_server

pytest.importorskip("tinker")
pytestmark = [pytest.mark.compat, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[2]


def test_official_sdk_lists_packages_and_sets_ttls(tmp_path: Path) -> None:
    model = "tuneloop/fake-tiny"
    with live_server(tmp_path, backend="fake", models=(model,)) as live:
        env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
        done = subprocess.run(
            [sys.executable, "-m", "tests.compat.official_packages", live.url, live.key, model],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "official SDK packages flow: OK" in done.stdout
