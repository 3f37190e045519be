"""What the server commands share: the data-folder options, output, errors, the registry."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from tuneloop.server.config import ServerConfig
from tuneloop.server.storage.layout import Layout

if TYPE_CHECKING:
    from tuneloop.server.storage.registry import Registry

EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
SERVER_EXTRA = "pip install 'tuneloop[server]'"

DataDirOption = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        help="Server data folder (default: $TUNELOOP_DATA_DIR, else ./.tuneloop).",
        show_default=False,
    ),
]
DbUrlOption = Annotated[
    str | None,
    typer.Option(
        "--db-url",
        help="Registry database URL (default: $TUNELOOP_DB_URL, else SQLite in the data folder).",
        show_default=False,
    ),
]
KeysFileOption = Annotated[
    Path | None,
    typer.Option(
        "--keys-file",
        help="API key file (default: keys.json in the data folder).",
        show_default=False,
    ),
]
# What every command that serves takes (`serve`, `deploy`).
HostOption = Annotated[str, typer.Option(help="Interface to listen on.")]
PortOption = Annotated[int, typer.Option(help="Port to listen on; 0 lets the OS pick one.")]
DeviceOption = Annotated[
    str | None,
    typer.Option(help="Torch device (default: cuda if present, else cpu).", show_default=False),
]
MetricsTokenOption = Annotated[
    str | None,
    typer.Option(
        help="Bearer token GET /metrics requires (Authorization: Bearer TOKEN). Unset: the"
        " metrics are open to whoever reaches the host and port. Prefer the environment, which"
        " `ps` does not show. [default: $TUNELOOP_METRICS_TOKEN, else none]",
        show_default=False,
    ),
]


class LogFormat(StrEnum):
    text = "text"
    json = "json"


LogFormatOption = Annotated[
    LogFormat | None,
    typer.Option(
        help="Server logs on stderr: text (warnings and errors), or json (JSON lines, one"
        " access line per request: request id, tenant, route, status, latency; never keys or"
        " cookies). [default: $TUNELOOP_LOG_FORMAT, else text]",
        show_default=False,
    ),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print JSON to stdout (for scripts) instead of rows.")
]
TenantFilter = Annotated[
    str | None,
    typer.Option(
        "--tenant", help="Only this tenant's rows (default: every tenant).", show_default=False
    ),
]


@dataclass
class Where:
    """Where the server keeps its data: set on a command group, overridable on its commands."""

    data_dir: Path | None = None
    db_url: str | None = None
    keys_file: Path | None = None

    def merged(
        self, data_dir: Path | None, db_url: str | None = None, keys_file: Path | None = None
    ) -> ServerConfig:
        # ServerConfig.from_env as `serve` uses it, so both agree on every default.
        return ServerConfig.from_env(
            data_dir=data_dir or self.data_dir,
            db_url=db_url or self.db_url,
            keys_file=keys_file or self.keys_file,
        )


def where(ctx: typer.Context) -> Where:
    return ctx.obj if isinstance(ctx.obj, Where) else Where()


def fail(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def need_server_extra(exc: ImportError) -> NoReturn:
    fail(f"this command needs the server: {SERVER_EXTRA} ({exc})", EXIT_USAGE)


def iso_time(value: datetime | None) -> str | None:
    return value.isoformat(timespec="seconds") if value is not None else None


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2))


def print_rows(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    """Tab-separated rows; the header only on a terminal, so pipes get data alone."""
    if sys.stdout.isatty():
        typer.echo("\t".join(header))
    for row in rows:
        typer.echo("\t".join("-" if v is None else str(v) for v in row))


def open_registry(config: ServerConfig) -> Registry:
    try:
        from tuneloop.server.storage.registry import Registry
    except ImportError as exc:
        need_server_extra(exc)
    if config.db_url is not None:
        return Registry(config.db_url)
    url = Layout(config.data_dir).database_url
    # Opening a missing SQLite file would create an empty registry: a wrong --data-dir would
    # then list nothing instead of saying so.
    if not Path(url.removeprefix("sqlite:///")).is_file():
        fail(
            f"no tuneloop registry in {config.data_dir} (pass --data-dir, or set "
            "TUNELOOP_DATA_DIR, to the folder `tuneloop serve` uses)",
            EXIT_NOT_FOUND,
        )
    return Registry(url)


def key_group_options(
    ctx: typer.Context, data_dir: DataDirOption = None, keys_file: KeysFileOption = None
) -> None:
    """Options given before the sub-command (`tuneloop keys --data-dir D create`)."""
    ctx.obj = Where(data_dir=data_dir, keys_file=keys_file)


def registry_group_options(
    ctx: typer.Context, data_dir: DataDirOption = None, db_url: DbUrlOption = None
) -> None:
    """Options given before the sub-command (`tuneloop runs --data-dir D list`)."""
    ctx.obj = Where(data_dir=data_dir, db_url=db_url)
