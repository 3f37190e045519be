"""The official SDK's server-side custom loss (one pass, same loss and gradients as its
client-side protocol, hostile graphs refused) and stable_reinforce (stability records,
provenance, field-named refusals) against a real server, on both engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.compat.runner import run_official
from tuneloop._local_server import live_server

pytest.importorskip("tinker")
pytestmark = [pytest.mark.compat, pytest.mark.integration]

BACKENDS = {"fake": "tuneloop/fake-tiny", "torch": "tuneloop/tiny-qwen3"}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_custom_and_stable_reinforce_losses(backend: str, tmp_path: Path) -> None:
    model = BACKENDS[backend]
    with live_server(tmp_path, backend=backend, models=(model,)) as live:
        done = run_official("official_losses", live.url, live.key, model, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "official SDK losses: OK" in done.stdout
