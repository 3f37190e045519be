"""The operator view (admin keys only): every tenant's counts, quotas and usage, and the
engine's state.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tuneloop.server.api.console.auth import COOKIE, Viewer, viewer_of
from tuneloop.server.api.console.engine_state import engine_state
from tuneloop.server.api.console.render import curves_of, page, sign_in_redirect, signed_in
from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.state import get_state
from tuneloop.server.api.usage_report import hour_range
from tuneloop.server.storage import console_views
from tuneloop.server.storage.registry import UsageFilter, utcnow

__all__ = ["router"]

router = APIRouter(prefix="/console", include_in_schema=False)

# ---- operator --------------------------------------------------------------------------------


def _admin(request: Request) -> Viewer:
    viewer = signed_in(request)
    if not viewer.admin:
        raise ApiError(403, "the operator view needs an admin key (keys create --admin)", COOKIE)
    return viewer


def _operator(request: Request) -> dict[str, Any]:
    state = get_state(request)
    counts = {c.tenant: c for c in console_views.tenant_counts(state.registry.engine)}
    tenants = sorted(set(counts) | {r.tenant for r in state.keys.list()})
    since_hour, _ = hour_range(utcnow() - timedelta(hours=24), None)
    usage: dict[str, dict[str, int]] = {
        t: {"prefill_tokens": 0, "sampled_tokens": 0, "trained_tokens": 0} for t in tenants
    }
    for row in state.registry.usage_sums(UsageFilter(since_hour=since_hour)):  # every tenant
        totals = usage.setdefault(
            row.tenant, {"prefill_tokens": 0, "sampled_tokens": 0, "trained_tokens": 0}
        )
        totals["prefill_tokens"] += row.prefill_tokens
        totals["sampled_tokens"] += row.sampled_tokens
        totals["trained_tokens"] += row.trained_tokens
    curves = curves_of(request)
    rows = [
        {
            "tenant": t,
            "counts": counts.get(t),
            "limits": state.quotas.limits(t),
            "inflight": state.futures.pending(t),
            "usage_24h": usage[t],
            "tokens_per_s": curves.tokens_per_s(t),
        }
        for t in tenants
    ]
    return {"tenants": rows, "engine": engine_state(state, curves)}


@router.get("/operator")
async def operator_page(request: Request) -> Response:
    if viewer_of(request) is None:
        return sign_in_redirect()
    viewer = _admin(request)
    await get_state(request).meter.flush_async(get_state(request).registry)
    return page(request, "operator.html", viewer, **_operator(request))


@router.get("/fragments/operator")
async def operator_fragment(request: Request) -> Response:
    viewer = _admin(request)
    return page(request, "_operator_tables.html", viewer, **_operator(request))


@router.get("/data/engine")
async def engine_data(request: Request) -> Any:
    _admin(request)
    return JSONResponse(engine_state(get_state(request), curves_of(request)).as_json())
