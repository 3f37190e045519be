"""Session life cycle: create, heartbeat, finish (first wins), listing."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request

from tuneloop.server.api.deps import Offset, State, Tenant, json_body, read_json
from tuneloop.server.api.errors import ApiError, not_found
from tuneloop.server.api.projects import check_project_id
from tuneloop.server.storage.registry import SessionRow
from tuneloop.types import (
    CreateSessionRequest,
    CreateSessionResponse,
    FinishSessionRequest,
    GetSessionResponse,
    ListSessionsResponse,
    SessionHeartbeatRequest,
)

router = APIRouter(prefix="/api/v1")


@router.post("/create_session", openapi_extra=json_body(CreateSessionRequest))
async def create_session(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, _ = await read_json(request, CreateSessionRequest)
    project_id = check_project_id(body.project_id) if body.project_id is not None else None
    state.quotas.check_sessions(tenant)
    # A random UUID: session ids prefix every model and sampler id, so they must not be guessable.
    session_id = str(uuid.uuid4())
    state.registry.add(
        SessionRow(
            id=session_id,
            tenant=tenant,
            user_metadata=body.user_metadata,
            tags=body.tags,
            sdk_version=body.sdk_version,
            display_name=body.display_name,
        )
    )
    if project_id is not None:
        state.projects.assign(tenant, "session", session_id, project_id)
    return CreateSessionResponse(session_id=session_id).model_dump(exclude_none=True)


@router.post("/session_heartbeat", openapi_extra=json_body(SessionHeartbeatRequest))
async def heartbeat(request: Request, state: State, tenant: Tenant) -> dict[str, str]:
    body, _ = await read_json(request, SessionHeartbeatRequest)
    # live_session records the activity (at most one write per few seconds per session) and
    # answers 410 for a finished or expired session, which stops the SDKs' heartbeat loops.
    state.live_session(body.session_id, tenant)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish", openapi_extra=json_body(FinishSessionRequest))
async def finish(session_id: str, request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, _ = await read_json(request, FinishSessionRequest)
    if state.registry.session(session_id, tenant) is None:
        raise not_found(f"session {session_id!r}", "session_id")
    first = state.registry.finish_session(session_id, body.reason.type)
    if first:
        await state.release_session(session_id)
    return {"session_id": session_id, "finished": True, "first": first}


@router.get("/sessions")
async def list_sessions(
    state: State, tenant: Tenant, limit: int = 20, offset: Offset = 0
) -> dict[str, Any]:
    if not (1 <= limit <= 1000) or offset < 0:
        raise ApiError(400, "limit must be in [1, 1000] and offset >= 0", "limit")
    sessions = state.registry.list_sessions(tenant, limit, offset)
    return ListSessionsResponse(sessions=sessions).model_dump()


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, state: State, tenant: Tenant) -> dict[str, Any]:
    row = state.registry.session(session_id, tenant)
    if row is None:
        raise not_found(f"session {session_id!r}", "session_id")
    runs, samplers = state.registry.session_children(session_id)
    return GetSessionResponse(
        training_run_ids=runs,
        sampler_ids=samplers,
        user_metadata=row.user_metadata,
        display_name=row.display_name,
    ).model_dump()
