"""`tuneloop runs|checkpoints|usage`: what the registry holds, for the operator."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Any

import typer

from tuneloop.server.cli.common import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    DataDirOption,
    DbUrlOption,
    JsonOption,
    TenantFilter,
    Where,
    fail,
    iso_time,
    need_server_extra,
    open_registry,
    print_json,
    print_rows,
    registry_group_options,
    where,
)
from tuneloop.server.storage.layout import TinkerPath

runs_app = typer.Typer(
    help="Inspect training runs (LoRA adapters) in the registry.", no_args_is_help=True
)
runs_app.callback()(registry_group_options)


@runs_app.command("list")
def runs_list(
    ctx: typer.Context,
    tenant: TenantFilter = None,
    data_dir: DataDirOption = None,
    db_url: DbUrlOption = None,
    as_json: JsonOption = False,
) -> None:
    """List training runs, newest first.

    Rows: run id, tenant, base model, LoRA rank, created, last request.
    """
    registry = open_registry(where(ctx).merged(data_dir, db_url))
    try:
        rows = registry.all_training_runs(tenant)
    finally:
        registry.close()
    runs = [
        {
            "training_run_id": r.id,
            "tenant": r.tenant,
            "session_id": r.session_id,
            "base_model": r.base_model,
            "lora_rank": r.lora_rank,
            "created_at": iso_time(r.created_at),
            "last_request_time": iso_time(r.last_request_time),
        }
        for r in rows
    ]
    if as_json:
        print_json(runs)
        return
    keys = ("training_run_id", "tenant", "base_model", "lora_rank", "created_at")
    print_rows(
        ("RUN_ID", "TENANT", "BASE_MODEL", "RANK", "CREATED", "LAST_REQUEST"),
        [(*(r[k] for k in keys), r["last_request_time"]) for r in runs],
    )


# ---- checkpoints ------------------------------------------------------------------------------

checkpoints_app = typer.Typer(
    help="List, delete and export saved checkpoints (tinker:// paths).", no_args_is_help=True
)
checkpoints_app.callback()(registry_group_options)


def _parse_path(tinker_path: str) -> str:
    try:
        return str(TinkerPath.parse(tinker_path))
    except ValueError as exc:
        fail(f"TINKER_PATH {tinker_path!r}: {exc}", EXIT_USAGE)


@checkpoints_app.command("list")
def checkpoints_list(
    ctx: typer.Context,
    run: Annotated[
        str | None,
        typer.Option("--run", help="Only this training run's checkpoints.", show_default=False),
    ] = None,
    tenant: TenantFilter = None,
    data_dir: DataDirOption = None,
    db_url: DbUrlOption = None,
    as_json: JsonOption = False,
) -> None:
    """List checkpoints, newest first.

    Rows: tinker path, tenant, type (training|sampler), size in bytes, created, expires.
    Exit 1 if --run names no training run (of --tenant, when given).
    """
    registry = open_registry(where(ctx).merged(data_dir, db_url))
    try:
        if run is not None:
            found = registry.training_run_any_tenant(run)
            if found is None or (tenant is not None and found.tenant != tenant):
                fail(f"no training run {run}", EXIT_NOT_FOUND)
        rows = registry.all_checkpoints(tenant, run)
    finally:
        registry.close()
    checkpoints = [
        {
            "tinker_path": r.tinker_path,
            "tenant": r.tenant,
            "training_run_id": r.training_run_id,
            "checkpoint_type": r.checkpoint_type,
            "size_bytes": r.size_bytes,
            "created_at": iso_time(r.created_at),
            "expires_at": iso_time(r.expires_at),
            "directory": r.directory,
        }
        for r in rows
    ]
    if as_json:
        print_json(checkpoints)
        return
    keys = ("tinker_path", "tenant", "checkpoint_type", "size_bytes", "created_at", "expires_at")
    print_rows(
        ("TINKER_PATH", "TENANT", "TYPE", "SIZE_BYTES", "CREATED", "EXPIRES"),
        [tuple(c[k] for k in keys) for c in checkpoints],
    )


@checkpoints_app.command("delete")
def checkpoints_delete(
    ctx: typer.Context,
    tinker_path: Annotated[str, typer.Argument(help="tinker://<run>/<segment>/<name>")],
    tenant: Annotated[str, typer.Option("--tenant", help="The checkpoint's owner (a safeguard).")],
    data_dir: DataDirOption = None,
    db_url: DbUrlOption = None,
) -> None:
    """Delete a checkpoint: its registry row and its files, as the REST delete does."""
    path = _parse_path(tinker_path)
    registry = open_registry(where(ctx).merged(data_dir, db_url))
    try:
        removed = registry.remove_checkpoint(path, tenant)
    finally:
        registry.close()
    if removed is None:
        fail(f"no checkpoint {path} of tenant {tenant}", EXIT_NOT_FOUND)
    typer.echo(f"deleted {path}", err=True)


@checkpoints_app.command("export")
def checkpoints_export(
    ctx: typer.Context,
    tinker_path: Annotated[str, typer.Argument(help="tinker://<run>/<segment>/<name>")],
    out: Annotated[
        Path,
        typer.Option("--out", help="Folder to create (must not exist, or be empty)."),
    ],
    merged: Annotated[
        bool,
        typer.Option(
            "--merged",
            help="Write base model + adapter as one plain Hugging Face model (needs torch) "
            "instead of copying the adapter folder (PEFT layout).",
        ),
    ] = False,
    tenant: Annotated[
        str | None,
        typer.Option("--tenant", help="Only if this tenant owns it.", show_default=False),
    ] = None,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where base models are cached for --merged (default: as `serve`).",
            show_default=False,
        ),
    ] = None,
    data_dir: DataDirOption = None,
    db_url: DbUrlOption = None,
) -> None:
    """Export a checkpoint to a folder: the adapter as saved, or merged into its base model."""
    path = _parse_path(tinker_path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"--out {out} exists and is not an empty folder", EXIT_USAGE)
    config = where(ctx).merged(data_dir, db_url)
    registry = open_registry(config)
    try:
        row = registry.checkpoint_any_tenant(path)
    finally:
        registry.close()
    if row is None or (tenant is not None and row.tenant != tenant):
        fail(f"no checkpoint {path}", EXIT_NOT_FOUND)
    source = Path(row.directory)
    if not source.is_dir():
        fail(f"the files of {path} are missing ({source})", EXIT_NOT_FOUND)
    if not merged:
        shutil.copytree(source, out, dirs_exist_ok=True)
        typer.echo(f"exported {path} to {out}", err=True)
        return
    try:
        from tuneloop.server.engine import merge
    except ImportError as exc:
        need_server_extra(exc)
    cache = cache_dir or config.cache_dir
    try:
        merge.export_merged(source, out, cache_dir=cache)
    except Exception as exc:  # one message at this boundary: a bad base model, disk, ...
        fail(f"merging {path} failed: {type(exc).__name__}: {exc}", EXIT_NOT_FOUND)
    typer.echo(f"exported {path} merged into its base model to {out}", err=True)


# ---- usage ------------------------------------------------------------------------------------


def usage(
    tenant: TenantFilter = None,
    session: Annotated[
        str | None,
        typer.Option("--session", help="Only this session's usage.", show_default=False),
    ] = None,
    data_dir: DataDirOption = None,
    db_url: DbUrlOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show metered tokens and requests per tenant and kind.

    Kinds: train (forward_backward input tokens), forward (forward-only input tokens),
    sample_prompt (prompt tokens, once per sample request), sample_generated (tokens generated
    over all returned sequences). A running server writes its counts every 2 s.

    Rows: tenant, kind, tokens, requests. Exit 1 if --session is unknown (or not --tenant's).
    """
    try:
        from tuneloop.server.api.metering import KINDS, summarize
    except ImportError as exc:
        need_server_extra(exc)
    registry = open_registry(Where().merged(data_dir, db_url))
    try:
        if session is not None:
            owner = registry.session_any_tenant(session)
            if owner is None or (tenant is not None and owner.tenant != tenant):
                fail(f"no session {session}", EXIT_NOT_FOUND)
            tenant = owner.tenant
        totals = registry.usage_totals(tenant, session)
    finally:
        registry.close()
    tenants = sorted({t.tenant for t in totals} | ({tenant} if tenant is not None else set()))
    report: list[dict[str, Any]] = []
    for name in tenants:
        tokens, requests = summarize([t for t in totals if t.tenant == name])
        report.append(
            {"tenant": name, "session_id": session, "tokens": tokens, "requests": requests}
        )
    if as_json:
        print_json(report)
        return
    print_rows(
        ("TENANT", "KIND", "TOKENS", "REQUESTS"),
        [(r["tenant"], k, r["tokens"][k], r["requests"][k]) for r in report for k in KINDS],
    )
