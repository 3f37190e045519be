"""retrieve_future: long-poll for a result; 408 with a try_again body when not ready yet.

An id an earlier run of the server issued is answered 410 (its result was lost in the restart;
both SDKs raise at once, and the official SDK's sampling client resubmits by itself); an id
never issued, or another tenant's, is answered 404.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tuneloop.server.api.deps import State, Tenant, json_body, read_json
from tuneloop.server.api.errors import not_found
from tuneloop.server.api.restarts import request_lost
from tuneloop.types import RetrieveFutureRequest, TryAgainResponse

router = APIRouter(prefix="/api/v1")


@router.post("/retrieve_future", openapi_extra=json_body(RetrieveFutureRequest))
async def retrieve_future(request: Request, state: State, tenant: Tenant) -> Response:
    body, _ = await read_json(request, RetrieveFutureRequest)
    try:
        outcome = await state.futures.wait(body.request_id, tenant, state.config.long_poll_s)
    except KeyError:
        if state.futures.issued_earlier(body.request_id):
            raise request_lost(body.request_id) from None
        raise not_found(f"request {body.request_id!r}", "request_id") from None
    if outcome is None:
        # 408 (not 200) so the official SDK re-polls without logging a warning each time.
        payload = TryAgainResponse(request_id=body.request_id).model_dump(exclude_none=True)
        return JSONResponse(payload, status_code=408)
    return Response(outcome.body, media_type=outcome.media_type)
