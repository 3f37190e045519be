"""Read timeouts for half-sent requests: the protocol's bounds and the command's defaults agree.

Behaviour against a real server (half headers, half a body, nothing at all, a slow but steady
client) is tested in tests/adversarial/test_api_findings.py.
"""

from __future__ import annotations

import importlib
import stat
from pathlib import Path

from tuneloop.server.api import http_timeouts
from tuneloop.server.storage.layout import Layout, TinkerPath


def test_serve_defaults_are_the_protocols() -> None:
    serve = importlib.import_module("tuneloop.server.cli.serve")
    assert serve.HEADER_TIMEOUT_S == http_timeouts.HEADER_TIMEOUT_S
    assert serve.BODY_TIMEOUT_S == http_timeouts.BODY_TIMEOUT_S


def test_timed_protocol_carries_its_bounds() -> None:
    protocol = http_timeouts.timed_protocol(1.5, 2.5)
    assert issubclass(protocol, http_timeouts.TimedH11Protocol)
    assert (protocol.header_timeout_s, protocol.body_timeout_s) == (1.5, 2.5)
    # The defaults stay as they were for other users of the class.
    assert http_timeouts.TimedH11Protocol.header_timeout_s == http_timeouts.HEADER_TIMEOUT_S


def test_layout_makes_every_folder_private(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o755)
    layout = Layout(data_dir)
    layout.prepare()
    directory = layout.checkpoint_dir("alice", TinkerPath("s:train:0", "weights", "w"))
    assert not directory.exists()  # the engine fills it, atomically
    folders = [data_dir, *[p for p in data_dir.rglob("*") if p.is_dir()]]
    assert len(folders) == 5  # data, checkpoints, alice, <run>, weights
    for folder in folders:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
