"""The server side of the `tuneloop` command: serve, deploy, keys, runs, checkpoints, usage.

Only the standard library and typer are imported at the top of these modules; uvicorn,
SQLAlchemy and torch are imported inside the commands that need them, so a bare SDK install gets
a one-line message instead of a traceback. Exit codes: 0 ok, 1 not found (or the operation
failed), 2 bad usage or bad input. Errors go to stderr; `--json` output goes to stdout.
"""

from __future__ import annotations

import typer

from tuneloop.server.cli.deploy import deploy
from tuneloop.server.cli.keys import keys_app
from tuneloop.server.cli.records import checkpoints_app, runs_app, usage
from tuneloop.server.cli.serve import serve


def register(app: typer.Typer) -> None:
    """Add the server commands to the `tuneloop` command."""
    app.command("serve")(serve)
    app.command("deploy")(deploy)
    app.add_typer(keys_app, name="keys")
    app.add_typer(runs_app, name="runs")
    app.add_typer(checkpoints_app, name="checkpoints")
    app.command("usage")(usage)


__all__ = ["register"]
