"""Garbage collections are kept off the event loop's path while a large body decodes.

A large forward_backward body is decoded with the cyclic collector paused (a collection would
hold the GIL, and so every other request, for as long as it walks the heap); a small one, and
every other request, runs with the collector as it was. The pause is counted across concurrent
holders and restores the collector's earlier state; the startup heap is frozen once served.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import tuneloop.server.api.training as training
from tests.unit.server.harness import Api, datum, expect_error
from tuneloop.server.api import large_body
from tuneloop.server.api.deps import OFF_LOOP_BYTES
from tuneloop.server.api.large_body import collector_paused, freeze_startup_heap
from tuneloop.types.codec import ForwardBackwardRequest, encode_forward_backward_request


@pytest.fixture(autouse=True)
def collector_enabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    assert collector_paused.holders == 0
    (gc.enable if was else gc.disable)()


def test_the_pause_disables_the_collector_until_its_last_holder_leaves() -> None:
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # one holder is still inside
    assert gc.isenabled()


def test_the_pause_leaves_a_collector_disabled_before_it_disabled() -> None:
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_the_pause_ends_when_its_holder_raises() -> None:
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("decoding failed")
    assert gc.isenabled()


def test_concurrent_holders_on_threads_end_with_the_collector_enabled() -> None:
    barrier = threading.Barrier(8)
    seen: list[bool] = []

    def hold() -> None:
        with collector_paused():
            barrier.wait(timeout=10)
            seen.append(gc.isenabled())

    threads = [threading.Thread(target=hold) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert seen == [False] * 8
    assert gc.isenabled()


def test_switched_off_the_pause_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(large_body, "ENABLED", False)
    with collector_paused():
        assert gc.isenabled()
    assert freeze_startup_heap() == 0


def test_freezing_exempts_what_is_alive_now_from_later_collections() -> None:
    gc.unfreeze()
    try:
        alive = [[] for _ in range(100)]
        frozen = freeze_startup_heap()
        assert frozen >= len(alive)
        # Frozen objects leave the collected generations; the count may only shrink after
        # (a frozen object another thread lets go of is freed by its reference count).
        assert gc.get_freeze_count() <= frozen
        collected_ids = {id(o) for o in gc.get_objects()}
        assert not any(id(a) in collected_ids for a in alive)
        # Later objects are collected as usual.
        young: list[Any] = []
        young.append(young)  # a cycle
        del young
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()


def _body(model_id: str, seq_id: int, datums: int, tokens: int, bad_last: bool) -> bytes:
    rng = np.random.default_rng(0)
    data = []
    for i in range(datums):
        ids = rng.integers(0, 250, tokens + 1).tolist()
        d = datum(ids, weights=np.ones(tokens, dtype=np.float32))
        if bad_last and i == datums - 1:
            d.loss_fn_inputs["target_tokens"].values[-1] = 10**6  # outside the vocabulary
        data.append(d)
    return encode_forward_backward_request(
        ForwardBackwardRequest(model_id, seq_id, data, "cross_entropy")
    )


@pytest.fixture
def collector_state_at_decode(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether the collector was enabled each time the handler decoded a body."""
    seen: list[bool] = []
    parse = training.parse_forward_backward_request

    def spied(raw: bytes) -> Any:
        seen.append(gc.isenabled())
        return parse(raw)

    monkeypatch.setattr(training, "parse_forward_backward_request", spied)
    return seen


async def _post(api: Api, body: bytes) -> Any:
    headers = api.headers({"content-type": "application/x-protobuf"})
    return await api.http.post("/api/v1/forward_backward", content=body, headers=headers)


async def test_a_large_body_decodes_with_the_collector_paused(
    api: Api, collector_state_at_decode: list[bool]
) -> None:
    model_id = await api.model(await api.session())
    large = _body(model_id, 1, datums=120, tokens=200, bad_last=False)
    assert len(large) >= OFF_LOOP_BYTES
    done = await api.result(await _post(api, large))
    assert done.status_code == 200, done.text
    small = _body(model_id, 2, datums=2, tokens=8, bad_last=False)
    assert len(small) < OFF_LOOP_BYTES
    done = await api.result(await _post(api, small))
    assert done.status_code == 200, done.text
    assert collector_state_at_decode == [False, True]
    assert gc.isenabled()  # and back on once the request is done


async def test_a_refused_large_body_still_answers_400_naming_the_field_and_ends_the_pause(
    api: Api, other_tenant: Api, collector_state_at_decode: list[bool]
) -> None:
    model_id = await api.model(await api.session())
    other_model = await other_tenant.model(await other_tenant.session())
    bad = _body(model_id, 1, datums=120, tokens=200, bad_last=True)
    good = _body(other_model, 1, datums=120, tokens=200, bad_last=False)
    refused, accepted = await asyncio.gather(_post(api, bad), _post(other_tenant, good))
    expect_error(refused, 400, "data[119].loss_fn_inputs.target_tokens")
    assert (await other_tenant.result(accepted)).status_code == 200
    assert collector_state_at_decode == [False, False]
    assert gc.isenabled()
    assert collector_paused.holders == 0
