"""The console's checkpoint pages: the tenant's model packages, signed download links of an
adapter export, and delete behind a confirmation page and a CSRF token.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from tuneloop.server.api.console.auth import CSRF_FIELD, Viewer, check_csrf, viewer_of
from tuneloop.server.api.console.pages import checkpoint_view
from tuneloop.server.api.console.render import (
    not_in_deployment,
    page,
    read_form,
    sign_in_redirect,
    signed_in,
)
from tuneloop.server.api.downloads import _WHY_NOT, checkpoint_files, signed_url, url_signer
from tuneloop.server.api.errors import bad_request, not_found
from tuneloop.server.api.state import get_state
from tuneloop.server.storage import console_views
from tuneloop.server.storage.layout import TinkerPath
from tuneloop.server.storage.registry import utcnow

__all__ = ["router"]

router = APIRouter(prefix="/console", include_in_schema=False)


@router.get("/checkpoints")
async def checkpoints_page(request: Request) -> Response:
    not_in_deployment(request)
    viewer = viewer_of(request)
    if viewer is None:
        return sign_in_redirect()
    rows = console_views.checkpoints(get_state(request).registry.engine, viewer.tenant)
    return page(request, "checkpoints.html", viewer, checkpoints=[checkpoint_view(r) for r in rows])


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
    not_in_deployment(request)
    viewer = signed_in(request)
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
    return page(
        request,
        "download.html",
        viewer,
        checkpoint=checkpoint_view(row),
        files=files,
        expires=utcnow() + timedelta(seconds=signer.ttl_s),
    )


@router.get("/checkpoints/delete")
async def delete_confirm_page(request: Request, path: str) -> Response:
    not_in_deployment(request)
    viewer = viewer_of(request)
    if viewer is None:
        return sign_in_redirect()
    _parsed, row = _checkpoint(request, viewer, path)
    return page(request, "delete.html", viewer, checkpoint=checkpoint_view(row))


@router.post("/checkpoints/delete")
async def delete_checkpoint(request: Request) -> Response:
    not_in_deployment(request)
    viewer = signed_in(request)
    form = await read_form(request)
    check_csrf(viewer, form.get(CSRF_FIELD))
    parsed, _row = _checkpoint(request, viewer, form.get("path", ""))
    get_state(request).registry.remove_checkpoint(str(parsed), viewer.tenant)
    return RedirectResponse("/console/checkpoints", status_code=303)
