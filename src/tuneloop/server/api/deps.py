"""Request dependencies: the caller's tenant, and JSON bodies parsed with field-named errors."""

from __future__ import annotations

from typing import Annotated, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.state import ServerState, get_state

M = TypeVar("M", bound=BaseModel)


def _field(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


async def authenticate(request: Request) -> str:
    """The tenant of the request's key: X-API-Key (Tinker SDKs) or a Bearer token (OpenAI)."""
    key = request.headers.get("x-api-key")
    if key is None:
        auth = request.headers.get("authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None
    if not key:
        raise ApiError(401, "missing API key: send it in the X-API-Key header", "X-API-Key")
    tenant = get_state(request).keys.tenant_of(key)
    if tenant is None:
        raise ApiError(401, "invalid or revoked API key", "X-API-Key")
    return tenant


Tenant = Annotated[str, Depends(authenticate)]
State = Annotated[ServerState, Depends(get_state)]


def require_content_type(request: Request, expected: str) -> None:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != expected:
        raise ApiError(
            415, f"Content-Type must be {expected}, got {content_type or 'none'}", "content-type"
        )


async def read_json(request: Request, model: type[M]) -> tuple[M, bytes]:
    """Parse the body into `model`; a 400 names the first offending field."""
    body = await request.body()
    require_content_type(request, "application/json")
    try:
        return model.model_validate_json(body or b"{}"), body
    except ValidationError as exc:
        first = exc.errors()[0]
        field = _field(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            raise ApiError(400, f"body is not valid JSON: {first.get('msg')}", "body") from None
        raise ApiError(400, f"{field}: {first.get('msg')}", field) from None
