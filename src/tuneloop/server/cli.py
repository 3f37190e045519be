"""`tuneloop serve` and `tuneloop keys ...`: the server side of the command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tuneloop.server.config import ServerConfig
from tuneloop.server.storage.keys import KeyStore
from tuneloop.server.storage.layout import Layout


def add_commands(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the tuneloop server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--data-dir", type=Path, default=None)
    serve.add_argument("--db-url", default=None)
    serve.add_argument("--keys-file", type=Path, default=None)
    serve.add_argument(
        "--backend",
        choices=["torch", "fake"],
        default="torch",
        help="torch: the real engine; fake: a NumPy stand-in for testing the service",
    )
    serve.add_argument(
        "--model",
        action="append",
        default=[],
        dest="models",
        metavar="NAME_OR_PATH",
        help="base model to keep resident (repeatable; default: SmolLM2-135M-Instruct)",
    )
    serve.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    serve.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default=None,
        help="base model weights (default: bfloat16 on GPU, float32 on CPU)",
    )
    serve.add_argument(
        "--cache-dir", type=Path, default=None, help="converted models (default ~/.cache/tuneloop)"
    )
    serve.add_argument("--long-poll-s", type=float, default=None)
    serve.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="stop when this process exits (used when a client starts a local server)",
    )
    serve.set_defaults(func=_serve)

    keys = sub.add_parser("keys", help="manage API keys")
    keys.add_argument("--data-dir", type=Path, default=None)
    keys.add_argument("--keys-file", type=Path, default=None)
    key_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = key_sub.add_parser("create", help="create a key for a tenant and print it")
    create.add_argument("--tenant", required=True)
    create.set_defaults(func=_keys_create)
    key_sub.add_parser("list", help="list keys (never the keys themselves)").set_defaults(
        func=_keys_list
    )
    revoke = key_sub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=_keys_revoke)


def _key_store(args: argparse.Namespace) -> KeyStore:
    config = ServerConfig.from_env(data_dir=args.data_dir, keys_file=args.keys_file)
    return KeyStore(config.keys_file or Layout(config.data_dir).keys_file)


def _keys_create(args: argparse.Namespace) -> int:
    try:
        key, record = _key_store(args).create(args.tenant)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(key)
    print(f"key id {record.key_id} for tenant {record.tenant}", file=sys.stderr)
    return 0


def _keys_list(args: argparse.Namespace) -> int:
    for r in _key_store(args).list():
        state = "revoked" if r.revoked else "active"
        print(f"{r.key_id}\t{r.tenant}\t{r.created_at}\t{state}")
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    if not _key_store(args).revoke(args.key_id):
        print(f"error: no key {args.key_id}", file=sys.stderr)
        return 1
    return 0


def _exit_with_parent(server: Any, parent_pid: int) -> None:
    """Shut the server down once the process that started it is gone (even after SIGKILL)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    server.should_exit = True


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tuneloop.server.app import create_app

    config = ServerConfig.from_env(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        db_url=args.db_url,
        keys_file=args.keys_file,
        backend=args.backend,
        models=tuple(args.models) or None,
        long_poll_s=args.long_poll_s,
    )
    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )
    original_startup = server.startup

    async def startup(sockets: Any = None) -> None:
        await original_startup(sockets=sockets)
        if server.started:  # with --port 0 the OS picks the port: print the bound one
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else config.port
            print(f"tuneloop serving at http://{config.host}:{port}", flush=True)

    setattr(server, "startup", startup)  # noqa: B010 - announce readiness with the real port
    if args.parent_pid is not None:
        threading.Thread(
            target=_exit_with_parent, args=(server, args.parent_pid), daemon=True
        ).start()
    # uvicorn turns SIGTERM into a graceful shutdown and then re-raises it to the handler that
    # was installed before: make that one a no-op, so a requested stop exits with status 0.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    server.run()
    return 0
