"""Token metering: counts per kind match the work done, stay per tenant, and survive restarts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.unit.server.harness import Api, datum, expect_error, sample, sampler, serve
from tuneloop.server.api.metering import Meter
from tuneloop.server.storage.registry import Registry, UsageCount

ZERO = {"train": 0, "forward": 0, "sample_prompt": 0, "sample_generated": 0}


async def usage(api: Api, session_id: str | None = None) -> dict[str, Any]:
    params = {"session_id": session_id} if session_id is not None else {}
    response = await api.get("usage", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_forward_backward_forward_and_sample_are_counted(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    # datum() feeds tokens[:-1]: 5 + 3 input tokens.
    data = [datum([1, 2, 3, 4, 5, 6]), datum([7, 8, 9, 10])]
    await api.result(await api.forward_backward(model_id, 1, data))
    await api.result(await api.forward_backward(model_id, 2, [datum([3, 4, 5])], forward_only=True))
    sampler_id = await sampler(api, session_id)
    response = await sample(api, sampler_id, [11, 12, 13, 14], num_samples=3, max_tokens=4)
    generated = sum(len(s.tokens) for s in response.sequences)
    assert generated > 0

    body = await usage(api, session_id)
    assert body["tenant"] == "alice"
    assert body["session_id"] == session_id
    assert body["tokens"] == {
        "train": 8,
        "forward": 2,
        "sample_prompt": 4,  # the prompt is prefilled once for all 3 samples
        "sample_generated": generated,
    }
    assert body["requests"] == {"train": 1, "forward": 1, "sample_prompt": 1, "sample_generated": 1}
    assert (await usage(api))["tokens"] == body["tokens"]  # the tenant's only session


async def test_rejected_work_is_not_counted_and_sessions_are_separate(api: Api) -> None:
    first, second = await api.session(), await api.session()
    model_id = await api.model(first)
    bad = await api.forward_backward(model_id, 1, [datum([1, 300000, 2])])
    expect_error(bad, 400, "data[0].model_input")
    await api.result(await api.forward_backward(model_id, 2, [datum([1, 2, 3])]))
    other = await api.model(second)
    await api.result(await api.forward_backward(other, 1, [datum([1, 2, 3, 4, 5])]))

    assert (await usage(api, first))["tokens"] == {**ZERO, "train": 2}
    assert (await usage(api, second))["tokens"] == {**ZERO, "train": 4}
    tenant = await usage(api)
    assert tenant["session_id"] is None
    assert tenant["tokens"] == {**ZERO, "train": 6}
    assert tenant["requests"] == {**ZERO, "train": 2}


async def test_usage_is_tenant_scoped(api: Api, other_tenant: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    await api.result(await api.forward_backward(model_id, 1, [datum([1, 2, 3])]))
    body = expect_error(
        await other_tenant.get("usage", params={"session_id": session_id}), 404, "session_id"
    )
    assert body["type"] == "not_found"
    expect_error(await api.get("usage", params={"session_id": "nope"}), 404, "session_id")
    assert (await usage(other_tenant))["tokens"] == ZERO
    assert (await usage(other_tenant))["tenant"] == "bob"
    unauthenticated = await api.http.get("/api/v1/usage")
    assert unauthenticated.status_code == 401


async def test_counts_survive_a_restart_on_the_same_database(tmp_path: Path) -> None:
    async with serve(tmp_path) as api:
        session_id = await api.session()
        model_id = await api.model(session_id)
        await api.result(await api.forward_backward(model_id, 1, [datum([1, 2, 3, 4])]))
        # No usage read here: the shutdown itself must write the counts still in memory.
    async with serve(tmp_path) as api:
        assert (await usage(api, session_id))["tokens"] == {**ZERO, "train": 3}
        model_id = await api.model(await api.session())
        await api.result(await api.forward_backward(model_id, 1, [datum([5, 6])]))
        assert (await usage(api))["tokens"] == {**ZERO, "train": 4}  # accumulates across runs


async def test_finishing_a_session_writes_its_usage(api: Api, server: Any) -> None:
    app, _keys = server
    state = app.state.tuneloop
    session_id = await api.session()
    model_id = await api.model(session_id)
    await api.result(await api.forward_backward(model_id, 1, [datum([1, 2, 3])]))
    finished = await api.post(f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
    assert finished.status_code == 200, finished.text
    totals = state.registry.usage("alice", session_id)
    assert [(t.kind, t.tokens, t.requests) for t in totals] == [("train", 2, 1)]


async def test_background_flush_writes_counts(tmp_path: Path) -> None:
    registry = Registry(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    meter = Meter()
    meter.add("t", "s", "s:train:0", "train", 7)
    meter.add("t", "s", "s:train:0", "train", 3)
    task = asyncio.get_running_loop().create_task(meter.run_flusher(registry, interval_s=0.01))
    try:
        for _ in range(200):
            if registry.usage("t"):
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    [total] = registry.usage("t")
    assert (total.kind, total.tokens, total.requests) == ("train", 10, 2)
    assert registry.usage("other") == []
    registry.close()


def test_a_failed_write_keeps_the_counts(tmp_path: Path) -> None:
    class Broken(Registry):
        def add_usage(self, counts: Any) -> None:
            raise OSError("disk full")

    broken = Broken(f"sqlite:///{tmp_path / 'broken.sqlite3'}")
    meter = Meter()
    meter.add("t", "s", "m", "forward", 5)
    with pytest.raises(OSError, match="disk full"):
        meter.flush(broken)
    broken.close()
    registry = Registry(f"sqlite:///{tmp_path / 'ok.sqlite3'}")
    assert meter.flush(registry) == 1
    assert meter.flush(registry) == 0  # drained
    registry.add_usage([UsageCount("t", "s", "m", "forward", 1, 1)])
    [total] = registry.usage("t", "s")
    assert (total.tokens, total.requests) == (6, 2)
    registry.close()
