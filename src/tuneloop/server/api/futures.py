"""retrieve_future: long-poll for a result; 408 with a try_again body when not ready yet.

An id an earlier run of the server issued is answered 410 (its result was lost in the restart;
both SDKs raise at once, and the official SDK's sampling client resubmits by itself); an id
never issued, or another tenant's, is answered 404.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tuneloop.server.api.deps import State, Tenant, json_body, read_json
from tuneloop.server.api.errors import ApiError, not_found
from tuneloop.server.api.restarts import request_lost
from tuneloop.server.api.revocation import CALLER_KEY
from tuneloop.types import RetrieveFutureRequest, TryAgainResponse

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
            raise ApiError(401, "invalid or revoked API key", "X-API-Key")
        if outcome is not None or time.monotonic() >= deadline:
            break
    if outcome is None:
        # 408 (not 200) so the official SDK re-polls without logging a warning each time.
        payload = TryAgainResponse(request_id=body.request_id).model_dump(exclude_none=True)
        return JSONResponse(payload, status_code=408)
    return Response(outcome.body, media_type=outcome.media_type)
