"""REST routes: training runs, checkpoints (model packages) and their TTLs, weights info, usage.
Always scoped to the caller's tenant."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fastapi import APIRouter, Request

from tuneloop.server.api.deps import Offset, State, Tenant, json_body, read_json
from tuneloop.server.api.errors import bad_request, not_found
from tuneloop.server.api.packages import check_ttl
from tuneloop.server.api.state import ServerState
from tuneloop.server.api.usage_report import BUCKETS, build_report, hour_range, parse_time
from tuneloop.server.storage.layout import TinkerPath
from tuneloop.server.storage.registry import CheckpointRow, TrainingRunRow, UsageFilter, utcnow
from tuneloop.types import (
    Checkpoint,
    CheckpointsListResponse,
    Cursor,
    SetCheckpointTtlRequest,
    TrainingRun,
    TrainingRunsResponse,
    WeightsInfoResponse,
)
from tuneloop.types._base import StrictBase

router = APIRouter(prefix="/api/v1")


class WeightsInfoRequest(StrictBase):
    tinker_path: str


def _page(limit: int, offset: int, max_limit: int = 1000) -> None:
    if not 1 <= limit <= max_limit:
        raise bad_request(f"limit: must be in [1, {max_limit}]", "limit")
    if offset < 0:
        raise bad_request("offset: must be >= 0", "offset")


def _scope(access_scope: str) -> None:
    # "accessible" (the official SDK's other scope) lists what the caller may read; here that
    # is what it owns: published checkpoints of others are read by path, never listed.
    if access_scope not in ("owned", "accessible"):
        raise bad_request("access_scope: must be 'owned' or 'accessible'", "access_scope")


def _checkpoint(row: CheckpointRow, public: bool = False) -> Checkpoint:
    return Checkpoint(
        checkpoint_id=row.checkpoint_id,
        checkpoint_type=row.checkpoint_type,  # type: ignore[arg-type]
        time=row.created_at,
        tinker_path=row.tinker_path,
        size_bytes=row.size_bytes,
        user_metadata=row.user_metadata,
        expires_at=row.expires_at,
        name=row.name,
        version=row.version,
        kind=row.kind,
        base_model=row.base_model,
        lora_rank=row.lora_rank,
        lora_targets=row.lora_targets,
        parent_tinker_path=row.parent_path,
        training_step=row.training_step,
        public=public,
    )


def _checkpoints(state: ServerState, rows: list[CheckpointRow]) -> list[Checkpoint]:
    public = state.publications.public_paths(rows)
    return [_checkpoint(r, r.tinker_path in public) for r in rows]


def _training_run(state: ServerState, row: TrainingRunRow) -> TrainingRun:
    checkpoints, _ = state.registry.list_checkpoints(row.tenant, training_run_id=row.id)
    latest = {
        kind: next((c for c in checkpoints if c.checkpoint_type == kind), None)
        for kind in ("training", "sampler")
    }
    shown = _checkpoints(state, [c for c in latest.values() if c is not None])
    last = {c.checkpoint_type: c for c in shown}
    return TrainingRun(
        training_run_id=row.id,
        base_model=row.base_model,
        model_owner=row.tenant,
        is_lora=True,
        last_request_time=row.last_request_time,
        lora_rank=row.lora_rank,
        user_metadata=row.user_metadata,
        last_checkpoint=last.get("training"),
        last_sampler_checkpoint=last.get("sampler"),
    )


@router.get("/training_runs")
def list_training_runs(
    state: State,
    tenant: Tenant,
    limit: int = 20,
    offset: Offset = 0,
    project_id: str | None = None,
    access_scope: str = "owned",
) -> dict[str, Any]:
    """The caller's training runs, newest first: all, or one project's."""
    _page(limit, offset)
    _scope(access_scope)
    if project_id is not None:
        rows, total = state.projects.runs_in(tenant, project_id, limit, offset)
    else:
        rows, total = state.registry.list_training_runs(tenant, limit, offset)
    return TrainingRunsResponse(
        training_runs=[_training_run(state, r) for r in rows],
        cursor=Cursor(offset=offset, limit=limit, total_count=total),
    ).model_dump(mode="json")


def _run_or_404(state: ServerState, run_id: str, tenant: str) -> TrainingRunRow:
    row = state.registry.training_run(run_id, tenant)
    if row is None:
        raise not_found(f"training run {run_id!r}", "training_run_id")
    return row


@router.get("/training_runs/{run_id}")
def get_training_run(
    run_id: str, state: State, tenant: Tenant, access_scope: str = "owned"
) -> dict[str, Any]:
    _scope(access_scope)
    return _training_run(state, _run_or_404(state, run_id, tenant)).model_dump(mode="json")


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, state: State, tenant: Tenant) -> dict[str, Any]:
    _run_or_404(state, run_id, tenant)
    rows, _ = state.registry.list_checkpoints(tenant, training_run_id=run_id)
    return CheckpointsListResponse(checkpoints=_checkpoints(state, rows)).model_dump(mode="json")


def _checkpoint_path(run_id: str, checkpoint_id: str) -> TinkerPath:
    segment, _, name = checkpoint_id.partition("/")
    try:
        return TinkerPath.parse(f"tinker://{run_id}/{segment}/{name}")
    except ValueError as exc:
        raise bad_request(f"checkpoint_id: {exc}", "checkpoint_id") from None


# Declared before the delete route: its `{checkpoint_id:path}` would also match ".../ttl".
@router.put(
    "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl",
    openapi_extra=json_body(SetCheckpointTtlRequest),
)
async def set_checkpoint_ttl(
    run_id: str, checkpoint_id: str, request: Request, state: State, tenant: Tenant
) -> dict[str, Any]:
    """Expire a package `ttl_seconds` from now, or never (null); the GC removes it then."""
    path = _checkpoint_path(run_id, checkpoint_id)
    body, _ = await read_json(request, SetCheckpointTtlRequest)
    check_ttl(body.ttl_seconds)
    expires_at = (
        utcnow() + timedelta(seconds=body.ttl_seconds) if body.ttl_seconds is not None else None
    )
    row = await state.db(state.registry.set_checkpoint_expiry, str(path), tenant, expires_at)
    if row is None:
        raise not_found(f"checkpoint {path}", "checkpoint_id")
    public = await state.db(state.publications.is_public, row)
    return _checkpoint(row, public).model_dump(mode="json")


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(
    run_id: str, checkpoint_id: str, state: State, tenant: Tenant
) -> dict[str, Any]:
    path = _checkpoint_path(run_id, checkpoint_id)
    row = state.registry.remove_checkpoint(str(path), tenant)
    if row is None:
        raise not_found(f"checkpoint {path}", "checkpoint_id")
    state.publications.unpublish(row)
    state.audit.record(tenant, "checkpoint_deleted", tinker_path=str(path))
    return {"deleted": str(path)}


@router.get("/checkpoints")
def list_user_checkpoints(
    state: State, tenant: Tenant, limit: int = 100, offset: Offset = 0
) -> dict[str, Any]:
    _page(limit, offset)
    rows, total = state.registry.list_checkpoints(tenant, limit=limit, offset=offset)
    return CheckpointsListResponse(
        checkpoints=_checkpoints(state, rows),
        cursor=Cursor(offset=offset, limit=limit, total_count=total),
    ).model_dump(mode="json")


@router.post("/weights_info", openapi_extra=json_body(WeightsInfoRequest))
async def weights_info(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, _ = await read_json(request, WeightsInfoRequest)
    # The caller's checkpoint, or one another tenant published.
    _path, _row, run = await state.readable_checkpoint(tenant, body.tinker_path, "tinker_path")
    return WeightsInfoResponse(
        base_model=run.base_model,
        lora_rank=run.lora_rank,
        train_unembed=run.train_unembed,
        train_mlp=run.train_mlp,
        train_attn=run.train_attn,
        train_experts=run.train_experts,
    ).model_dump()


def _run_or_sampler(state: ServerState, model_id: str, tenant: str) -> bool:
    registry = state.registry
    return (
        registry.training_run(model_id, tenant) is not None
        or registry.sampler(model_id, tenant) is not None
    )


@router.get("/usage")
async def usage(
    state: State,
    tenant: Tenant,
    session_id: str | None = None,
    training_run_id: str | None = None,
    since: str | None = None,
    until: str | None = None,
    bucket: str = "none",
) -> dict[str, Any]:
    """Tokens (prefill, sampled, trained) and requests metered for the caller: all of it, or
    one session's, or one training run's or sampler's; over [since, until) (ISO times or spans
    back from now like 24h); in hour or day buckets (UTC) if asked."""
    if (
        session_id is not None
        and await state.db(state.registry.session, session_id, tenant) is None
    ):
        raise not_found(f"session {session_id!r}", "session_id")
    if training_run_id is not None and not await state.db(
        _run_or_sampler, state, training_run_id, tenant
    ):
        raise not_found(f"training run or sampler {training_run_id!r}", "training_run_id")
    if bucket not in BUCKETS:
        raise bad_request(f"bucket: must be one of {', '.join(BUCKETS)}", "bucket")
    now = utcnow()
    times = {}
    for name, value in (("since", since), ("until", until)):
        try:
            times[name] = parse_time(value, now) if value is not None else None
        except ValueError as exc:
            raise bad_request(f"{name}: {exc}", name) from None
    since_hour, until_hour = hour_range(times["since"], times["until"])
    # Write what is still counted in memory first, so the answer includes every completed
    # operation whose result the caller may already hold.
    await state.meter.flush_async(state.registry)
    where = UsageFilter(tenant, session_id, training_run_id, since_hour, until_hour)
    return build_report(
        await state.db(state.registry.usage_sums, where),
        tenant,
        bucket=bucket,
        session_id=session_id,
        training_run_id=training_run_id,
        since=times["since"],
        until=times["until"],
    ).model_dump(mode="json")
