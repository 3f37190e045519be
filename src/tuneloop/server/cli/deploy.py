"""`tuneloop deploy`: serve one merged model as a real-time OpenAI-compatible endpoint.

The deployment is the training server's app with only the OpenAI-compatible routes
(ServerConfig.openai_only): the same engine loop (continuous batching), the same API keys,
metering and quotas, readiness at GET /oai/api/v1/health, and SIGTERM a graceful stop (exit 0).

What it serves:
- a merged Hugging Face folder, as `tuneloop checkpoints export PATH --merged --out DIR` writes
  it (that export registers it as a package of kind "merged"; a folder the registry does not
  know is served all the same, unregistered: nothing in it says which checkpoint it came from);
- a checkpoint, `tinker://<run>/<segment>/<name>`: merged into its base model first, under the
  data folder, and registered as a package of kind "merged" at
  `tinker://<run>/external_weights/<name>-merged` (a deployment of the same checkpoint again
  reuses that package instead of merging anew).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tuneloop.server.cli.common import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    DataDirOption,
    DbUrlOption,
    DeviceOption,
    HostOption,
    KeysFileOption,
    LogFormatOption,
    MetricsTokenOption,
    PortOption,
    fail,
    need_server_extra,
    open_registry,
)
from tuneloop.server.cli.serve import DtypeName, run_server
from tuneloop.server.config import ServerConfig
from tuneloop.server.storage.layout import Layout, TinkerPath, valid_name

if TYPE_CHECKING:
    from tuneloop.server.storage.registry import CheckpointRow


def deploy(
    source: Annotated[
        str,
        typer.Argument(
            metavar="DIR_OR_CHECKPOINT",
            help="A merged model folder, or a tinker:// checkpoint to merge and serve.",
        ),
    ],
    host: HostOption = "127.0.0.1",
    port: PortOption = 8000,
    data_dir: DataDirOption = None,
    db_url: DbUrlOption = None,
    keys_file: KeysFileOption = None,
    device: DeviceOption = None,
    dtype: Annotated[
        DtypeName | None,
        typer.Option(
            help="Model weights (default: as `tuneloop serve` chooses).", show_default=False
        ),
    ] = None,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where base models are cached, for merging a checkpoint (default: as `serve`).",
            show_default=False,
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            help="Package name of a checkpoint's merge (default: the checkpoint's name + "
            "'-merged').",
            show_default=False,
        ),
    ] = None,
    metrics_token: MetricsTokenOption = None,
    log_format: LogFormatOption = None,
    parent_pid: Annotated[
        int | None,
        typer.Option(help="Stop when this process exits.", hidden=True, show_default=False),
    ] = None,
) -> None:
    """Serve a merged model at /oai/api/v1 (chat/completions, completions, models, health).

    Prints `tuneloop serving at URL` once it accepts requests. Callers authenticate with a key
    of the data folder (`tuneloop keys create`), sent as `Authorization: Bearer <key>`.
    """
    try:
        import uvicorn  # noqa: F401 - checked here: a bare SDK install gets the one-line message

        from tuneloop.server.app import create_app
    except ImportError as exc:
        need_server_extra(exc)
    base = ServerConfig.from_env(data_dir=data_dir, db_url=db_url, cache_dir=cache_dir)
    if source.startswith("tinker://"):
        folder = _merged_checkpoint(source, base, name)
    else:
        folder = Path(source).expanduser().resolve()
        if not (folder / "config.json").is_file():
            fail(f"{source} is not a model folder (no config.json)", EXIT_NOT_FOUND)
        _say_registered(folder, base)
    config = ServerConfig.from_env(
        host=host,
        port=port,
        data_dir=data_dir,
        db_url=db_url,
        keys_file=keys_file,
        backend="torch",
        models=(str(folder),),
        device=device,
        dtype=dtype.value if dtype is not None else None,
        cache_dir=cache_dir,
        openai_only=True,
        metrics_token=metrics_token,
        log_format=log_format.value if log_format is not None else None,
    )
    typer.echo(f"model: {folder} (also answers to {folder.name!r})", err=True)
    run_server(create_app(config), config, parent_pid=parent_pid)


def _registry_exists(config: ServerConfig) -> bool:
    if config.db_url is not None:
        return True
    return Path(Layout(config.data_dir).database_url.removeprefix("sqlite:///")).is_file()


def _say_registered(folder: Path, config: ServerConfig) -> None:
    """Name the package a folder is registered as, or say that it is not."""
    package = None
    if _registry_exists(config):
        registry = open_registry(config)
        try:
            package = next(
                (c for c in registry.all_checkpoints() if Path(c.directory) == folder), None
            )
        finally:
            registry.close()
    if package is None:
        typer.echo(f"{folder} is not a registered package: serving it unregistered", err=True)
    else:
        typer.echo(
            f"{folder} is package {package.name} v{package.version} ({package.kind}, "
            f"{package.tinker_path})",
            err=True,
        )


def _merged_checkpoint(source: str, config: ServerConfig, name: str | None) -> Path:
    """The merged folder of a checkpoint: merged now and registered, unless it already was."""
    try:
        path = TinkerPath.parse(source)
    except ValueError as exc:
        fail(f"{source}: {exc}", EXIT_USAGE)
    registry = open_registry(config)
    try:
        row = registry.checkpoint_any_tenant(str(path))
        if row is None:
            fail(f"no checkpoint {source}", EXIT_NOT_FOUND)
        if row.kind == "merged":  # already a merged model
            return Path(row.directory)
        target = TinkerPath(row.training_run_id, "external_weights", name or f"{row.name}-merged")
        if not valid_name(target.name):
            fail(
                f"--name {target.name!r}: letters, digits, '.', '_' or '-', at most 128", EXIT_USAGE
            )
        existing = registry.checkpoint_any_tenant(str(target))
    finally:
        registry.close()
    if existing is not None:
        if existing.kind == "merged" and existing.parent_path == row.tinker_path:
            typer.echo(f"serving {target}, merged earlier from {source}", err=True)
            return Path(existing.directory)
        fail(f"{target} is already registered (pass another --name)", EXIT_USAGE)
    return _merge(row, target, config)


def _merge(row: CheckpointRow, target: TinkerPath, config: ServerConfig) -> Path:
    try:
        from tuneloop.server.engine import merge
        from tuneloop.server.storage.registry import merged_package
    except ImportError as exc:
        need_server_extra(exc)
    out = Layout(config.data_dir).checkpoint_dir(row.tenant, target)
    source = Path(row.directory)
    if not source.is_dir():
        fail(f"the files of {row.tinker_path} are missing ({source})", EXIT_NOT_FOUND)
    try:
        merge.export_merged(source, out, cache_dir=config.cache_dir)
    except Exception as exc:  # one message at this boundary: a bad base model, disk, ...
        fail(f"merging {row.tinker_path} failed: {type(exc).__name__}: {exc}", EXIT_NOT_FOUND)
    registry = open_registry(config)
    try:
        package = registry.register_package(merged_package(row, target, out.resolve()))
    finally:
        registry.close()
    typer.echo(
        f"merged {row.tinker_path} into {out}, registered as {target} "
        f"(package {package.name} v{package.version}, kind {package.kind})",
        err=True,
    )
    return out.resolve()
