"""One real server process (torch engine, the tiny built-in model) shared by a module's recipe
runs: starting one per run would cost more than the runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tuneloop._local_server import LiveServer, live_server

TINY = "tuneloop/tiny-qwen3"


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("server")
    with live_server(
        data, "--cache-dir", str(data / "cache"), backend="torch", models=(TINY,)
    ) as s:
        yield s
