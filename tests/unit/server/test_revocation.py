"""Revoking a key ends its work at once: long-polls answer 401, queued work is dropped unrun."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from tests.unit.server.harness import Api, datum, serve
from tuneloop.server.api.revocation import CALLER_KEY, CHECK_S, REVOKED, Revocations
from tuneloop.server.scheduler.admission import EngineScheduler
from tuneloop.server.scheduler.futures import FutureTable, Outcome
from tuneloop.server.scheduler.queue import Operation, OperationQueue
from tuneloop.server.storage.keys import key_hash

TOKENS = [5, 17, 33, 90, 120, 7]


def _state(api: Api) -> Any:
    transport = api.http._transport
    assert isinstance(transport, httpx.ASGITransport)
    return transport.app.state.tuneloop  # type: ignore[attr-defined]


def _revoke(api: Api) -> None:
    digest = key_hash(api.key)
    key_id = next(r.key_id for r in api.keys.list() if r.key_sha256 == digest)
    assert api.keys.revoke(key_id)


async def test_long_poll_and_queued_work_of_a_revoked_key_end(tmp_path: Path) -> None:
    async with serve(tmp_path, long_poll_s=10.0) as api:
        other_key, _ = api.keys.create("alice")
        keeper = Api(api.http, other_key, api.keys)
        session_id = await api.session()
        model_id = await api.model(session_id)
        # seq 2 waits for seq 1: queued work of the key about to be revoked.
        queued = await api.forward_backward(model_id, 2, [datum(TOKENS)])
        request_id = queued.json()["request_id"]
        poll = asyncio.ensure_future(api.post("retrieve_future", {"request_id": request_id}))
        await asyncio.sleep(0.3)
        assert not poll.done()  # a long-poll, holding
        _revoke(api)
        started = time.monotonic()
        answer = await asyncio.wait_for(poll, 5.0)
        assert answer.status_code == 401, answer.text
        # Within a second (the check runs every 0.25 s), plus slack for a loaded machine.
        assert time.monotonic() - started < 2.0
        assert answer.json()["field"] == "X-API-Key"
        # The dropped request's seq_id is consumed: the same tenant's other key goes on.
        done = await keeper.result(await keeper.forward_backward(model_id, 1, [datum(TOKENS)]))
        assert done.status_code == 200
        third = await keeper.result(await keeper.forward_backward(model_id, 3, [datum(TOKENS)]))
        assert third.status_code == 200, third.text
        dropped = await keeper.post("retrieve_future", {"request_id": request_id})
        assert dropped.json()["category"] == REVOKED
        assert _state(api).queue.has_work() is False


async def test_queued_and_running_sampling_of_a_revoked_key_stops(tmp_path: Path) -> None:
    async with serve(tmp_path) as api:
        state = _state(api)
        # A sampling request of this key, queued (the engine is not told of it, so it stays).
        request_id = state.futures.create("alice", "Sample")
        token = CALLER_KEY.set(key_hash(api.key))
        try:
            state.revocations.track(request_id, request_id)
        finally:
            CALLER_KEY.reset(token)
        state.queue.submit_sample(Operation(request_id, "sample", None, lambda r: r))
        assert state.revocations.check() == 0  # the key is valid: nothing ends
        _revoke(api)
        assert state.revocations.check() == 1
        assert state.queue.queued_samples() == 0  # dropped, never run
        assert request_id in state.engine._cancelled  # and stopped if past the queue
        outcome = await state.futures.wait(request_id, "alice", 1.0)
        assert outcome is not None
        assert outcome.failed
        assert REVOKED in outcome.body.decode()
        assert state.revocations.check() == 0  # ended once


def test_drop_requests_consumes_training_seq_ids() -> None:
    queue = OperationQueue()
    sched = EngineScheduler(queue)

    def op(request_id: str, seq_id: int) -> Operation:
        return Operation(request_id, "single", None, lambda r: r, "m", seq_id, request_id)

    queue.submit_training(op("create", 0))
    batch = sched.next_batch()
    assert batch is not None
    assert [o.request_id for o in batch.ops] == ["create"]
    for request_id, seq_id in (("b", 2), ("c", 3)):
        queue.submit_training(op(request_id, seq_id))
    queue.submit_sample(Operation("s", "sample", None, lambda r: r))
    dropped = queue.drop_requests({"b", "s"})
    assert sorted(o.request_id for o in dropped) == ["b", "s"]
    queue.submit_training(op("a", 1))
    order = []
    while (batch := sched.next_batch()) is not None:
        order += [o.request_id for o in batch.ops]
    assert order == ["a", "c"]  # seq 2 stepped over, nothing waits for it


def test_check_interval_is_well_under_a_second() -> None:
    assert CHECK_S <= 0.5


async def test_requests_whose_results_are_gone_are_forgotten(tmp_path: Path) -> None:
    async with serve(tmp_path) as api:
        state = _state(api)
        table = FutureTable(grace_s=0.0)
        revocations = Revocations(state.keys, table, state.queue, state.engine)
        request_id = table.create("alice", "Sample")
        token = CALLER_KEY.set(key_hash(api.key))
        try:
            revocations.track(request_id)
        finally:
            CALLER_KEY.reset(token)
        table.resolve(request_id, Outcome(b"{}", "application/json"))
        revocations.prune()
        assert revocations._by_key  # delivered to nobody yet: still in the table
        assert await table.wait(request_id, "alice", 1.0) is not None
        table.sweep()
        revocations.prune()
        assert not revocations._by_key
