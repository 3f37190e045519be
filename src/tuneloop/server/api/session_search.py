"""Session search (`POST /sessions/search`) and trace export (`GET /sessions/{id}/trace_export`,
a JSON file of the session's requests with their timings, fetched through a signed URL)."""

from __future__ import annotations

import json
import secrets
import shutil
import time
import urllib.parse
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from pydantic import AwareDatetime, Field

from tuneloop.server.api.deps import State, Tenant, json_body, read_json
from tuneloop.server.api.downloads import url_signer
from tuneloop.server.api.errors import ApiError, not_found
from tuneloop.server.api.projects import check_project_id
from tuneloop.server.api.signing import ExpiredError, Grant, SignatureError
from tuneloop.server.api.state import EXPIRED, ServerState
from tuneloop.server.storage.registry import SessionRow
from tuneloop.types._base import StrictBase

__all__ = ["owner_urn", "router", "session_status"]

router = APIRouter(prefix="/api/v1")
CLIENT_REASONS = ("success", "errored", "interrupted")


def owner_urn(tenant: str) -> str:
    """How a tenant is named as an owner (sessions, the JWT's `sub`)."""
    return f"tml:user:{tenant}"


class _Own(StrictBase):
    type: Literal["own"] = "own"


class _Accessible(StrictBase):
    type: Literal["accessible"] = "accessible"


class _Users(StrictBase):
    type: Literal["user"] = "user"
    owner_urns: list[str] = Field(min_length=1, max_length=10)


class _Active(StrictBase):
    type: Literal["active"] = "active"


class _Cancelled(StrictBase):
    type: Literal["cancelled"] = "cancelled"


class _Failed(StrictBase):
    type: Literal["failed"] = "failed"


class _ClientFinished(StrictBase):
    type: Literal["client_finished"] = "client_finished"
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(
        default=None, min_length=1
    )


class SearchCursor(StrictBase):
    last_created_at: AwareDatetime
    last_session_id: str


class SessionSearchRequest(StrictBase):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = Field(default_factory=dict)
    display_name: str | None = Field(default=None, min_length=1)
    owner: Annotated[_Own | _Accessible | _Users, Field(discriminator="type")] = _Own()
    statuses: (
        list[
            Annotated[_Active | _Cancelled | _Failed | _ClientFinished, Field(discriminator="type")]
        ]
        | None
    ) = Field(default=None, min_length=1)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: SearchCursor | None = None


def session_status(row: SessionRow) -> dict[str, Any] | None:
    """The official SDK's SessionStatus of a session row (None: a copy's holder session)."""
    if row.finished_at is None:
        return {"type": "active"}
    if row.finish_reason == EXPIRED:
        return {"type": "cancelled", "detail": "expired: no heartbeat or request within the TTL"}
    if row.finish_reason in CLIENT_REASONS:
        return {"type": "client_finished", "reason": {"type": row.finish_reason}}
    return None


def _status_matches(status: dict[str, Any] | None, wanted: list[Any] | None) -> bool:
    if wanted is None:
        return True
    if status is None:
        return False
    for query in wanted:
        if query.type != status["type"]:
            continue
        reasons = query.reasons if isinstance(query, _ClientFinished) else None
        if reasons is None or status["reason"]["type"] in reasons:
            return True
    return False


def _name_matches(name: str | None, query: str) -> bool:
    lowered = (name or "").lower()
    return all(word in lowered for word in query.lower().split())


def _matches(row: SessionRow, body: SessionSearchRequest) -> bool:
    if body.session_id is not None or body.display_name is not None:
        by_id = body.session_id is not None and row.id == body.session_id
        by_name = body.display_name is not None and _name_matches(
            row.display_name, body.display_name
        )
        if not (by_id or by_name):
            return False
    metadata = row.user_metadata or {}
    if any(str(metadata.get(k)) != v or k not in metadata for k, v in body.user_metadata.items()):
        return False
    return _status_matches(session_status(row), body.statuses)


