"""Projects and weight copies: assign a session to a project, copy a checkpoint into a project.

Project ids are per tenant (two tenants may both have a `research` project; neither sees the
other's). A copy shares the source's bytes (its files are hard links where the file system
allows, so deleting either leaves the other whole), keeps its kind, and belongs to a new,
already finished session in the destination project: a training run that cannot be trained on.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from tuneloop.server.api.deps import State, Tenant, json_body, read_json
from tuneloop.server.api.errors import ApiError, bad_request, not_found
from tuneloop.server.api.packages import check_ttl
from tuneloop.server.api.state import ServerState
from tuneloop.server.storage.layout import TinkerPath
from tuneloop.server.storage.projects import valid_project_id
from tuneloop.server.storage.registry import (
    CheckpointRow,
    SessionRow,
    TrainingRunRow,
    utcnow,
)
from tuneloop.types._base import StrictBase

__all__ = ["check_project_id", "router"]

router = APIRouter(prefix="/api/v1")
COPY_FINISH_REASON = "copy"  # the finish reason of the session a copy creates


def check_project_id(project_id: str, field: str = "project_id") -> str:
    if not valid_project_id(project_id):
        raise bad_request(
            f"{field}: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
            field,
        )
    return project_id


class AssignProjectRequest(StrictBase):
    project_id: str


class CopyWeightsRequest(StrictBase):
    source_path: str
    session_id: str | None = None
    model_seq_id: int | None = None
    destination_project_id: str | None = None
    ttl_seconds: int | None = None
    weights_access_token: str | None = None


@router.put("/sessions/{session_id}/project", openapi_extra=json_body(AssignProjectRequest))
async def assign_session_project(
    session_id: str, request: Request, state: State, tenant: Tenant
) -> dict[str, Any]:
    body, _ = await read_json(request, AssignProjectRequest)
    project_id = check_project_id(body.project_id)
    if state.registry.session(session_id, tenant) is None:
        raise not_found(f"session {session_id!r}", "session_id")
    before = state.projects.of_session(session_id)
    state.projects.assign(tenant, "session", session_id, project_id)
    state.audit.record(
        tenant,
        "project_session_assigned",
        session_id=session_id,
        project_id=project_id,
        before=before,
    )
    return {"session_id": session_id, "project_id": project_id}


def _link_tree(source: Path, target: Path) -> None:
    """Hard links of every file (no bytes copied); a plain copy across file systems."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    shutil.copytree(source, tmp, copy_function=link)
    os.replace(tmp, target)


def _copy_owner(
    state: ServerState, tenant: str, body: CopyWeightsRequest, source: TrainingRunRow
) -> tuple[str, str | None]:
    """The training run id that will hold the copy, and the project of a new session for it
    (None: an existing session of the caller holds it)."""
    if body.session_id is not None or body.model_seq_id is not None:
        if body.session_id is None or body.model_seq_id is None or body.model_seq_id < 0:
            raise bad_request(
                "session_id: give both session_id and model_seq_id (>= 0), or a "
                "destination_project_id",
                "session_id",
            )
        state.live_session(body.session_id, tenant)
        run_id = f"{body.session_id}:train:{body.model_seq_id}"
        if state.registry.training_run(run_id, tenant) is not None:
            raise bad_request(f"model_seq_id: {run_id} already exists", "model_seq_id")
        return run_id, None
    if body.destination_project_id is None:
        raise bad_request(
            "destination_project_id: required (or session_id and model_seq_id)",
            "destination_project_id",
        )
    project = check_project_id(body.destination_project_id, "destination_project_id")
    return f"{uuid.uuid4()}:train:0", project


