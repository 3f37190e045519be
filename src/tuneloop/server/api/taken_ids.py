"""Creates that name an id already taken are refused, never turned into overwrites.

Model ids (`<session>:train:<model_seq_id>`) and sampler ids (`<session>:sample:<n>`) are
chosen by the client. A create naming one in use is a 409; one whose holder was lost in a
restart (its row remains, its adapter or sampler died with the process) is a 410 with
`reason: "server_restarted"`. Either way nothing is created or changed; the registry only
inserts (`Registry.add`), so a race that slips past these checks fails its own request too.
A retry of the very request that made the id is answered again, not refused.
"""

from __future__ import annotations

from datetime import datetime

from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.restarts import require_held
from tuneloop.server.api.state import ServerState, fingerprint
from tuneloop.server.scheduler.futures import Outcome
from tuneloop.server.scheduler.loop import failure
from tuneloop.server.scheduler.queue import SeqConflictError
from tuneloop.server.storage.base import Base
from tuneloop.server.storage.registry import RowExistsError

SAMPLER_FIELD = "sampling_session_seq_id"


def is_retry(state: ServerState, model_id: str, seq_id: int, body: bytes) -> bool:
    """Whether this is a repeat of an accepted request (the queue answers it again)."""
    try:
        return state.queue.existing(model_id, seq_id, fingerprint(body)) is not None
    except SeqConflictError:
        return False


def refuse_existing(
    state: ServerState, created_at: datetime, what: str, field: str, remedy: str
) -> None:
    """410 if what held the id was lost in a restart, else 409."""
    require_held(created_at, state.futures.started_at, what, field, remedy)
    raise ApiError(409, f"{what} already exists; {remedy}", field)


def refuse_taken_model(state: ServerState, tenant: str, model_id: str, raw: bytes) -> None:
    """For a create of `model_id` whose run exists, unless a retry of the one that made it."""
    existing = state.registry.training_run(model_id, tenant)
    if existing is not None and not is_retry(state, model_id, 0, raw):
        refuse_existing(
            state,
            existing.created_at,
            f"model {model_id!r}",
            "model_seq_id",
            "create the model with a new model_seq_id",
        )


def refuse_taken_sampler(state: ServerState, tenant: str, sampler_id: str) -> None:
    """For a sampler id in use or being created: a sampler once made is never replaced (its
    clients would silently sample other weights)."""
    what = f"{SAMPLER_FIELD} {sampler_id.rsplit(':', 1)[-1]}: sampler {sampler_id!r}"
    remedy = f"use a new {SAMPLER_FIELD}"
    if sampler_id in state.pending_samplers:
        raise ApiError(409, f"{what} is being created by another request; {remedy}", SAMPLER_FIELD)
    existing = state.registry.sampler(sampler_id, tenant)
    if existing is not None:
        refuse_existing(state, existing.created_at, what, SAMPLER_FIELD, remedy)


def insert_new(state: ServerState, row: Base) -> Outcome | None:
    """Insert `row` as the last step of an operation; the caller's failure if its id was taken
    meanwhile (None when inserted)."""
    try:
        state.registry.add(row)
    except RowExistsError as exc:
        return failure(str(exc), "user")
    return None


__all__ = [
    "insert_new",
    "is_retry",
    "refuse_existing",
    "refuse_taken_model",
    "refuse_taken_sampler",
]
