"""Model packages and checkpoint TTLs through the unmodified official `tinker` SDK."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.compat.runner import run_official
from tuneloop._local_server import live_server

pytest.importorskip("tinker")
pytestmark = [pytest.mark.compat, pytest.mark.integration]


def test_official_sdk_lists_packages_and_sets_ttls(tmp_path: Path) -> None:
    model = "tuneloop/fake-tiny"
    with live_server(tmp_path, backend="fake", models=(model,)) as live:
        done = run_official("official_packages", live.url, live.key, model)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "official SDK packages flow: OK" in done.stdout
