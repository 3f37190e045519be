"""Console sign-in: the API key in an HttpOnly, SameSite=Strict cookie, and CSRF tokens.

The key arrives once, in the body of the sign-in form's POST (never in a URL, so never in an
access log or the browser's history), and is then kept in a cookie the page's scripts cannot
read (HttpOnly), that no other site's page can make the browser send (SameSite=Strict), and that
travels only over https when the console is served over https (Secure). Each request looks the
key up again, so a revoked key signs the console out at once.

State-changing console requests (delete, sign-out, the playground's chat) also carry a CSRF
token: an HMAC of the key's hash under a random secret of the server (`console_csrf.key` in the
data dir, made like the URL-signing key), put in the page. Another
site cannot read it, so it cannot forge such a request even where a browser ignores SameSite.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from fastapi import Request, Response

from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.signing import load_or_create_secret
from tuneloop.server.api.state import get_state

__all__ = ["COOKIE", "Viewer", "check_csrf", "clear_cookie", "set_cookie", "viewer_of"]

COOKIE = "tuneloop_console"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
# A browser keeps the cookie this long; the key itself stays valid until revoked.
COOKIE_MAX_AGE_S = 12 * 3600
CSRF_SECRET_FILE = "console_csrf.key"


@dataclass(frozen=True)
class Viewer:
    """Who is signed in: the key's tenant, whether it is an operator's, and its CSRF token."""

    tenant: str
    admin: bool
    key_id: str
    csrf: str


def _csrf_token(request: Request, key: str) -> str:
    secret: bytes | None = getattr(request.app.state, "console_csrf_secret", None)
    if secret is None:
        secret = load_or_create_secret(get_state(request).layout.data_dir / CSRF_SECRET_FILE)
        request.app.state.console_csrf_secret = secret
    digest = hashlib.sha256(key.encode()).hexdigest()
    return hmac.new(secret, f"console-csrf:{digest}".encode(), hashlib.sha256).hexdigest()


def viewer_for_key(request: Request, key: str) -> Viewer | None:
    record = get_state(request).keys.record_of(key)
    if record is None:
        return None
    return Viewer(record.tenant, record.admin, record.key_id, _csrf_token(request, key))


def viewer_of(request: Request) -> Viewer | None:
    """The signed-in viewer, or None (no cookie, or a revoked or unknown key)."""
    key = request.cookies.get(COOKIE)
    return viewer_for_key(request, key) if key else None


def set_cookie(request: Request, response: Response, key: str) -> None:
    response.set_cookie(
        COOKIE,
        key,
        max_age=COOKIE_MAX_AGE_S,
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_cookie(request: Request, response: Response) -> None:
    response.delete_cookie(
        COOKIE,
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def check_csrf(viewer: Viewer, token: str | None) -> None:
    """403 unless `token` is the viewer's CSRF token."""
    if not token or not hmac.compare_digest(token.encode(), viewer.csrf.encode()):
        raise ApiError(
            403, "csrf_token: missing or wrong; reload the page and try again", "csrf_token"
        )
