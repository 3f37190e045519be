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


# The control plane with the NumPy stand-in, and the real torch engine with the tiny model.
BACKENDS = {"fake": "tuneloop/fake-tiny", "torch": "tuneloop/tiny-qwen3"}


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, str]]:
    backend = request.param
    model = BACKENDS[backend]
    with live_server(
        Path(tmp_path_factory.mktemp(backend)), backend=backend, models=(model,)
    ) as live:
        yield live, model


def test_full_flow_with_the_official_sdk(server: tuple[LiveServer, str]) -> None:
    live, model = server
    env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.compat.official_flow", live.url, live.key, model],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "official SDK flow: OK" in done.stdout
