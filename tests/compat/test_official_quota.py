"""Quotas through the unmodified official `tinker` SDK: its backoff succeeds once capacity frees."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.compat.runner import run_official
from tuneloop._local_server import live_server

pytest.importorskip("tinker")
pytestmark = [pytest.mark.compat, pytest.mark.integration]


@pytest.mark.slow
def test_official_sdk_retries_429s_until_capacity_frees(tmp_path: Path) -> None:
    model = "tuneloop/fake-tiny"
    with live_server(
        tmp_path, "--max-inflight", "1", "--max-sessions", "2", backend="fake", models=(model,)
    ) as live:
        done = run_official("official_quota", live.url, live.key, model)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "official SDK quota flow: OK" in done.stdout
