"""Read-only listings for the web console: a tenant's sessions, runs, samplers and packages in
one query each, and the operator's per-tenant counts.

Every tenant-taking function filters by that tenant in SQL; only `tenant_counts` spans tenants,
for the operator view (an admin key), and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from tuneloop.server.storage.registry import CheckpointRow, SamplerRow, SessionRow, TrainingRunRow

__all__ = ["TenantCounts", "checkpoints", "samplers", "sessions", "tenant_counts", "training_runs"]

# A console page lists at most this many rows of a kind, newest first.
PAGE_ROWS = 200


def _rows(engine: Engine, query: object) -> list[object]:
    with Session(engine) as db:
        return list(db.scalars(query))  # type: ignore[call-overload]


def sessions(engine: Engine, tenant: str, limit: int = PAGE_ROWS) -> list[SessionRow]:
    query = (
        select(SessionRow)
        .where(SessionRow.tenant == tenant)
        .order_by(SessionRow.created_at.desc())
        .limit(limit)
    )
    return _rows(engine, query)  # type: ignore[return-value]


def training_runs(
    engine: Engine, tenant: str, session_id: str | None = None, limit: int = PAGE_ROWS
) -> list[TrainingRunRow]:
    query = select(TrainingRunRow).where(TrainingRunRow.tenant == tenant)
    if session_id is not None:
        query = query.where(TrainingRunRow.session_id == session_id)
    return _rows(engine, query.order_by(TrainingRunRow.created_at.desc()).limit(limit))  # type: ignore[return-value]


def samplers(engine: Engine, tenant: str, limit: int = PAGE_ROWS) -> list[SamplerRow]:
    query = (
        select(SamplerRow)
        .where(SamplerRow.tenant == tenant)
        .order_by(SamplerRow.created_at.desc())
        .limit(limit)
    )
    return _rows(engine, query)  # type: ignore[return-value]


def checkpoints(
    engine: Engine, tenant: str, training_run_id: str | None = None, limit: int = PAGE_ROWS
) -> list[CheckpointRow]:
    query = select(CheckpointRow).where(CheckpointRow.tenant == tenant)
    if training_run_id is not None:
        query = query.where(CheckpointRow.training_run_id == training_run_id)
    return _rows(engine, query.order_by(CheckpointRow.created_at.desc()).limit(limit))  # type: ignore[return-value]


@dataclass(frozen=True)
class TenantCounts:
    tenant: str
    sessions: int
    live_sessions: int
    training_runs: int
    checkpoints: int
    checkpoint_bytes: int


def tenant_counts(engine: Engine) -> list[TenantCounts]:
    """Per tenant with anything registered (every tenant: the operator view only)."""
    found: dict[str, dict[str, int]] = {}
    with Session(engine) as db:
        for tenant, total, live in db.execute(
            select(
                SessionRow.tenant,
                func.count(),
                func.count(SessionRow.id).filter(SessionRow.finished_at.is_(None)),
            ).group_by(SessionRow.tenant)
        ):
            found.setdefault(tenant, {}).update(sessions=total, live_sessions=live)
        for tenant, runs in db.execute(
            select(TrainingRunRow.tenant, func.count()).group_by(TrainingRunRow.tenant)
        ):
            found.setdefault(tenant, {})["training_runs"] = runs
        for tenant, count, size in db.execute(
            select(
                CheckpointRow.tenant,
                func.count(),
                func.coalesce(func.sum(CheckpointRow.size_bytes), 0),
            ).group_by(CheckpointRow.tenant)
        ):
            found.setdefault(tenant, {}).update(checkpoints=count, checkpoint_bytes=int(size))
    return [
        TenantCounts(
            tenant,
            int(v.get("sessions", 0)),
            int(v.get("live_sessions", 0)),
            int(v.get("training_runs", 0)),
            int(v.get("checkpoints", 0)),
            int(v.get("checkpoint_bytes", 0)),
        )
        for tenant, v in sorted(found.items())
    ]
