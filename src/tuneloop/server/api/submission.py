"""Queueing a training operation: deduplication, the in-flight quota, the model's stream.

This is the one place where a model's ordered operations (create/load, forward_backward,
optim_step, saves, sampler snapshots) enter the queue; handlers build a `TrainingSubmission`
(the engine operation is already a validated, typed value) and hand it here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tuneloop.server.api.errors import ApiError
from tuneloop.server.engine.operations import EngineOperation
from tuneloop.server.scheduler.futures import Outcome
from tuneloop.server.scheduler.queue import Operation, SeqConflictError, kind_of

if TYPE_CHECKING:
    from tuneloop.server.api.state import ServerState

__all__ = ["TrainingSubmission", "skip_rejected", "submit_training"]


@dataclass(frozen=True)
class TrainingSubmission:
    """One request of a model's ordered stream, as the handler built it."""

    tenant: str
    model_id: str
    seq_id: int
    work: EngineOperation
    # Engine result -> wire outcome, on the event loop after success (may store, then answer).
    finish: Callable[[Any], Outcome | Awaitable[Outcome]]
    request_type: str  # the future's type ("OptimStep", ...): traces, metrics, metering
    digest: str  # the body's fingerprint: a retry with the same seq_id must match it
    on_failure: Callable[[], None] | None = None  # see Operation.on_failure


def submit_training(state: ServerState, sub: TrainingSubmission) -> dict[str, Any]:
    """Queue `sub` in its model's stream; a retry maps to the first request (its id back).

    Raises a 409 for a seq_id reused with other content, a 429 past the in-flight quota."""
    try:
        existing = state.queue.existing(sub.model_id, sub.seq_id, sub.digest)
    except SeqConflictError as exc:
        raise ApiError(409, str(exc), "seq_id") from None
    if existing is not None:
        return {"request_id": existing, "model_id": sub.model_id}
    # A request that later, accepted requests of its model wait for is let in even at the
    # limit: refusing it would leave them waiting, holding the very slots it waits for.
    # So the tenant exceeds the limit by at most the number of those waiting requests.
    if state.queue.unblocks_waiting(sub.model_id, sub.seq_id):
        # Work queued behind this request runs as soon as it lands: drop a revoked key's first,
        # not at the next periodic check (revocation.py), so it can never run.
        state.revocations.check()
    else:
        state.quotas.check_inflight(sub.tenant)
    request_id = state.futures.create(sub.tenant, sub.request_type)
    state.revocations.track(request_id)
    state.traces.submitted(
        request_id, sub.model_id.partition(":")[0], sub.request_type, sub.model_id, sub.seq_id
    )
    kind = kind_of(sub.work)
    state.queue.submit_training(
        Operation(
            request_id,
            kind,
            sub.work,
            sub.finish,
            sub.model_id,
            sub.seq_id,
            sub.digest,
            on_failure=sub.on_failure,
            tenant=sub.tenant,
        )
    )
    state.engine.notify(kind)
    # Not awaited: nothing between the checks above and the queue may yield to another
    # request (the caller's next step, e.g. marking a sampler pending, relies on that).
    state.db_later(state.registry.touch_training_run, sub.model_id)
    return {"request_id": request_id, "model_id": sub.model_id}


async def skip_rejected(
    state: ServerState, tenant: str, model_id: str, seq_id: int, digest: str
) -> None:
    """A rejected training request still consumes its seq_id (the SDKs never reuse one).

    `digest`: the rejected body's fingerprint."""
    if seq_id >= 1 and await state.db(state.registry.training_run, model_id, tenant) is not None:
        state.queue.skip(model_id, seq_id, digest)
        state.engine.notify()
