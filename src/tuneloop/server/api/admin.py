"""What the official SDK's AdminClient (and RestClient's deprecated copies) read: the audit log,
billing usage events from the metering tables, and current checkpoint storage per project.

Billing carries quantities only: a self-hosted server has no price list, so every cost and rate
field is null. There are no storage (GB-hour) events: the registry keeps what is stored now,
not how long it was stored; `/billing/usage/checkpoints/current` reports that.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, date, datetime, timedelta
from typing import Any

from fastapi import APIRouter

from tuneloop.server.api.deps import State, Tenant
from tuneloop.server.api.errors import bad_request
from tuneloop.server.api.projects import check_project_id
from tuneloop.server.api.session_search import owner_urn
from tuneloop.server.storage.audit import EVENT_GROUPS
from tuneloop.server.storage.billing import BillingReader
from tuneloop.server.storage.registry import utcnow

__all__ = ["MAX_WINDOW", "router"]

router = APIRouter(prefix="/api/v1")
MAX_WINDOW = timedelta(days=14)
GIGABYTE = 10**9


@router.get("/audit")
async def audit_log(
    state: State, tenant: Tenant, event_type: str = "all", day: date | None = None
) -> dict[str, Any]:
    """The caller's audit events of one UTC day (default: today), oldest first."""
    if event_type not in EVENT_GROUPS:
        raise bad_request(f"event_type: must be one of {', '.join(EVENT_GROUPS)}", "event_type")
    start = datetime.combine(day or utcnow().date(), datetime.min.time(), UTC)
    rows = await asyncio.to_thread(
        state.audit.entries, tenant, start, start + timedelta(days=1), event_type
    )
    entries = []
    for row in rows:
        entry: dict[str, Any] = {
            "timestamp": row.at.isoformat(),
            "event": row.event,
            "event_details": {"actor": owner_urn(tenant), **row.details},
        }
        if row.event.startswith("checkpoint_") and "tinker_path" in row.details:
            entry["tinker_path"] = row.details["tinker_path"]
            entry["model_id"] = str(row.details["tinker_path"]).removeprefix("tinker://")
            entry["model_id"] = entry["model_id"].split("/")[0]
        entries.append(entry)
    return {"entries": entries}


def _hour_aligned(value: datetime, field: str) -> datetime:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    if value.minute or value.second or value.microsecond:
        raise bad_request(f"{field}: must be on a UTC hour boundary", field)
    return value.astimezone(UTC)


def _bucket(start: datetime) -> dict[str, str]:
    return {
        "bucket_start": start.isoformat(),
        "bucket_end": (start + timedelta(hours=1)).isoformat(),
    }


@router.get("/billing/usage/events")
async def billing_usage(
    state: State, tenant: Tenant, starting_on: datetime, ending_before: datetime
) -> dict[str, Any]:
    """Hourly usage buckets of the caller in [starting_on, ending_before): training tokens,
    sampling prefill and sampled tokens, checkpoints saved; per session, with its project."""
    start = _hour_aligned(starting_on, "starting_on")
    end = _hour_aligned(ending_before, "ending_before")
    if start > utcnow():
        raise bad_request("starting_on: must not be in the future", "starting_on")
    if not start < end <= start + MAX_WINDOW:
        raise bad_request(
            "ending_before: must be after starting_on, by at most 14 days", "ending_before"
        )
    # What is still counted in memory first: the answer includes every completed operation.
    await state.meter.flush_async(state.registry)
    reader = BillingReader(state.registry.engine)
    rows = await asyncio.to_thread(
        reader.usage_rows, tenant, int(start.timestamp()), int(end.timestamp())
    )
    saved = await asyncio.to_thread(reader.checkpoints_saved, tenant, start, end)
    models = reader.base_models({r.model_id for r in rows})
    sessions = sorted({r.session_id for r in rows} | {s for _, s in saved})
    projects = state.projects.projects_of_sessions(sessions)
    data: list[dict[str, Any]] = []

    def event(hour: datetime, session: str, base_model: str | None, info: dict[str, Any]) -> None:
        data.append(
            {
                **_bucket(hour),
                "base_model": base_model,
                "user_id": owner_urn(tenant),
                "session_id": session,
                "project_id": projects.get(session),
                "event_info": info,
            }
        )

    for r in rows:
        hour = datetime.fromtimestamp(r.hour, UTC)
        model = models.get(r.model_id)
        if r.operation == "sample":
            if r.prefill_tokens:
                info = {
                    "type": "sampling_prefill",
                    "cached": False,
                    "token_count": r.prefill_tokens,
                }
                event(hour, r.session_id, model, info)
            if r.sampled_tokens:
                info = {"type": "sampling_sample", "token_count": r.sampled_tokens}
                event(hour, r.session_id, model, info)
        else:  # forward_backward and forward: tokens through the training model
            tokens = r.trained_tokens or r.prefill_tokens
            if tokens:
                event(hour, r.session_id, model, {"type": "training", "token_count": tokens})
    counts: dict[tuple[datetime, str, str | None], int] = {}
    for ckpt, session in saved:
        hour = ckpt.created_at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
        key = (hour, session, ckpt.base_model)
        counts[key] = counts.get(key, 0) + 1
    for (hour, session, model), count in counts.items():
        event(hour, session, model, {"type": "checkpoint", "count": count})
    data.sort(key=lambda e: (e["bucket_start"], -int(e["event_info"].get("token_count", 0))))
    by_id = {s: state.registry.session(s, tenant) for s in sessions}
    return {
        "data": data,
        "sessions": {
            s: {
                "user_metadata": {k: str(v) for k, v in (row.user_metadata or {}).items()}
                if row is not None and row.user_metadata
                else None
            }
            for s, row in by_id.items()
        },
        "cost_data_through": None,
    }


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage(
    state: State, tenant: Tenant, project_id: str | None = None
) -> dict[str, Any]:
    """The caller's stored checkpoints now, per project (or of one project)."""
    if project_id is not None:
        check_project_id(project_id)
    totals = await asyncio.to_thread(state.projects.checkpoint_storage, tenant, project_id)
    return {
        "effective_rate_usd_per_gigabyte_month": None,
        "data": [
            {
                "project_id": project,
                "org_user_urn": owner_urn(tenant),
                "checkpoint_count": count,
                "size_bytes": size,
                "size_gigabytes": size / GIGABYTE,
            }
            for project, (count, size) in sorted(totals.items())
        ],
    }
