"""Adapter downloads through the unmodified official `tinker` SDK and its CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.compat.runner import run_official
from tuneloop._local_server import live_server

pytest.importorskip("tinker")
pytestmark = [pytest.mark.compat, pytest.mark.integration]


def test_official_sdk_downloads_exports_and_training_checkpoints(tmp_path: Path) -> None:
    model = "tuneloop/fake-tiny"
    with live_server(tmp_path / "data", backend="fake", models=(model,)) as live:
        done = run_official("official_download", live.url, live.key, model, str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "official SDK download flow: OK" in done.stdout
