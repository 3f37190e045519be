"""The console's playground: chat with a base model or a checkpoint through the server's own
OpenAI route, as the signed-in key.
"""

from __future__ import annotations

import json

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response

from tuneloop.server.api.console.auth import COOKIE, CSRF_HEADER, check_csrf, viewer_of
from tuneloop.server.api.console.pages import checkpoint_view
from tuneloop.server.api.console.render import page, same_origin, sign_in_redirect, signed_in
from tuneloop.server.api.errors import bad_request
from tuneloop.server.api.state import get_state
from tuneloop.server.storage import console_views

__all__ = ["router"]

router = APIRouter(prefix="/console", include_in_schema=False)

# Package kinds that hold an adapter the OpenAI route can sample from.
PLAYGROUND_KINDS = ("sampler", "adapter", "training-state")


@router.get("/playground")
async def playground_page(request: Request) -> Response:
    viewer = viewer_of(request)
    if viewer is None:
        return sign_in_redirect()
    state = get_state(request)
    rows = console_views.checkpoints(state.registry.engine, viewer.tenant)
    choices = [
        checkpoint_view(r)
        for r in rows
        if r.kind in PLAYGROUND_KINDS and r.base_model in state.models
    ]
    return page(
        request, "playground.html", viewer, base_models=sorted(state.models), checkpoints=choices
    )


@router.post("/data/chat")
async def playground_chat(request: Request) -> Response:
    """One chat completion through the server's own /oai route, as the signed-in key (which
    the page's script cannot read: the cookie is HttpOnly)."""
    viewer = signed_in(request)
    same_origin(request)
    check_csrf(viewer, request.headers.get(CSRF_HEADER))
    body = await request.body()
    try:
        streamed = json.loads(body).get("stream") if body else None
    except (ValueError, AttributeError):
        streamed = None  # the OpenAI route answers malformed JSON with its own 400
    if streamed:
        raise bad_request("stream: the playground asks for whole answers", "stream")
    key = request.cookies[COOKIE]
    transport = httpx.ASGITransport(app=request.app)
    async with httpx.AsyncClient(transport=transport, base_url=str(request.base_url)) as client:
        answer = await client.post(
            "/oai/api/v1/chat/completions",
            content=body,
            headers={
                "authorization": f"Bearer {key}",
                "content-type": request.headers.get("content-type", ""),
            },
            timeout=None,
        )
    return Response(answer.content, answer.status_code, media_type="application/json")
