"""retrieve_future: long-poll for a result; 408 with a try_again body when not ready yet.
retrieve_futures: the batch completion feed of a sampling session (api/futures_feed.py), and
join_sampling_session, which numbers a sampling client's clones.

An id an earlier run of the server issued is answered 410 (its result was lost in the restart;
both SDKs raise at once, and the official SDK's sampling client resubmits by itself); an id
never issued, or another tenant's, is answered 404.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from tuneloop.server.api.deps import State, Tenant, json_body, read_json
from tuneloop.server.api.errors import ApiError, bad_request, not_found
from tuneloop.server.api.restarts import request_lost
from tuneloop.server.api.revocation import CALLER_KEY
from tuneloop.types import RetrieveFutureRequest, TryAgainResponse
from tuneloop.types._base import StrictBase

# A long-poll re-checks its key this often (revocation ends it with 401 within this).
REVOCATION_SLICE_S = 0.5

router = APIRouter(prefix="/api/v1")


@router.post("/retrieve_future", openapi_extra=json_body(RetrieveFutureRequest))
async def retrieve_future(request: Request, state: State, tenant: Tenant) -> Response:
    body, _ = await read_json(request, RetrieveFutureRequest)
    key = CALLER_KEY.get()
    deadline = time.monotonic() + state.config.long_poll_s
    while True:
        # In slices, the key checked between them: a poll of a revoked key ends within a slice
        # (work of that key fails at once, see revocation.py, which also ends the slice).
        hold_s = min(REVOCATION_SLICE_S, max(deadline - time.monotonic(), 0.0))
        try:
            outcome = await state.futures.wait(body.request_id, tenant, hold_s)
        except KeyError:
            if state.futures.issued_earlier(body.request_id):
                raise request_lost(body.request_id) from None
            raise not_found(f"request {body.request_id!r}", "request_id") from None
        if not state.revocations.key_still_valid(key):
            # Its queued work is dropped before the caller hears of the revocation.
            state.revocations.check()
            raise ApiError(401, "invalid or revoked API key", "X-API-Key")
        if outcome is not None or time.monotonic() >= deadline:
            break
    if outcome is None:
        # 408 (not 200) so the official SDK re-polls without logging a warning each time.
        payload = TryAgainResponse(request_id=body.request_id).model_dump(exclude_none=True)
        return JSONResponse(payload, status_code=408)
    return Response(outcome.body, media_type=outcome.media_type)


class FuturesTarget(StrictBase):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str
    cloned_sampler_id: int = 0


class RetrieveFuturesRequest(StrictBase):
    target: FuturesTarget
    prev_cursor: int = 0
    timeout: float | None = None
    retrieved_request_ids: list[str] = Field(default_factory=list)


class JoinSamplingSessionRequest(StrictBase):
    sampling_session_id: str
    type: Literal["join_sampling_session"] = "join_sampling_session"


@router.post("/retrieve_futures", openapi_extra=json_body(RetrieveFuturesRequest))
async def retrieve_futures(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, _ = await read_json(request, RetrieveFuturesRequest)
    target = body.target
    if await state.db(state.registry.sampler, target.sampling_session_id, tenant) is None:
        raise not_found(f"sampler {target.sampling_session_id!r}", "target.sampling_session_id")
    if target.cloned_sampler_id < 0:
        raise bad_request("target.cloned_sampler_id: must be >= 0", "target.cloned_sampler_id")
    if body.prev_cursor < 0:
        raise bad_request("prev_cursor: must be >= 0", "prev_cursor")
    if body.timeout is not None and body.timeout < 0:
        raise bad_request("timeout: must be >= 0", "timeout")
    for request_id in body.retrieved_request_ids:
        state.futures.forget(request_id, tenant)
    hold_s = state.config.long_poll_s if body.timeout is None else min(body.timeout, 30.0)
    completions, cursor = await state.feeds.poll(
        target.sampling_session_id, target.cloned_sampler_id, body.prev_cursor, hold_s
    )
    return {"completions": completions, "cursor": cursor}


@router.post("/join_sampling_session", openapi_extra=json_body(JoinSamplingSessionRequest))
async def join_sampling_session(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, _ = await read_json(request, JoinSamplingSessionRequest)
    sampler, session = await state.db(state.sampler_activity, body.sampling_session_id, tenant)
    if sampler is None:
        raise not_found(f"sampler {body.sampling_session_id!r}", "sampling_session_id")
    state.check_live(sampler.session_id, session)
    counter = await asyncio.to_thread(state.clones.next, sampler.id)
    return {"type": "join_sampling_session", "client_counter": counter}
