"""Request dependencies: the caller's tenant, and JSON bodies parsed with field-named errors."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import Depends, Query, Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from tuneloop.server.api.auth_tokens import looks_like_jwt
from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.revocation import CALLER_KEY
from tuneloop.server.api.state import ServerState, get_state
from tuneloop.types.fields import parse_json

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
    state = get_state(request)
    if looks_like_jwt(key):
        if state.token_issuer is None:
            raise ApiError(
                401, "tokens are not accepted: this server runs without --jwt", "X-API-Key"
            )
        record = state.token_issuer.verify(key, state.keys)
    else:
        found = state.keys.record_of(key)
        if found is None:
            raise ApiError(401, "invalid or revoked API key", "X-API-Key")
        record = found
        request.state.api_key_record = record  # what /auth/token issues a token for
    # Key use is audited, once an hour per key: not a database write per request.
    state.audit.record_once(
        ("key", record.key_id), record.tenant, "key_used", window_s=3600, key_id=record.key_id
    )
    request.state.tenant = record.tenant  # for the access log and the request metrics
    # What this request submits is tracked under its key (a token's under the key it was
    # issued for), and long requests (long-polls, OpenAI generations) check the key again
    # while they wait (see revocation.py).
    CALLER_KEY.set(record.key_sha256)
    return record.tenant


Tenant = Annotated[str, Depends(authenticate)]
State = Annotated[ServerState, Depends(get_state)]


# Databases hold 64-bit signed integers: a larger offset would fail in the driver (a 500)
# instead of answering 400 here; 2**62 is far past any real listing.
MAX_OFFSET = 2**62
Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET)]


def require_content_type(request: Request, expected: str) -> None:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != expected:
        raise ApiError(
            415, f"Content-Type must be {expected}, got {content_type or 'none'}", "content-type"
        )


def _inline_refs(node: Any, defs: dict[str, Any], seen: tuple[str, ...] = ()) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            if name in seen:  # no wire type is recursive; refuse rather than loop
                raise ValueError(f"recursive schema {name} cannot be inlined")
            return _inline_refs(defs[name], defs, (*seen, name))
        # A discriminator's mapping names $defs too; the inlined oneOf needs none (each branch
        # pins `type` with a const).
        return {
            k: _inline_refs(v, defs, seen)
            for k, v in node.items()
            if k not in ("$defs", "discriminator")
        }
    if isinstance(node, list):
        return [_inline_refs(v, defs, seen) for v in node]
    return node


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` declaring a route's JSON body as `model`, for handlers using `read_json`.

    Handlers read the raw body themselves (training routes need it even when it fails to
    parse, see seq_guard), so FastAPI cannot see the body type; this puts it in the OpenAPI
    document. The schema is self-contained ($defs inlined): the document has no place for
    pydantic's `#/$defs/...` references.
    """
    schema = model.model_json_schema(mode="validation")
    inlined = _inline_refs(schema, schema.get("$defs", {}))
    required = any(field.is_required() for field in model.model_fields.values())
    content = {"application/json": {"schema": inlined}}
    return {"requestBody": {"required": required, "content": content}}


def protobuf_body(message: str, description: str) -> dict[str, Any]:
    """`openapi_extra` for a protobuf body (`message` of tuneloop.types.proto), maybe zstd."""
    schema = {"type": "string", "format": "binary", "description": f"{message}: {description}"}
    return {
        "requestBody": {"required": True, "content": {"application/x-protobuf": {"schema": schema}}}
    }


# Bodies larger than this are parsed on a worker thread: parsing a 64 MB body takes the event
# loop ~0.5 s, during which no other tenant's request (a health check, a poll) is answered.
# Below it, parsing takes well under a millisecond, less than handing it to a thread.
OFF_LOOP_BYTES = 256 * 1024


async def off_loop(nbytes: int, fn: Any, *args: Any) -> Any:
    """`fn(*args)`, on a worker thread when it works on `nbytes` or more bytes."""
    if nbytes >= OFF_LOOP_BYTES:
        return await run_in_threadpool(fn, *args)
    return fn(*args)


async def read_json(request: Request, model: type[M]) -> tuple[M, bytes]:
    """Parse the body into `model` (strictly: see tuneloop.types.fields); a 400 names the
    first offending field."""
    body = await request.body()
    require_content_type(request, "application/json")
    try:
        parsed: M = await off_loop(len(body), parse_json, model, body or b"{}")
        return parsed, body
    except ValidationError as exc:
        first = exc.errors()[0]
        field = _field(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            raise ApiError(400, f"body is not valid JSON: {first.get('msg')}", "body") from None
        raise ApiError(400, f"{field}: {first.get('msg')}", field) from None
