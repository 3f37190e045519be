"""The console's usage page and its chart's data: the tenant's tokens per hour and operation."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tuneloop.server.api.console.auth import viewer_of
from tuneloop.server.api.console.render import page, sign_in_redirect, signed_in
from tuneloop.server.api.errors import bad_request
from tuneloop.server.api.metering import OPERATIONS
from tuneloop.server.api.state import get_state
from tuneloop.server.api.usage_report import build_report, hour_range, parse_time
from tuneloop.server.storage.registry import UsageFilter, utcnow

__all__ = ["router"]

router = APIRouter(prefix="/console", include_in_schema=False)

# ---- usage -----------------------------------------------------------------------------------


def _usage(request: Request, tenant: str | None, since: str) -> dict[str, Any]:
    try:
        start = parse_time(since, utcnow())
    except ValueError as exc:
        raise bad_request(f"since: {exc}", "since") from None
    since_hour, until_hour = hour_range(start, None)
    state = get_state(request)
    sums = state.registry.usage_sums(UsageFilter(tenant, None, None, since_hour, until_hour))
    report = build_report(sums, tenant or "*", bucket="hour", since=start)
    return report.model_dump(mode="json")


@router.get("/usage")
async def usage_page(request: Request, since: str = "7d") -> Response:
    viewer = viewer_of(request)
    if viewer is None:
        return sign_in_redirect()
    await get_state(request).meter.flush_async(get_state(request).registry)
    report = _usage(request, viewer.tenant, since)
    return page(request, "usage.html", viewer, report=report, since=since, operations=OPERATIONS)


@router.get("/data/usage")
async def usage_data(request: Request, since: str = "7d") -> Any:
    viewer = signed_in(request)
    await get_state(request).meter.flush_async(get_state(request).registry)
    return _usage(request, viewer.tenant, since)
