"""A rejected training request still consumes its seq_id.

The SDKs assign seq_ids when a method is called and never reuse one, so a rejected request that
left a hole in a model's stream would make every later request of that model wait forever. The
guard finds (model_id, seq_id) even in bodies that are cut (over the size limit), compressed or
invalid, and tells the queue to step over that seq_id.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request

from tuneloop.server.api.deps import State, Tenant, off_loop
from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.state import ServerState, fingerprint
from tuneloop.server.api.zstd_body import leading_bytes

_JSON_MODEL_ID = re.compile(rb'"model_id"\s*:\s*"([^"]+)"')
_JSON_SEQ_ID = re.compile(rb'"seq_id"\s*:\s*(\d+)')
# model_id (at most a few hundred bytes) and seq_id open a protobuf body.
_IDS_PREFIX_BYTES = 4096


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


def _leading_proto_ids(raw: bytes) -> tuple[str, int] | None:
    """model_id (field 1) and seq_id (field 2) from the start of a possibly cut protobuf."""
    pos, model_id, seq_id = 0, None, None
    while pos < len(raw) and (model_id is None or seq_id is None):
        tag, pos = _varint(raw, pos)
        if tag == (1 << 3 | 2):
            length, pos = _varint(raw, pos)
            model_id, pos = raw[pos : pos + length].decode(), pos + length
        elif tag == (2 << 3 | 0):
            seq_id, pos = _varint(raw, pos)
        else:
            return None
    return (model_id, seq_id) if model_id is not None and seq_id is not None else None


def _locate(raw: bytes, headers: Any) -> tuple[str, int] | None:
    """Best effort (model_id, seq_id) of a body, JSON or (possibly zstd) protobuf, maybe cut."""
    try:
        if headers.get("content-type", "").startswith("application/x-protobuf"):
            if headers.get("content-encoding", "").lower() == "zstd":
                # Only the start: the ids lead the message, and a small body may expand to
                # gigabytes.
                raw = leading_bytes(raw, _IDS_PREFIX_BYTES)
            return _leading_proto_ids(raw)
        # A cut body (over the size limit) is no JSON: find the two fields by pattern.
        model_id, seq_id = _JSON_MODEL_ID.search(raw), _JSON_SEQ_ID.search(raw)
        return (model_id[1].decode(), int(seq_id[1])) if model_id and seq_id else None
    except Exception:  # unreadable: there is no seq_id to consume
        return None


@contextlib.asynccontextmanager
async def seq_consumed_on_rejection(
    request: Request, state: ServerState, tenant: str
) -> AsyncIterator[None]:
    """If validation rejects a training request, its seq_id still counts as used.

    The SDKs assign seq_ids at call time and never reuse one, so a rejected request that left
    a hole would make every later request of that model wait forever.
    """
    raw = await request.body()
    try:
        if getattr(request.state, "body_too_large", False):
            limit = state.config.max_request_bytes
            raise ApiError(413, f"request body exceeds {limit} bytes", "body")
        yield
    except ApiError as exc:
        located = _locate(raw, request.headers) if exc.status in (400, 413, 415) else None
        if located is not None:
            digest = await off_loop(len(raw), fingerprint, raw)
            state.skip_rejected(tenant, *located, digest)
        raise


Handler = Callable[[Request, ServerState, str], Awaitable[dict[str, Any]]]


def consumes_seq(handler: Handler) -> Handler:
    """Route decorator: run the handler under `seq_consumed_on_rejection`."""

    @functools.wraps(handler)
    async def wrapper(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
        async with seq_consumed_on_rejection(request, state, tenant):
            return await handler(request, state, tenant)

    return wrapper