def _register_copy(
    state: ServerState,
    tenant: str,
    ckpt: CheckpointRow,
    source: TrainingRunRow,
    run_id: str,
    project: str | None,
    ttl_seconds: int | None,
) -> str:
    session_id = run_id.split(":train:")[0]
    if project is not None:
        now = utcnow()
        state.registry.add(
            SessionRow(
                id=session_id,
                tenant=tenant,
                finished_at=now,
                finish_reason=COPY_FINISH_REASON,
                display_name=f"copy of {ckpt.tinker_path}",
            )
        )
        state.projects.assign(tenant, "session", session_id, project)
    state.registry.add(
        TrainingRunRow(
            id=run_id,
            tenant=tenant,
            session_id=session_id,
            base_model=source.base_model,
            lora_rank=source.lora_rank,
            lora_seed=source.lora_seed,
            train_mlp=source.train_mlp,
            train_attn=source.train_attn,
            train_unembed=source.train_unembed,
            user_metadata=source.user_metadata if source.tenant == tenant else None,
            training_step=ckpt.training_step or 0,
            parent_path=ckpt.tinker_path,
        )
    )
    source_path = TinkerPath.parse(ckpt.tinker_path)
    target = TinkerPath(run_id, source_path.segment, source_path.name)
    directory = state.layout.checkpoint_dir(tenant, target)
    _link_tree(Path(ckpt.directory), directory)
    expires = utcnow() + timedelta(seconds=ttl_seconds) if ttl_seconds is not None else None
    state.registry.register_package(
        CheckpointRow(
            tinker_path=str(target),
            tenant=tenant,
            training_run_id=run_id,
            checkpoint_id=target.checkpoint_id,
            checkpoint_type=ckpt.checkpoint_type,
            directory=str(directory),
            size_bytes=ckpt.size_bytes,
            created_at=utcnow(),
            expires_at=expires,
            user_metadata=ckpt.user_metadata if ckpt.tenant == tenant else None,
            name=target.name,
            kind=ckpt.kind,
            base_model=ckpt.base_model,
            lora_rank=ckpt.lora_rank,
            lora_targets=ckpt.lora_targets,
            parent_path=ckpt.tinker_path,
            training_step=ckpt.training_step,
        )
    )
    return str(target)


@router.post("/copy_weights", openapi_extra=json_body(CopyWeightsRequest))
async def copy_weights(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, _ = await read_json(request, CopyWeightsRequest)
    if body.weights_access_token or request.headers.get("x-tinker-weights-access-token"):
        raise bad_request(
            "weights_access_token: not supported here; the owner publishes the checkpoint "
            "instead, then any tenant can copy it by path",
            "weights_access_token",
        )
    check_ttl(body.ttl_seconds)
    _path, ckpt, source = state.readable_checkpoint(tenant, body.source_path, "source_path")
    run_id, project = _copy_owner(state, tenant, body, source)
    key = request.headers.get("x-idempotency-key")
    if key is not None:
        if len(key) > 128:
            raise bad_request("X-Idempotency-Key: at most 128 characters", "X-Idempotency-Key")
        claimed, mine = state.projects.claim_copy(tenant, key, ckpt.tinker_path)
        if claimed.source_path != ckpt.tinker_path:
            raise bad_request(
                "X-Idempotency-Key: already used for a copy of another checkpoint",
                "X-Idempotency-Key",
            )
        if claimed.tinker_path:
            return {"tinker_path": claimed.tinker_path}
        if not mine:
            # Being made by an earlier try of this call: the SDKs retry a 409 with backoff.
            raise ApiError(
                409, "a copy under this X-Idempotency-Key is in progress", "X-Idempotency-Key"
            )
    try:
        tinker_path = await asyncio.to_thread(
            _register_copy, state, tenant, ckpt, source, run_id, project, body.ttl_seconds
        )
    except Exception:
        if key is not None:
            state.projects.drop_copy(tenant, key)
        raise
    if key is not None:
        state.projects.finish_copy(tenant, key, tinker_path)
    state.audit.record(
        tenant,
        "checkpoint_copied",
        source_path=ckpt.tinker_path,
        tinker_path=tinker_path,
        project_id=project,
    )
    return {"tinker_path": tinker_path}
