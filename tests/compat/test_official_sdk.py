"""The unmodified official `tinker` SDK drives a real tuneloop server through its whole flow."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compat.runner import run_official
from tuneloop._local_server import LiveServer, live_server

pytest.importorskip("tinker")
pytestmark = [pytest.mark.compat, pytest.mark.integration]


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
    done = run_official("official_flow", live.url, live.key, model, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "official SDK flow: OK" in done.stdout
