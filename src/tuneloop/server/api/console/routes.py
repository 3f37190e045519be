"""The console's routes: server-rendered pages under /console, their htmx fragments and the
small JSON data routes the charts poll. Every route answers for the signed-in key's tenant only;
the operator page and its data route need an admin key.
"""

from __future__ import annotations

import json
import urllib.parse
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from tuneloop.server.api.console.auth import (
    COOKIE,
    CSRF_FIELD,
    CSRF_HEADER,
    Viewer,
    check_csrf,
    clear_cookie,
    set_cookie,
    viewer_for_key,
    viewer_of,
)
from tuneloop.server.api.console.curves import RunCurves
from tuneloop.server.api.console.engine_state import engine_state
from tuneloop.server.api.console.pages import checkpoint_view, overview, run_view
from tuneloop.server.api.downloads import _WHY_NOT, checkpoint_files, signed_url, url_signer
from tuneloop.server.api.errors import ApiError, bad_request, not_found
from tuneloop.server.api.metering import OPERATIONS
from tuneloop.server.api.state import ServerState, get_state
from tuneloop.server.api.usage_report import build_report, hour_range, parse_time
from tuneloop.server.storage import console_views
from tuneloop.server.storage.layout import TinkerPath
from tuneloop.server.storage.registry import UsageFilter, utcnow

__all__ = ["router"]

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
templates.env.filters["bytes"] = lambda n: (
    f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 1024 else f"{n} B"
)
templates.env.filters["when"] = lambda t: t.strftime("%Y-%m-%d %H:%M:%S UTC") if t else "-"
templates.env.filters["limit"] = lambda n: "unlimited" if n == 0 else str(n)
STATIC = {
    "htmx.min.js": "text/javascript",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "console.js": "text/javascript",
    "console.css": "text/css",
}
# Pages load scripts and styles from here only: no inline script, no other origin, no framing.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
PLAYGROUND_KINDS = ("sampler", "adapter", "training-state")

router = APIRouter(prefix="/console", include_in_schema=False)


def curves_of(request: Request) -> RunCurves:
    curves: RunCurves = request.app.state.run_curves
    return curves


def _deployment(request: Request) -> bool:
    """A `tuneloop deploy` server: OpenAI routes only, so no runs or checkpoints to show."""
    return bool(get_state(request).config.openai_only)


def _not_in_deployment(request: Request) -> None:
    if _deployment(request):
        raise not_found("this page on a deployment (it serves the OpenAI routes only)", "path")


def _page(request: Request, template: str, viewer: Viewer | None, **context: Any) -> Response:
    response = templates.TemplateResponse(
        request,
        template,
        {
            "viewer": viewer,
            "csrf_field": CSRF_FIELD,
            "deployment": _deployment(request),
            **context,
        },
    )
    response.headers.update(SECURITY_HEADERS)
    return response


def _signed_in(request: Request) -> Viewer:
    viewer = viewer_of(request)
    if viewer is None:
        raise ApiError(401, "not signed in to the console: sign in with an API key", COOKIE)
    return viewer


def _sign_in_redirect() -> Response:
    return RedirectResponse("/console/sign-in", status_code=303)


async def _form(request: Request) -> dict[str, str]:
    """The fields of a form post (the stdlib's parser: no multipart is ever needed here)."""
    body = await request.body()
    if not body:
        return {}
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/x-www-form-urlencoded":
        raise ApiError(
            415, "Content-Type must be application/x-www-form-urlencoded", "content-type"
        )
    fields = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
    return {name: values[0] for name, values in fields.items()}


# ---- sign-in -------------------------------------------------------------------------------


@router.get("/sign-in")
async def sign_in_page(request: Request) -> Response:
    return _page(request, "sign_in.html", None, error=None)


@router.post("/sign-in")
async def sign_in(request: Request) -> Response:
    key = (await _form(request)).get("api_key", "").strip()
    viewer = viewer_for_key(request, key) if key else None
    if viewer is None:
        response = _page(request, "sign_in.html", None, error="That key is unknown or revoked.")
        response.status_code = 401
        return response
    response = RedirectResponse("/console", status_code=303)
    set_cookie(request, response, key)
    return response


