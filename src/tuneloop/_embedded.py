"""The embedded default: a local tuneloop server started for clients given no address.

`ServiceClient()` with no base URL and no $TUNELOOP_BASE_URL starts `tuneloop serve` in a child
process (the GPU if there is one, else the CPU), shares it between the clients of this process,
and stops it when the last of them closes or the process exits. The server also watches this
process and stops by itself if it is killed, so no server is ever left behind. The same user
code runs unchanged against a remote server once $TUNELOOP_BASE_URL is set.
"""

from __future__ import annotations

import atexit
import os
import threading
from pathlib import Path

from tuneloop._http import env_home, env_serve_args
from tuneloop._local_server import LiveServer, create_key, start_server, stop

_lock = threading.Lock()
_server: LiveServer | None = None
_users = 0
_exit_hook_installed = False


def _local_key(data_dir: Path) -> str:
    """The local tenant's key, made once per data dir and kept beside it (owner-only)."""
    path = data_dir / "local-api-key"
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    key = create_key(data_dir, "local")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def acquire() -> LiveServer:
    """The process's embedded server, started on first use."""
    global _server, _users, _exit_hook_installed
    with _lock:
        if _server is None or _server.process.poll() is not None:
            data_dir = env_home() / "embedded"
            _server = start_server(
                data_dir, *env_serve_args(), key=_local_key(data_dir), backend="torch"
            )
            _users = 0
            if not _exit_hook_installed:
                atexit.register(_shutdown)
                _exit_hook_installed = True
        _users += 1
        return _server


def release() -> None:
    """One client is done with the server; the last one stops it."""
    global _users
    with _lock:
        _users -= 1
        if _users <= 0:
            _stop_locked()


def _shutdown() -> None:
    with _lock:
        _stop_locked()


def _stop_locked() -> None:
    global _server
    if _server is not None:
        stop(_server.process)
        _server = None
