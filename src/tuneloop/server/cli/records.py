"""`tuneloop runs|checkpoints|usage`: what the registry holds, for the operator."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

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
from tuneloop.server.storage.layout import TinkerPath, valid_name

if TYPE_CHECKING:
    from tuneloop.server.storage.registry import CheckpointRow

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
    """List checkpoints (model packages), newest first.

    Rows: tinker path, tenant, package name, version, kind (training-state|sampler|adapter|merged),
    training step, size in bytes, created, expires. --json adds the base model, LoRA rank and
    targets, the parent package and the folder.
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
    checkpoints = [_package(r) for r in rows]
    if as_json:
        print_json(checkpoints)
        return
    keys = (
        "tinker_path", "tenant", "name", "version", "kind", "training_step", "size_bytes",
        "created_at", "expires_at",
    )  # fmt: skip
    print_rows(
        ("TINKER_PATH", "TENANT", "NAME", "VERSION", "KIND", "STEP", "SIZE_BYTES", "CREATED",
         "EXPIRES"),
        [tuple(c[k] for k in keys) for c in checkpoints],
    )  # fmt: skip


def _package(r: CheckpointRow) -> dict[str, Any]:
    return {
        "tinker_path": r.tinker_path,
        "tenant": r.tenant,
        "training_run_id": r.training_run_id,
        "checkpoint_type": r.checkpoint_type,
        "name": r.name,
        "version": r.version,
        "kind": r.kind,
        "base_model": r.base_model,
        "lora_rank": r.lora_rank,
        "lora_targets": r.lora_targets,
        "parent_tinker_path": r.parent_path,
        "training_step": r.training_step,
        "size_bytes": r.size_bytes,
        "created_at": iso_time(r.created_at),
        "expires_at": iso_time(r.expires_at),
        "directory": r.directory,
    }


@checkpoints_app.command("gc")
def checkpoints_gc(
    ctx: typer.Context,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only list what has expired; delete nothing.")
    ] = False,
    data_dir: DataDirOption = None,
    db_url: DbUrlOption = None,
    as_json: JsonOption = False,
) -> None:
    """Delete every expired checkpoint (row, then files), as a running server does each minute.

    Rows: the tinker paths deleted (or, with --dry-run, that would be).
    """
    registry = open_registry(where(ctx).merged(data_dir, db_url))
    try:
        now = datetime.now(UTC)
        rows = registry.expired_checkpoints(now) if dry_run else registry.collect_expired(now)
    finally:
        registry.close()
    verb = "would delete" if dry_run else "deleted"
    typer.echo(f"{verb} {len(rows)} expired checkpoint(s)", err=True)
    if as_json:
        print_json([_package(r) for r in rows])
        return
    print_rows(
        ("TINKER_PATH", "TENANT", "EXPIRED"),
        [(r.tinker_path, r.tenant, iso_time(r.expires_at)) for r in rows],
    )


