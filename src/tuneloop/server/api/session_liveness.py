"""Is a session alive? Every request naming a session, a run or a sampler is its activity.

A request's registry lookups run on a database thread in one hop (`session_activity`,
`run_activity`, `sampler_activity`), recording the activity at most every ACTIVITY_WRITE_S;
back on the event loop `live` turns the answer into the row, a 404 or a 410, and starts the
release of a session found silent past the TTL (session_release.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuneloop.server.api.errors import ApiError, not_found
from tuneloop.server.api.restarts import LOAD, require_held
from tuneloop.server.api.session_release import EXPIRED, release_expired
from tuneloop.server.storage.registry import SamplerRow, SessionRow, TrainingRunRow, utcnow

if TYPE_CHECKING:
    from tuneloop.server.api.state import ServerState

__all__ = [
    "ACTIVITY_WRITE_S",
    "check_live",
    "live",
    "live_session",
    "live_training_run",
    "run_activity",
    "sampler_activity",
    "session_activity",
]

# Heartbeats and requests naming a session are its activity, written to its last_heartbeat
# at most this often (or every quarter TTL, if shorter): not one database write per request.
ACTIVITY_WRITE_S = 5.0


async def live_session(state: ServerState, session_id: str, tenant: str) -> SessionRow:
    """The caller's unfinished, unexpired session; any request naming it is activity.

    404 if it is not the caller's, 410 if it finished or expired. A session found silent
    past the TTL expires here and now, before the periodic sweep would get to it.
    """
    row, expired = await state.db(session_activity, state, session_id, tenant)
    return live(state, session_id, row, expired)


def session_activity(
    state: ServerState, session_id: str, tenant: str
) -> tuple[SessionRow | None, bool]:
    """On a database thread: the session's row after recording this request as its
    activity, and whether it expired just now (its release is then the caller's)."""
    row = state.registry.session(session_id, tenant)
    if row is None or row.finished_at is not None:
        return row, False
    idle_s = (utcnow() - row.last_heartbeat).total_seconds()
    ttl = state.config.session_ttl_s
    if ttl and idle_s > ttl:
        expired = state.registry.finish_session(session_id, EXPIRED)
        return state.registry.session(session_id, tenant) or row, expired
    if idle_s > min(ACTIVITY_WRITE_S, ttl / 4 if ttl else ACTIVITY_WRITE_S):
        state.registry.touch_session(session_id)
    return row, False


def live(state: ServerState, session_id: str, row: SessionRow | None, expired: bool) -> SessionRow:
    """On the event loop: `session_activity`'s answer as a row, a release or an error."""
    if expired:
        release_expired(state, session_id)
    if row is None:
        raise not_found(f"session {session_id!r}", "session_id")
    if row.finished_at is not None:
        if row.finish_reason == EXPIRED:
            raise ApiError(
                410,
                f"session {session_id!r} expired: no heartbeat or request for more than "
                f"{state.config.session_ttl_s:g} s; its models and samplers were freed "
                "(saved checkpoints remain): start a new session",
                "session_id",
            )
        raise ApiError(410, f"session {session_id!r} is finished", "session_id")
    return row


async def live_training_run(state: ServerState, model_id: str, tenant: str) -> TrainingRunRow:
    run, session = await state.db(run_activity, state, model_id, tenant)
    if run is None:
        raise not_found(f"model {model_id!r}", "model_id")
    live(state, run.session_id, *session)
    require_held(run.created_at, state.futures.started_at, f"model {model_id!r}", "model_id", LOAD)
    return run


def run_activity(
    state: ServerState, model_id: str, tenant: str
) -> tuple[TrainingRunRow | None, tuple[SessionRow | None, bool]]:
    """On a database thread: the run, and its session's `session_activity` (one hop)."""
    run = state.registry.training_run(model_id, tenant)
    if run is None:
        return None, (None, False)
    return run, session_activity(state, run.session_id, tenant)


def sampler_activity(
    state: ServerState, sampler_id: str, tenant: str
) -> tuple[SamplerRow | None, tuple[SessionRow | None, bool]]:
    """On a database thread: the sampler, and its session's `session_activity` (one hop:
    sample requests are the most frequent); `check_live` then judges the session."""
    sampler = state.registry.sampler(sampler_id, tenant)
    if sampler is None:
        return None, (None, False)
    return sampler, session_activity(state, sampler.session_id, tenant)


def check_live(
    state: ServerState, session_id: str, session: tuple[SessionRow | None, bool]
) -> SessionRow:
    """On the event loop: the session of `sampler_activity`, or its 404/410."""
    return live(state, session_id, *session)