@router.post("/sign-out")
async def sign_out(request: Request) -> Response:
    viewer = _signed_in(request)
    check_csrf(viewer, (await _form(request)).get(CSRF_FIELD))
    response = _sign_in_redirect()
    clear_cookie(request, response)
    return response


# ---- the tenant's pages ------------------------------------------------------------------


@router.get("")
async def home(request: Request) -> Response:
    viewer = viewer_of(request)
    if viewer is None:
        return _sign_in_redirect()
    if _deployment(request):
        return RedirectResponse("/console/playground", status_code=303)
    return _page(request, "overview.html", viewer, **overview(get_state(request), viewer.tenant))


@router.get("/fragments/overview")
async def overview_fragment(request: Request) -> Response:
    _not_in_deployment(request)
    viewer = _signed_in(request)
    return _page(
        request, "_overview_tables.html", viewer, **overview(get_state(request), viewer.tenant)
    )


def _run_or_404(state: ServerState, run_id: str, tenant: str) -> Any:
    run = state.registry.training_run(run_id, tenant)
    if run is None:
        raise not_found(f"training run {run_id!r}", "run_id")
    return run


@router.get("/runs/{run_id}")
async def run_page(run_id: str, request: Request) -> Response:
    _not_in_deployment(request)
    viewer = viewer_of(request)
    if viewer is None:
        return _sign_in_redirect()
    state = get_state(request)
    run = _run_or_404(state, run_id, viewer.tenant)
    rows = console_views.checkpoints(state.registry.engine, viewer.tenant, run.id)
    return _page(
        request,
        "run.html",
        viewer,
        run=run_view(run),
        checkpoints=[checkpoint_view(r) for r in rows],
    )


@router.get("/data/runs/{run_id}/points")
async def run_points(run_id: str, request: Request, after: int = Query(0, ge=0)) -> Any:
    """The run's per-step points added after row id `after` (0: all kept), and its step."""
    _not_in_deployment(request)
    viewer = _signed_in(request)
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


@router.get("/checkpoints")
async def checkpoints_page(request: Request) -> Response:
    _not_in_deployment(request)
    viewer = viewer_of(request)
    if viewer is None:
        return _sign_in_redirect()
    rows = console_views.checkpoints(get_state(request).registry.engine, viewer.tenant)
    return _page(
        request, "checkpoints.html", viewer, checkpoints=[checkpoint_view(r) for r in rows]
    )


def _checkpoint(request: Request, viewer: Viewer, path: str) -> Any:
    try:
        parsed = TinkerPath.parse(path)
    except ValueError as exc:
        raise bad_request(f"path: {exc}", "path") from None
    row = get_state(request).registry.checkpoint(str(parsed), viewer.tenant)
    if row is None:
        raise not_found(f"checkpoint {path!r}", "path")
    return parsed, row


@router.get("/checkpoints/download")
def download_page(request: Request, path: str) -> Response:
    """Signed links to each file of an adapter export (the same URLs the SDKs get). A plain
    `def`: FastAPI runs it in a worker thread, so walking the folder blocks no one."""
    _not_in_deployment(request)
    viewer = _signed_in(request)
    parsed, row = _checkpoint(request, viewer, path)
    if parsed.segment not in ("external_weights",):
        raise bad_request(f"path: {_WHY_NOT[parsed.segment]}", "path")
    if row.expires_at is not None and row.expires_at <= utcnow():
        raise not_found(f"checkpoint {path!r} (expired)", "path")
    directory = Path(row.directory)
    if not directory.is_dir():
        raise not_found(f"the files of checkpoint {path!r}", "path")
    signer = url_signer(request, get_state(request))
    expires = signer.expiry()
    base = str(request.base_url).rstrip("/")
    files = [
        (
            name,
            (directory / name).stat().st_size,
            signed_url(signer, base, viewer.tenant, parsed, name, expires),
        )
        for name in checkpoint_files(directory)
    ]
    return _page(
        request,
        "download.html",
        viewer,
        checkpoint=checkpoint_view(row),
        files=files,
        expires=utcnow() + timedelta(seconds=signer.ttl_s),
    )


