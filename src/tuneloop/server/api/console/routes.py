"""The console's sign-in, its overview and run pages (with the curves' data route), and its
static files. Every route answers for the signed-in key's tenant only.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, RedirectResponse, Response

from tuneloop.server.api.console.auth import (
    CSRF_FIELD,
    check_csrf,
    clear_cookie,
    set_cookie,
    viewer_for_key,
    viewer_of,
)
from tuneloop.server.api.console.pages import checkpoint_view, overview, run_view
from tuneloop.server.api.console.render import (
    HERE,
    STATIC,
    curves_of,
    is_deployment,
    not_in_deployment,
    page,
    read_form,
    sign_in_redirect,
    signed_in,
)
from tuneloop.server.api.errors import not_found
from tuneloop.server.api.state import ServerState, get_state
from tuneloop.server.storage import console_views

__all__ = ["router"]

router = APIRouter(prefix="/console", include_in_schema=False)

# ---- sign-in -------------------------------------------------------------------------------


@router.get("/sign-in")
async def sign_in_page(request: Request) -> Response:
    return page(request, "sign_in.html", None, error=None)


@router.post("/sign-in")
async def sign_in(request: Request) -> Response:
    key = (await read_form(request)).get("api_key", "").strip()
    viewer = viewer_for_key(request, key) if key else None
    if viewer is None:
        response = page(request, "sign_in.html", None, error="That key is unknown or revoked.")
        response.status_code = 401
        return response
    response = RedirectResponse("/console", status_code=303)
    set_cookie(request, response, key)
    return response


@router.post("/sign-out")
async def sign_out(request: Request) -> Response:
    viewer = signed_in(request)
    check_csrf(viewer, (await read_form(request)).get(CSRF_FIELD))
    response = sign_in_redirect()
    clear_cookie(request, response)
    return response


# ---- the tenant's pages ------------------------------------------------------------------


@router.get("")
async def home(request: Request) -> Response:
    viewer = viewer_of(request)
    if viewer is None:
        return sign_in_redirect()
    if is_deployment(request):
        return RedirectResponse("/console/playground", status_code=303)
    return page(request, "overview.html", viewer, **overview(get_state(request), viewer.tenant))


@router.get("/fragments/overview")
async def overview_fragment(request: Request) -> Response:
    not_in_deployment(request)
    viewer = signed_in(request)
    return page(
        request, "_overview_tables.html", viewer, **overview(get_state(request), viewer.tenant)
    )


def _run_or_404(state: ServerState, run_id: str, tenant: str) -> Any:
    run = state.registry.training_run(run_id, tenant)
    if run is None:
        raise not_found(f"training run {run_id!r}", "run_id")
    return run


@router.get("/runs/{run_id}")
async def run_page(run_id: str, request: Request) -> Response:
    not_in_deployment(request)
    viewer = viewer_of(request)
    if viewer is None:
        return sign_in_redirect()
    state = get_state(request)
    run = _run_or_404(state, run_id, viewer.tenant)
    rows = console_views.checkpoints(state.registry.engine, viewer.tenant, run.id)
    return page(
        request,
        "run.html",
        viewer,
        run=run_view(run),
        checkpoints=[checkpoint_view(r) for r in rows],
    )


@router.get("/data/runs/{run_id}/points")
async def run_points(run_id: str, request: Request, after: int = Query(0, ge=0)) -> Any:
    """The run's per-step points added after row id `after` (0: all kept), and its step."""
    not_in_deployment(request)
    viewer = signed_in(request)
    state = get_state(request)
    run = _run_or_404(state, run_id, viewer.tenant)
    points = curves_of(request).store.points(run.id, viewer.tenant, after)
    return {
        "run_id": run.id,
        "training_step": run.training_step,
        "last_request": run.last_request_time.isoformat(),
        "next_after": points[-1][0] if points else after,
        "points": [p.as_json() for _, p in points],
    }


# ---- static files ----------------------------------------------------------------------------


@router.get("/static/{name}")
async def static_file(name: str) -> Response:
    """The vendored scripts and styles (no CDN: the console works offline)."""
    media_type = STATIC.get(name)
    if media_type is None:
        raise not_found(f"static file {name!r}", "name")
    return FileResponse(
        HERE / "static" / name,
        media_type=media_type,
        headers={"cache-control": "public, max-age=3600", "x-content-type-options": "nosniff"},
    )