@checkpoints_app.command("delete")
def checkpoints_delete(
    ctx: typer.Context,
    tinker_path: Annotated[
        str, typer.Argument(help="The checkpoint's path: tinker://<run>/<segment>/<name>.")
    ],
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


# What a training checkpoint holds beyond the adapter (engine/checkpoints.py's OPTIMIZER_FILE
# and STATE_FILE; named here so that exporting needs no torch). An export leaves them out: it is
# the adapter folder a download of save_weights_external gives.
TRAINING_STATE_FILES = frozenset({"optimizer.pt", "tuneloop_state.json"})


def _copy_adapter(source: Path, out: Path) -> list[str]:
    """Copy the checkpoint's adapter files (not its optimizer state, not symbolic links)."""
    names = sorted(
        p.name
        for p in source.iterdir()
        if p.is_file() and not p.is_symlink() and p.name not in TRAINING_STATE_FILES
    )
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy2(source / name, out / name)
    return names


@checkpoints_app.command("export")
def checkpoints_export(
    ctx: typer.Context,
    tinker_path: Annotated[
        str, typer.Argument(help="The checkpoint's path: tinker://<run>/<segment>/<name>.")
    ],
    out: Annotated[
        Path,
        typer.Option("--out", help="Folder to create (must not exist, or be empty)."),
    ],
    merged: Annotated[
        bool,
        typer.Option(
            "--merged",
            help="Write base model + adapter as one plain Hugging Face model (needs torch) "
            "instead of the adapter alone (PEFT layout, as a download gives it).",
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
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            help="Package name of a --merged export (default: the source's name + '-merged').",
            show_default=False,
        ),
    ] = None,
    data_dir: DataDirOption = None,
    db_url: DbUrlOption = None,
) -> None:
    """Export a checkpoint to a folder: its adapter in the PEFT layout (adapter_model.safetensors,
    adapter_config.json; a training checkpoint's optimizer state is left out), the same files a
    download of save_weights_external gives; or, with --merged, base model + adapter as one model.

    A --merged export is registered as a model package of kind "merged" (its parent: the
    source), at tinker://<run>/external_weights/<name>; deleting that package deletes --out.
    """
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
        copied = _copy_adapter(source, out)
        typer.echo(f"exported {path} to {out} ({', '.join(copied)})", err=True)
        return
    try:
        from tuneloop.server.engine import merge
        from tuneloop.server.storage.registry import merged_package
    except ImportError as exc:
        need_server_extra(exc)
    target = TinkerPath(row.training_run_id, "external_weights", name or f"{row.name}-merged")
    if not valid_name(target.name):
        fail(f"--name {target.name!r}: letters, digits, '.', '_' or '-', at most 128", EXIT_USAGE)
    registry = open_registry(config)
    try:
        taken = registry.checkpoint_any_tenant(str(target)) is not None
    finally:
        registry.close()
    if taken:
        fail(f"{target} is already registered (pass another --name)", EXIT_USAGE)
    cache = cache_dir or config.cache_dir
    try:
        merge.export_merged(source, out, cache_dir=cache)
    except Exception as exc:  # one message at this boundary: a bad base model, disk, ...
        fail(f"merging {path} failed: {type(exc).__name__}: {exc}", EXIT_NOT_FOUND)
    registry = open_registry(config)
    try:
        package = registry.register_package(merged_package(row, target, out.resolve()))
    finally:
        registry.close()
    typer.echo(
        f"exported {path} merged into its base model to {out}, registered as {target} "
        f"(package {package.name} v{package.version})",
        err=True,
    )


# ---- usage ------------------------------------------------------------------------------------


def usage(
    tenant: TenantFilter = None,
    session: Annotated[
        str | None,
        typer.Option("--session", help="Only this session's usage.", show_default=False),
    ] = None,
    run: Annotated[
        str | None,
        typer.Option(
            "--run", help="Only this training run's (or sampler's) usage.", show_default=False
        ),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            help="From this time: ISO (2025-01-31T12:00Z; UTC if no zone) or a span back from "
            "now: 30m, 24h, 7d.",
            show_default=False,
        ),
    ] = None,
    until: Annotated[
        str | None,
        typer.Option("--until", help="Up to this time (same forms).", show_default=False),
    ] = None,
    bucket: Annotated[
        str, typer.Option("--bucket", help="Also per UTC hour or day: none, hour or day.")
    ] = "none",
    data_dir: DataDirOption = None,
    db_url: DbUrlOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show metered tokens per tenant and operation: prefill, sampled and trained, and requests.

    Operations: forward_backward (its input tokens are trained), forward (forward-only: input
    tokens are prefill), sample (prompt tokens are prefill, once per request; generated tokens
    are sampled). Usage is kept per UTC hour, so --since/--until resolve to whole hours. A
    running server writes its counts every 2 s.

    Exit 1 if --session or --run is unknown (or not --tenant's); 2 on a bad time or --bucket.
    """
    try:
        from tuneloop.server.api.usage_report import BUCKETS, build_report, hour_range, parse_time
        from tuneloop.server.storage.registry import UsageFilter
    except ImportError as exc:
        need_server_extra(exc)
    if bucket not in BUCKETS:
        fail(f"--bucket {bucket!r}: must be one of {', '.join(BUCKETS)}", EXIT_USAGE)
    now = datetime.now(UTC)
    times: dict[str, datetime | None] = {}
    for option, value in (("--since", since), ("--until", until)):
        try:
            times[option] = parse_time(value, now) if value is not None else None
        except ValueError as exc:
            fail(f"{option}: {exc}", EXIT_USAGE)
    registry = open_registry(Where().merged(data_dir, db_url))
    try:
        if session is not None:
            owner = registry.session_any_tenant(session)
            if owner is None or (tenant is not None and owner.tenant != tenant):
                fail(f"no session {session}", EXIT_NOT_FOUND)
            tenant = owner.tenant
        if run is not None:
            run_owner = registry.usage_owner(run)
            if run_owner is None or (tenant is not None and run_owner != tenant):
                fail(f"no training run or sampler {run}", EXIT_NOT_FOUND)
            tenant = run_owner
        since_hour, until_hour = hour_range(times["--since"], times["--until"])
        sums = registry.usage_sums(UsageFilter(tenant, session, run, since_hour, until_hour))
    finally:
        registry.close()
    tenants = sorted({s.tenant for s in sums} | ({tenant} if tenant is not None else set()))
    reports = [
        build_report(
            sums, name, bucket=bucket, session_id=session, training_run_id=run,
            since=times["--since"], until=times["--until"],
        )
        for name in tenants
    ]  # fmt: skip
    if as_json:
        print_json([r.model_dump(mode="json") for r in reports])
        return
    _print_usage(reports, bucket)


def _print_usage(reports: list[Any], bucket: str) -> None:
    """One table: a row per tenant (and hour or day) and operation that did any work, then the
    tenant's total; columns: prefill, sampled and trained tokens, and requests."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="usage: tokens by class, and requests")
    for header in ("tenant", *(() if bucket == "none" else (f"{bucket} (UTC)",)), "operation"):
        table.add_column(header, no_wrap=True)  # names and times are never cut
    for header in ("prefill", "sampled", "trained", "requests"):
        table.add_column(header, justify="right", no_wrap=True)

    def cells(c: Any) -> tuple[str, ...]:
        counts = (c.prefill_tokens, c.sampled_tokens, c.trained_tokens, c.requests)
        return tuple(f"{v:,}" for v in counts)

    for report in reports:
        groups = [(None, report.by_operation, report.totals)]
        if bucket != "none":
            groups = [(b.start, b.by_operation, b.totals) for b in report.buckets]
        for start, by_operation, totals in groups:
            when = () if start is None else (start.strftime("%Y-%m-%d %H:%M"),)
            for operation, counts in by_operation.items():
                if any(cells(counts)[i] != "0" for i in range(4)):  # work done: a row
                    table.add_row(report.tenant, *when, operation, *cells(counts))
            table.add_row(
                report.tenant, *when, "total", *cells(totals), style="bold", end_section=True
            )
    # A terminal's own width; a pipe or file gets whole rows, however wide.
    console = Console()
    Console(width=console.width if console.is_terminal else 240).print(table)
