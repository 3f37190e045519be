"""Batches wait briefly for company once clients are seen working concurrently."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from tests.unit.server.test_scheduler import StubBackend, op, sample_op, submit
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.loop import EngineLoop
from tuneloop.server.scheduler.queue import Operation, OperationQueue


class SlowBackend(StubBackend):
    """Each batch takes 50 ms, long enough for other clients' requests to arrive meanwhile."""

    def forward_backward(self, batch: Sequence[str]) -> list[Any]:
        time.sleep(0.05)
        return super().forward_backward(batch)

    def sample(self, batch: Sequence[str]) -> list[Any]:
        time.sleep(0.05)
        return super().sample(batch)


def _engine(
    gather_s: float, max_sample_batch: int = 64
) -> tuple[EngineLoop, OperationQueue, FutureTable, StubBackend]:
    queue, futures = OperationQueue(max_sample_batch=max_sample_batch), FutureTable()
    backend = SlowBackend(fail=set())
    loop = EngineLoop(backend, queue, futures, gather_s=gather_s)  # type: ignore[arg-type]
    return loop, queue, futures, backend


def _arrive(loop: EngineLoop, queue: OperationQueue, futures: FutureTable, o: Operation) -> None:
    submit(queue, futures, o)
    loop.notify("sample" if o.kind == "sample" else o.kind)


async def _later(
    delay: float,
    loop: EngineLoop,
    queue: OperationQueue,
    futures: FutureTable,
    ops: list[Operation],
) -> None:
    await asyncio.sleep(delay)
    for o in ops:
        _arrive(loop, queue, futures, o)


async def test_a_lone_client_pays_no_gather_wait() -> None:
    loop, queue, futures, backend = _engine(gather_s=0.5)
    for i in range(2):  # one request at a time, nothing arrives meanwhile
        _arrive(loop, queue, futures, sample_op(f"s{i}"))
        start = time.perf_counter()
        assert await loop.step()
        assert time.perf_counter() - start < 0.3
    assert backend.batches == [["s0"], ["s1"]]
    await loop.stop()


async def test_concurrent_sample_requests_join_one_batch() -> None:
    loop, queue, futures, backend = _engine(gather_s=0.05, max_sample_batch=4)
    _arrive(loop, queue, futures, sample_op("s0"))
    # s1 arrives while s0's batch runs: clients are concurrent from now on.
    arrivals = asyncio.create_task(_later(0.01, loop, queue, futures, [sample_op("s1")]))
    await loop.step()
    await arrivals
    # The next batch (s1) waits for company: s2..s5 arrive during its gather window.
    burst = [sample_op(f"s{i}") for i in range(2, 6)]
    arrivals = asyncio.create_task(_later(0.01, loop, queue, futures, burst))
    await loop.step()
    await arrivals
    while await loop.step():
        pass
    # Nothing arrived while those batches ran (the client waits for its results); its next
    # burst is still batched: concurrency, once seen, is remembered for a while.
    _arrive(loop, queue, futures, sample_op("s6"))
    arrivals = asyncio.create_task(_later(0.01, loop, queue, futures, [sample_op("s7")]))
    await loop.step()
    await arrivals
    assert backend.batches == [["s0"], ["s1", "s2", "s3", "s4"], ["s5"], ["s6", "s7"]]
    await loop.stop()


async def test_other_tenants_steps_join_one_forward_backward() -> None:
    loop, queue, futures, backend = _engine(gather_s=0.05)
    _arrive(loop, queue, futures, op("a", 0))
    arrivals = asyncio.create_task(_later(0.01, loop, queue, futures, [op("b", 0)]))
    await loop.step()
    await arrivals
    _arrive(loop, queue, futures, op("a", 1))
    arrivals = asyncio.create_task(_later(0.01, loop, queue, futures, [op("c", 0), op("d", 0)]))
    await loop.step()  # a:1 and b:0 are ready; c:0 and d:0 join during the window
    await arrivals
    assert backend.batches == [["a:0"], ["a:1", "b:0", "c:0", "d:0"]]
    await loop.stop()
