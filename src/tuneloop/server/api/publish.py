"""Publishing checkpoints: a published checkpoint is readable by every tenant of this server by
its tinker path (create_sampling_session, load_weights, weights_info), and stays the owner's
alone to change, unpublish or delete.

Publishing twice (or unpublishing a private checkpoint) is a no-op answered 200, not the 409
hosted Tinker documents: the official SDK retries a 409 for five minutes before failing.

Registered before api/rest.py: its DELETE `.../checkpoints/{checkpoint_id:path}` route would
also match `.../publish`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from tuneloop.server.api.deps import State, Tenant
from tuneloop.server.api.errors import bad_request, not_found
from tuneloop.server.storage.layout import TinkerPath
from tuneloop.server.storage.registry import CheckpointRow

__all__ = ["router"]

router = APIRouter(prefix="/api/v1")

_ROUTE = "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish"


def _owned(state: Any, tenant: str, run_id: str, checkpoint_id: str) -> CheckpointRow:
    segment, _, name = checkpoint_id.partition("/")
    try:
        path = TinkerPath.parse(f"tinker://{run_id}/{segment}/{name}")
    except ValueError as exc:
        raise bad_request(f"checkpoint_id: {exc}", "checkpoint_id") from None
    # Only the owner's: another tenant's checkpoint, published or not, is not found.
    row: CheckpointRow | None = state.registry.checkpoint(str(path), tenant)
    if row is None:
        raise not_found(f"checkpoint {path}", "checkpoint_id")
    return row


@router.post(_ROUTE)
async def publish(run_id: str, checkpoint_id: str, state: State, tenant: Tenant) -> dict[str, Any]:
    row = _owned(state, tenant, run_id, checkpoint_id)
    changed = state.publications.publish(row)
    if changed:
        state.audit.record(tenant, "checkpoint_published", tinker_path=row.tinker_path)
    return {"tinker_path": row.tinker_path, "public": True, "changed": changed}


@router.delete(_ROUTE)
async def unpublish(
    run_id: str, checkpoint_id: str, state: State, tenant: Tenant
) -> dict[str, Any]:
    row = _owned(state, tenant, run_id, checkpoint_id)
    changed = state.publications.unpublish(row)
    if changed:
        state.audit.record(tenant, "checkpoint_unpublished", tinker_path=row.tinker_path)
    return {"tinker_path": row.tinker_path, "public": False, "changed": changed}
