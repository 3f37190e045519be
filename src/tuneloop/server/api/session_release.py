"""Releasing a finished or expired session: its adapters and samplers are freed on the engine,
work still queued for them fails with a clear error, decode rows already running stop; its
checkpoints stay. The app's expiry task and a request that finds a session silent past the
TTL both end here.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import TYPE_CHECKING

from tuneloop.server.engine.operations import DeleteAdapter, DeleteSampler
from tuneloop.server.scheduler.loop import failure
from tuneloop.server.storage.registry import utcnow

if TYPE_CHECKING:
    from tuneloop.server.api.state import ServerState

__all__ = ["EXPIRED", "expire_idle_sessions", "release_expired", "release_session"]

log = logging.getLogger(__name__)
EXPIRED = "expired"  # the finish reason of a session that went silent past the TTL


def release_expired(state: ServerState, session_id: str) -> None:
    """Free a session a request just found expired, in the background."""
    log.info(
        "session %s expired after %g s without activity", session_id, state.config.session_ttl_s
    )
    task = asyncio.get_running_loop().create_task(release_session(state, session_id))
    state.releases.add(task)
    task.add_done_callback(state.releases.discard)


async def expire_idle_sessions(state: ServerState) -> list[str]:
    """Expire every session silent for longer than the TTL (all tenants); their ids."""
    if not state.config.session_ttl_s:
        return []
    silent_since = utcnow() - timedelta(seconds=state.config.session_ttl_s)
    expired = []
    for session_id in await state.db(state.registry.stale_sessions, silent_since):
        if await state.db(state.registry.finish_session, session_id, EXPIRED):
            log.info(
                "session %s expired after %g s without activity",
                session_id,
                state.config.session_ttl_s,
            )
            await release_session(state, session_id)
            expired.append(session_id)
    return expired


async def release_session(state: ServerState, session_id: str) -> None:
    """Free a finished session's adapters and samplers; its checkpoints stay.

    Work still queued for them fails with a clear error instead of running.
    """
    runs, samplers = await state.db(state.registry.session_children, session_id)
    row = await state.db(state.registry.session_any_tenant, session_id)
    if row is not None and row.finish_reason == EXPIRED:
        why = (
            f"session {session_id} expired (no heartbeat or request for more than "
            f"{state.config.session_ttl_s:g} s), so its pending work was cancelled"
        )
    else:
        why = f"session {session_id} is finished"
    gone = failure(why, "user")
    for run in runs:
        for op in state.queue.forget_model(run):
            state.futures.resolve(op.request_id, gone)
        await state.engine.perform(DeleteAdapter(run))
    released = set(samplers)
    for op in state.queue.drop_samples(
        lambda op: getattr(op.work, "sampler_id", None) not in released
    ):
        state.futures.resolve(op.request_id, gone)
    # Requests already past the queue (a gathering or running decode batch) stop too.
    state.engine.cancel_samplers(released)
    state.feeds.forget_samplers(released)
    for sampler_id in samplers:
        await state.engine.perform(DeleteSampler(sampler_id))
    # Their sample-retry records go too: the map would otherwise grow with every request.
    for key in [k for k in state.sample_submissions if k[0] in released]:
        del state.sample_submissions[key]
    try:  # the session's usage is final now: write it, so readers see it at once
        await state.meter.flush_async(state.registry)
    except Exception:  # the periodic flush retries; finishing must not fail for this
        log.exception("writing usage counts failed")
