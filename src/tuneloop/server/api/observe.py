"""The request observer: every HTTP request's metrics and, when asked for, its access-log line.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which buffers streamed responses):
it times the request to the end of its response, labels it with the route template the router
matched (`/api/v1/training_runs/{run_id}`, never the raw path), and reads the tenant that
authentication left in the request state. What it logs is listed in `access_log.py`: never a
header, a cookie, a query string or a body.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

from starlette.routing import Match

from tuneloop.server.api.access_log import log_request
from tuneloop.server.api.metrics import Metrics

__all__ = ["REQUEST_ID_HEADER", "RequestObserver", "route_template"]

REQUEST_ID_HEADER = "x-request-id"
# A caller's (or proxy's) request id is kept when it looks like one; anything else is replaced,
# so a log line never carries arbitrary client text.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
UNMATCHED = "unmatched"  # a path no route serves: one label value, whatever the path was


def route_template(app: Any, scope: dict[str, Any]) -> str:
    """The template of the route that served (or would serve) `scope`'s path."""
    route = scope.get("route")  # FastAPI puts the matched APIRoute here
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    if isinstance(path, str):
        return path
    # Not routed (refused by a middleware first) or not an APIRoute (a mount): match again.
    partial = None
    for candidate in getattr(app, "routes", ()):
        match, _ = candidate.matches(scope)
        template = getattr(candidate, "path_format", None) or getattr(candidate, "path", None)
        if match is Match.FULL and isinstance(template, str):
            return template
        if match is Match.PARTIAL and partial is None and isinstance(template, str):
            partial = template  # the path matched, the method did not (a 405)
    return partial or UNMATCHED


class RequestObserver:
    def __init__(self, app: Any, metrics: Metrics, routes: Any, access_log: bool) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes  # the FastAPI app, whose routes name the templates
        self.access_log = access_log

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state = scope.setdefault("state", {})
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given if _REQUEST_ID.match(given) else secrets.token_hex(8)
        state["request_id"] = request_id
        status = 500  # what the client gets if the app raises before answering

        async def observed_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if self.access_log:
                    headers = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
                    message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            seconds = time.perf_counter() - started
            route = route_template(self.routes, scope)
            self.metrics.count_request(scope["method"], route, status, seconds)
            if self.access_log:
                log_request(
                    request_id=request_id,
                    method=scope["method"],
                    route=route,
                    path=scope["path"],
                    status=status,
                    seconds=seconds,
                    tenant=state.get("tenant"),
                )