@router.post("/sessions/search", openapi_extra=json_body(SessionSearchRequest))
async def search_sessions(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    """The caller's sessions matching every given criterion, newest first, a page at a time.
    Projects are the caller's own namespace, so every project id is listable."""
    body, _ = await read_json(request, SessionSearchRequest)
    for i, project_id in enumerate(body.project_ids or []):
        check_project_id(project_id, f"project_ids[{i}]")
    if isinstance(body.owner, _Users) and owner_urn(tenant) not in body.owner.owner_urns:
        return {"sessions": [], "next_cursor": None}
    found = []
    for row, project in state.projects.sessions(tenant, body.project_ids):
        if body.cursor is not None and (row.created_at, row.id) >= (
            body.cursor.last_created_at,
            body.cursor.last_session_id,
        ):
            continue
        if _matches(row, body):
            found.append((row, project))
            if len(found) > body.limit:
                break
    page, more = found[: body.limit], len(found) > body.limit
    totals = state.projects.checkpoints_by_session(tenant, [r.id for r, _ in page])
    sessions = [
        {
            "session_id": row.id,
            "created_at": row.created_at.isoformat(),
            "owner": owner_urn(tenant),
            "project_id": project,
            "status": session_status(row),
            "checkpoints_count": totals.get(row.id, (0, 0))[0],
            "checkpoint_storage_bytes": totals.get(row.id, (0, 0))[1],
            "display_name": row.display_name,
            "user_metadata": {k: str(v) for k, v in (row.user_metadata or {}).items()} or None,
        }
        for row, project in page
    ]
    last = page[-1][0] if more and page else None
    cursor = (
        {"last_created_at": last.created_at.isoformat(), "last_session_id": last.id}
        if last is not None
        else None
    )
    return {"sessions": sessions, "next_cursor": cursor}


# ---- trace export ---------------------------------------------------------------------------


def _trace_dir(state: ServerState, tenant: str, session_id: str) -> Path:
    return state.layout.data_dir / "traces" / tenant / _quoted(session_id)


def _quoted(session_id: str) -> str:
    return urllib.parse.quote(session_id, safe="")


def _grant(tenant: str, session_id: str, file: str, expires: int) -> Grant:
    # "trace:" never starts a tinker path: a trace grant can never open a checkpoint file.
    return Grant(tenant, f"trace:{session_id}", file, expires)


@router.get("/sessions/{session_id}/trace_export")
def trace_export(session_id: str, request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    """Writes the session's trace now and answers `ready` with a signed URL for it. A plain
    `def`: FastAPI runs it in a worker thread, so writing the file blocks no one."""
    row = state.registry.session(session_id, tenant)
    if row is None:
        raise not_found(f"session {session_id!r}", "session_id")
    document = state.traces.export(
        session_id,
        {
            "tenant": tenant,
            "created_at": row.created_at.isoformat(),
            "finished_at": row.finished_at.isoformat() if row.finished_at else None,
            "finish_reason": row.finish_reason,
            "exported_at": time.time(),
        },
    )
    directory = _trace_dir(state, tenant, session_id)
    shutil.rmtree(directory, ignore_errors=True)  # only the newest export is kept
    directory.mkdir(parents=True, exist_ok=True)
    file = f"trace-{int(time.time())}-{secrets.token_hex(4)}.json"
    (directory / file).write_text(json.dumps(document))
    signer = url_signer(request, state)
    expires = signer.expiry()
    signature = signer.sign(_grant(tenant, session_id, file, expires))
    query = urllib.parse.urlencode({"tenant": tenant, "expires": expires, "signature": signature})
    base = str(request.base_url).rstrip("/")
    url = f"{base}/api/v1/trace_files/{_quoted(session_id)}/{file}?{query}"
    return {"status": "ready", "url": url}


@router.get("/trace_files/{session_id}/{file}")
def trace_file(
    session_id: str,
    file: str,
    request: Request,
    state: State,
    tenant: str,
    expires: int,
    signature: str,
) -> FileResponse:
    """A trace file, for a URL trace_export signed (no API key: the signature is the
    credential). 403 if the URL was altered, 410 once expired, 404 if a newer export replaced
    it."""
    try:
        url_signer(request, state).verify(_grant(tenant, session_id, file, expires), signature)
    except SignatureError as exc:
        raise ApiError(403, f"signature: {exc}", "signature") from None
    except ExpiredError:
        when = datetime.fromtimestamp(expires, UTC).isoformat()
        raise ApiError(
            410, f"expires: this URL expired at {when}; export again", "expires"
        ) from None
    path = _trace_dir(state, tenant, session_id) / file
    if "/" in file or file.startswith(".") or not path.is_file():
        raise not_found(f"trace file {file!r} (replaced by a newer export?)", "file")
    return FileResponse(
        path, media_type="application/json", headers={"cache-control": "private, no-store"}
    )
