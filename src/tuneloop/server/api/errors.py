"""API errors: one exception type, mapped once to a JSON body that names the field."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_KINDS = {
    400: "invalid_request",
    401: "authentication",
    403: "permission",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    410: "gone",
    413: "too_large",
    415: "unsupported_media_type",
    429: "rate_limited",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        detail: str,
        field: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.field = field
        # More response headers (e.g. retry-after) and body fields (e.g. a quota's limit).
        self.headers = headers or {}
        self.extra = extra or {}


def bad_request(detail: str, field: str | None = None) -> ApiError:
    return ApiError(400, detail, field)


def not_found(what: str, field: str | None = None) -> ApiError:
    return ApiError(404, f"{what} not found", field)


def error_response(
    status: int,
    detail: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    body = {**(extra or {}), "detail": detail, "field": field, "type": _KINDS.get(status, "error")}
    return JSONResponse(body, status_code=status, headers=_headers(status, headers))


def _headers(status: int, headers: dict[str, str] | None) -> dict[str, str]:
    # A 4xx is final: x-should-retry stops the SDKs' HTTP-layer retries; never an empty body.
    final = {"x-should-retry": "false"} if status < 500 and status not in (408, 429) else {}
    return {**final, **(headers or {})}


# The OpenAI-compatible routes answer in OpenAI's error shape, which its clients parse.
OPENAI_PREFIX = "/oai/"
_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def openai_error_body(
    status: int, detail: str, field: str | None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`{"error": {message, type, param, code}}`; code is the kind this API names elsewhere,
    and `extra` (a quota's limit, a restart's reason) rides along."""
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {
        "error": {
            **(extra or {}),
            "message": detail,
            "type": kind,
            "param": field,
            "code": _KINDS.get(status, "error"),
        }
    }


def error_response_for(
    path: str,
    status: int,
    detail: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    """The error in the shape the route at `path` speaks (OpenAI's under /oai/)."""
    if not path.startswith(OPENAI_PREFIX):
        return error_response(status, detail, field, headers, extra)
    body = openai_error_body(status, detail, field, extra)
    return JSONResponse(body, status_code=status, headers=_headers(status, headers))


def _location(loc: tuple[int | str, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for part in parts:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out or "body"


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response_for(
            request.url.path, exc.status, exc.detail, exc.field, exc.headers, exc.extra
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        field = _location(tuple(first.get("loc", ())))
        return error_response_for(
            request.url.path, 400, f"{field}: {first.get('msg', 'invalid')}", field
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response_for(request.url.path, exc.status_code, str(exc.detail))
