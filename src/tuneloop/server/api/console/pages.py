"""What the console's pages show, gathered from the registry for one tenant (view models).

Kept apart from the routes so that every page and its htmx fragment render the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tuneloop.server.api.downloads import DOWNLOADABLE
from tuneloop.server.api.state import EXPIRED, ServerState
from tuneloop.server.storage import console_views
from tuneloop.server.storage.layout import TinkerPath
from tuneloop.server.storage.registry import CheckpointRow, TrainingRunRow, lora_targets, utcnow

__all__ = ["CheckpointView", "checkpoint_view", "overview", "run_view", "session_status"]


def session_status(finished_at: datetime | None, finish_reason: str | None) -> str:
    if finished_at is None:
        return "live"
    return "expired" if finish_reason == EXPIRED else "finished"


def run_view(row: TrainingRunRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "session_id": row.session_id,
        "base_model": row.base_model,
        "lora": f"rank {row.lora_rank}, " + "+".join(lora_targets(row)) + f", seed {row.lora_seed}",
        "lora_rank": row.lora_rank,
        "targets": lora_targets(row),
        "steps": row.training_step,
        "created_at": row.created_at,
        "last_request": row.last_request_time,
        "parent": row.parent_path,
    }


@dataclass(frozen=True)
class CheckpointView:
    path: str
    run_id: str
    name: str | None
    version: int | None
    kind: str | None
    checkpoint_type: str
    step: int | None
    size_bytes: int
    created_at: datetime
    expires_at: datetime | None
    parent: str | None
    downloadable: bool

    @property
    def ttl(self) -> str:
        if self.expires_at is None:
            return "never"
        left = (self.expires_at - utcnow()).total_seconds()
        if left <= 0:
            return "expired"
        hours, rest = divmod(int(left), 3600)
        return f"{hours} h {rest // 60} min" if hours else f"{rest // 60} min {rest % 60} s"


def checkpoint_view(row: CheckpointRow) -> CheckpointView:
    segment = TinkerPath.parse(row.tinker_path).segment
    return CheckpointView(
        path=row.tinker_path,
        run_id=row.training_run_id,
        name=row.name,
        version=row.version,
        kind=row.kind,
        checkpoint_type=row.checkpoint_type,
        step=row.training_step,
        size_bytes=row.size_bytes,
        created_at=row.created_at,
        expires_at=row.expires_at,
        parent=row.parent_path,
        downloadable=segment == DOWNLOADABLE,
    )


def overview(state: ServerState, tenant: str) -> dict[str, Any]:
    """Sessions, runs and samplers of the tenant, and how much of its quotas it uses."""
    engine = state.registry.engine
    sessions = console_views.sessions(engine, tenant)
    limits = state.quotas.limits(tenant)
    live = state.registry.count_live_sessions(tenant, None)
    return {
        "sessions": [
            {
                "id": s.id,
                "status": session_status(s.finished_at, s.finish_reason),
                "created_at": s.created_at,
                "last_heartbeat": s.last_heartbeat,
                "finished_at": s.finished_at,
                "tags": ", ".join(s.tags or []),
                "sdk_version": s.sdk_version,
            }
            for s in sessions
        ],
        "runs": [run_view(r) for r in console_views.training_runs(engine, tenant)],
        "samplers": console_views.samplers(engine, tenant),
        "quota": {
            "live_sessions": live,
            "max_sessions": limits.max_sessions,
            "inflight": state.futures.pending(tenant),
            "max_inflight": limits.max_inflight,
        },
    }
