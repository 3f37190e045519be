"""The unmodified official `tinker` SDK drives a real tuneloop server through its whole flow."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tuneloop._local_server import LiveServer, live_server

pytest.importorskip("tinker")
pytestmark = [pytest.mark.compat, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("compat"))) as live:
        yield live


def test_full_flow_with_the_official_sdk(server: LiveServer) -> None:
    env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.compat.official_flow", server.url, server.key],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "official SDK flow: OK" in done.stdout
