"""Batches wait briefly for company, so requests that arrive together run together."""

from __future__ import annotations

import asyncio

from tests.unit.server.test_scheduler import StubBackend, op, sample_op, submit
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.loop import EngineLoop
from tuneloop.server.scheduler.queue import OperationQueue


async def _burst(gather_s: float) -> list[list[str]]:
    queue, futures = OperationQueue(max_sample_batch=4), FutureTable()
    backend = StubBackend(fail=set())
    loop = EngineLoop(backend, queue, futures, gather_s=gather_s)  # type: ignore[arg-type]
    submit(queue, futures, sample_op("s0"))

    async def late_arrivals() -> None:
        await asyncio.sleep(0.005)  # arrive while the first request's batch is gathering
        for i in range(1, 6):
            submit(queue, futures, sample_op(f"s{i}"))

    arrivals = asyncio.create_task(late_arrivals())
    await loop.step()
    await arrivals
    while await loop.step():
        pass
    await loop.stop()
    return backend.batches


async def test_requests_arriving_during_the_gather_window_join_the_batch() -> None:
    # Up to the batch limit (4); the rest form the next batch.
    assert await _burst(0.05) == [["s0", "s1", "s2", "s3"], ["s4", "s5"]]


async def test_without_a_window_the_first_request_runs_alone() -> None:
    assert await _burst(0.0) == [["s0"], ["s1", "s2", "s3", "s4"], ["s5"]]


async def test_other_tenants_steps_arriving_during_the_window_share_the_forward_backward() -> None:
    queue, futures = OperationQueue(), FutureTable()
    backend = StubBackend(fail=set())
    loop = EngineLoop(backend, queue, futures, gather_s=0.05)  # type: ignore[arg-type]
    submit(queue, futures, op("a", 0))

    async def other_tenants() -> None:
        await asyncio.sleep(0.005)
        for model in "bc":
            submit(queue, futures, op(model, 0))

    arrivals = asyncio.create_task(other_tenants())
    await loop.step()
    await arrivals
    assert backend.batches == [["a:0", "b:0", "c:0"]]
    await loop.stop()
