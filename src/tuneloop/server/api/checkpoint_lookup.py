"""Finding the checkpoint a request names: the caller's own (to write or delete), or one it may
read (its own or one another tenant published, with an audit record of the read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuneloop.server.api.errors import ApiError, not_found
from tuneloop.server.storage.layout import TinkerPath
from tuneloop.server.storage.registry import CheckpointRow, TrainingRunRow

if TYPE_CHECKING:
    from tuneloop.server.api.state import ServerState

__all__ = ["checkpoint", "readable_checkpoint"]


async def checkpoint(
    state: ServerState, tenant: str, path: str, field_name: str
) -> tuple[TinkerPath, CheckpointRow]:
    """The caller's checkpoint at a tinker:// path; 400 if malformed, 404 if not theirs."""
    try:
        parsed = TinkerPath.parse(path)
    except ValueError as exc:
        raise ApiError(400, f"{field_name}: {exc}", field_name) from None
    row = await state.db(state.registry.checkpoint, str(parsed), tenant)
    if row is None:
        raise not_found(f"checkpoint {path!r}", field_name)
    return parsed, row


async def readable_checkpoint(
    state: ServerState, tenant: str, path: str, field_name: str
) -> tuple[TinkerPath, CheckpointRow, TrainingRunRow]:
    """A checkpoint the caller may read: its own, or one another tenant published; with
    the training run that saved it. For reads only: writes go through `checkpoint`."""
    try:
        parsed = TinkerPath.parse(path)
    except ValueError as exc:
        raise ApiError(400, f"{field_name}: {exc}", field_name) from None
    row, run = await state.db(_readable, state, parsed, tenant, path, field_name)
    return parsed, row, run


def _readable(
    state: ServerState, parsed: TinkerPath, tenant: str, path: str, field_name: str
) -> tuple[CheckpointRow, TrainingRunRow]:
    """On a database thread: `readable_checkpoint`'s rows (its audit record included)."""
    row = state.registry.checkpoint(str(parsed), tenant)
    if row is None:
        found = state.registry.checkpoint_any_tenant(str(parsed))
        if found is None or not state.publications.is_public(found):
            raise not_found(f"checkpoint {path!r}", field_name)
        row = found
        state.audit.record_once(
            ("read", row.tinker_path, tenant),
            row.tenant,
            "checkpoint_read",
            tinker_path=row.tinker_path,
            reader=tenant,
        )
    run = state.registry.training_run(row.training_run_id, row.tenant)
    if run is None:
        raise not_found(f"training run of {path!r}", field_name)
    return row, run