@router.get("/checkpoints/delete")
async def delete_confirm_page(request: Request, path: str) -> Response:
    _not_in_deployment(request)
    viewer = viewer_of(request)
    if viewer is None:
        return _sign_in_redirect()
    _parsed, row = _checkpoint(request, viewer, path)
    return _page(request, "delete.html", viewer, checkpoint=checkpoint_view(row))


@router.post("/checkpoints/delete")
async def delete_checkpoint(request: Request) -> Response:
    _not_in_deployment(request)
    viewer = _signed_in(request)
    form = await _form(request)
    check_csrf(viewer, form.get(CSRF_FIELD))
    parsed, _row = _checkpoint(request, viewer, form.get("path", ""))
    get_state(request).registry.remove_checkpoint(str(parsed), viewer.tenant)
    return RedirectResponse("/console/checkpoints", status_code=303)


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
        return _sign_in_redirect()
    await get_state(request).meter.flush_async(get_state(request).registry)
    report = _usage(request, viewer.tenant, since)
    return _page(request, "usage.html", viewer, report=report, since=since, operations=OPERATIONS)


@router.get("/data/usage")
async def usage_data(request: Request, since: str = "7d") -> Any:
    viewer = _signed_in(request)
    await get_state(request).meter.flush_async(get_state(request).registry)
    return _usage(request, viewer.tenant, since)


# ---- playground ------------------------------------------------------------------------------


@router.get("/playground")
async def playground_page(request: Request) -> Response:
    viewer = viewer_of(request)
    if viewer is None:
        return _sign_in_redirect()
    state = get_state(request)
    rows = console_views.checkpoints(state.registry.engine, viewer.tenant)
    choices = [
        checkpoint_view(r)
        for r in rows
        if r.kind in PLAYGROUND_KINDS and r.base_model in state.models
    ]
    return _page(
        request, "playground.html", viewer, base_models=sorted(state.models), checkpoints=choices
    )


@router.post("/data/chat")
async def playground_chat(request: Request) -> Response:
    """One chat completion through the server's own /oai route, as the signed-in key (which
    the page's script cannot read: the cookie is HttpOnly)."""
    viewer = _signed_in(request)
    check_csrf(viewer, request.headers.get(CSRF_HEADER))
    body = await request.body()
    try:
        streamed = json.loads(body).get("stream") if body else None
    except (ValueError, AttributeError):
        streamed = None  # the OpenAI route answers malformed JSON with its own 400
    if streamed:
        raise bad_request("stream: the playground asks for whole answers", "stream")
    key = request.cookies[COOKIE]
    transport = httpx.ASGITransport(app=request.app)
    async with httpx.AsyncClient(transport=transport, base_url=str(request.base_url)) as client:
        answer = await client.post(
            "/oai/api/v1/chat/completions",
            content=body,
            headers={
                "authorization": f"Bearer {key}",
                "content-type": request.headers.get("content-type", ""),
            },
            timeout=None,
        )
    return Response(answer.content, answer.status_code, media_type="application/json")


# ---- operator --------------------------------------------------------------------------------


def _admin(request: Request) -> Viewer:
    viewer = _signed_in(request)
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
        return _sign_in_redirect()
    viewer = _admin(request)
    await get_state(request).meter.flush_async(get_state(request).registry)
    return _page(request, "operator.html", viewer, **_operator(request))


@router.get("/fragments/operator")
async def operator_fragment(request: Request) -> Response:
    viewer = _admin(request)
    return _page(request, "_operator_tables.html", viewer, **_operator(request))


@router.get("/data/engine")
async def engine_data(request: Request) -> Any:
    _admin(request)
    return JSONResponse(engine_state(get_state(request), curves_of(request)).as_json())


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
