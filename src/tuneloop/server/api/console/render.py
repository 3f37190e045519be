"""What every console route shares: the templates, security headers, the sign-in checks, form
parsing, and whether this server is a deployment."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from tuneloop.server.api.console.auth import COOKIE, CSRF_FIELD, Viewer, viewer_of
from tuneloop.server.api.console.curves import RunCurves
from tuneloop.server.api.errors import ApiError, not_found
from tuneloop.server.api.state import get_state

__all__ = [
    "HERE",
    "SECURITY_HEADERS",
    "STATIC",
    "curves_of",
    "is_deployment",
    "not_in_deployment",
    "page",
    "read_form",
    "same_origin",
    "sign_in_redirect",
    "signed_in",
    "templates",
]

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
    # Not "no-referrer": with it a browser sends "Origin: null" on the forms, which same_origin
    # refuses; pages link nowhere else, so the referrer never leaves the server.
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


def curves_of(request: Request) -> RunCurves:
    curves: RunCurves = request.app.state.run_curves
    return curves


def is_deployment(request: Request) -> bool:
    """A `tuneloop deploy` server: OpenAI routes only, so no runs or checkpoints to show."""
    return bool(get_state(request).config.openai_only)


def not_in_deployment(request: Request) -> None:
    if is_deployment(request):
        raise not_found("this page on a deployment (it serves the OpenAI routes only)", "path")


def page(request: Request, template: str, viewer: Viewer | None, **context: Any) -> Response:
    response = templates.TemplateResponse(
        request,
        template,
        {
            "viewer": viewer,
            "csrf_field": CSRF_FIELD,
            "deployment": is_deployment(request),
            **context,
        },
    )
    response.headers.update(SECURITY_HEADERS)
    return response


def signed_in(request: Request) -> Viewer:
    viewer = viewer_of(request)
    if viewer is None:
        raise ApiError(401, "not signed in to the console: sign in with an API key", COOKIE)
    return viewer


def sign_in_redirect() -> Response:
    return RedirectResponse("/console/sign-in", status_code=303)


def same_origin(request: Request) -> None:
    """403 for a post another site's page made (the browser names that page's origin). Besides
    the CSRF token, this stops a forged sign-in, which has no token to check: another site
    signing the browser in with the attacker's key."""
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.url.netloc}"
    if origin is not None and origin != own:
        raise ApiError(403, f"origin: a console form posted from {origin!r}", "origin")


async def read_form(request: Request) -> dict[str, str]:
    """The fields of a same-origin form post (the stdlib's parser: no multipart is needed)."""
    same_origin(request)
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
