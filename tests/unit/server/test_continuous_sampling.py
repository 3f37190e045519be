"""The engine loop's continuous sampling: requests join a running decode batch between steps,
each result is published as soon as it is delivered, and no request is ever left unanswered."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from tests.unit.server.test_scheduler import StubBackend, op, outcome, sample_op, submit
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.loop import EngineLoop
from tuneloop.server.scheduler.queue import Operation, OperationQueue


class StepBackend(StubBackend):
    """Decodes in 20 ms steps; a request named "<name>:<steps>" needs that many steps."""

    def __init__(self, explode_after: int | None = None) -> None:
        super().__init__(fail=set())
        self.joined: list[list[str]] = []
        self.explode_after = explode_after
        self.steps = 0

    def sample_continuous(
        self,
        batch: Sequence[str],
        admit: Callable[[], Sequence[str]],
        deliver: Callable[[str, Any], None],
        cancelled: Callable[[], Any] = frozenset,
    ) -> None:
        left = {w: int(w.split(":")[1]) for w in batch}
        self.joined.append(list(batch))
        while left:
            time.sleep(0.02)
            self.steps += 1
            if self.explode_after is not None and self.steps >= self.explode_after:
                raise RuntimeError("device on fire")
            for w in [w for w, n in left.items() if n <= 1]:
                del left[w]
                deliver(w, f"ok {w}")
            left = {w: n - 1 for w, n in left.items()}
            new = list(admit())
            if new:
                self.joined.append(new)
                left.update({w: int(w.split(":")[1]) for w in new})


def _setup(backend: StepBackend) -> tuple[EngineLoop, OperationQueue, FutureTable]:
    queue, futures = OperationQueue(), FutureTable()
    return EngineLoop(backend, queue, futures), queue, futures  # type: ignore[arg-type]


def _arrive(loop: EngineLoop, queue: OperationQueue, futures: FutureTable, o: Operation) -> str:
    request_id = submit(queue, futures, o)
    loop.notify(o.kind)
    return request_id


async def test_requests_join_the_running_batch_and_finish_before_it() -> None:
    backend = StepBackend()
    loop, queue, futures = _setup(backend)
    long_id = _arrive(loop, queue, futures, sample_op("long:20"))
    step = asyncio.create_task(loop.step())
    await asyncio.sleep(0.1)  # the long request is decoding
    short_id = _arrive(loop, queue, futures, sample_op("short:2"))
    short = await futures.wait(short_id, "t", 5.0)  # holds until resolved
    assert short is not None
    assert json.loads(short.body) == {"result": "ok short:2"}
    assert not step.done()  # answered while the long request still decodes
    assert await step
    assert await outcome(futures, long_id) == {"result": "ok long:20"}
    assert backend.joined == [["long:20"], ["short:2"]]
    await loop.stop()


async def test_ready_training_work_stops_admission() -> None:
    backend = StepBackend()
    loop, queue, futures = _setup(backend)
    _arrive(loop, queue, futures, sample_op("first:5"))
    step = asyncio.create_task(loop.step())
    await asyncio.sleep(0.03)
    _arrive(loop, queue, futures, op("m", 0))  # training is ready: it goes next
    _arrive(loop, queue, futures, sample_op("second:2"))
    await step
    assert backend.joined == [["first:5"]]
    assert queue.queued_samples() == 1
    await loop.stop()


async def test_a_failing_batch_runs_again_what_it_had_not_answered() -> None:
    backend = StepBackend(explode_after=3)
    loop, queue, futures = _setup(backend)
    quick = _arrive(loop, queue, futures, sample_op("quick:1"))
    slow = _arrive(loop, queue, futures, sample_op("slow:9"))
    assert await loop.step()
    assert await outcome(futures, quick) == {"result": "ok quick:1"}
    # Run again apart (backend.sample), it gets what it gets alone.
    assert await outcome(futures, slow) == {"result": "ok slow:9"}
    assert backend.batches[-1] == ["slow:9"]
    # the loop goes on
    backend.explode_after = None
    again = _arrive(loop, queue, futures, sample_op("again:1"))
    assert await loop.step()
    assert await outcome(futures, again) == {"result": "ok again:1"}
    await loop.stop()


async def test_a_request_the_backend_never_answers_still_gets_an_error() -> None:
    class Forgetful(StepBackend):
        def sample_continuous(
            self, batch: Sequence[str], admit: Any, deliver: Any, cancelled: Any = frozenset
        ) -> None:
            deliver(batch[0], f"ok {batch[0]}")  # and forgets the rest

    loop, queue, futures = _setup(Forgetful())
    first = _arrive(loop, queue, futures, sample_op("a:1"))
    second = _arrive(loop, queue, futures, sample_op("b:1"))
    assert await loop.step()
    assert await outcome(futures, first) == {"result": "ok a:1"}
    assert "ended without" in (await outcome(futures, second))["error"]
    await loop.stop()


async def test_stop_does_not_wait_on_admissions_it_cannot_serve() -> None:
    """While stopping, the loop is blocked on the engine thread: a decode batch must not wait
    (2 s per step) to hand it requests."""
    backend = StepBackend()
    loop, queue, futures = _setup(backend)
    loop.start()
    _arrive(loop, queue, futures, sample_op("long:10"))
    await asyncio.sleep(0.05)
    _arrive(loop, queue, futures, sample_op("late:1"))
    _arrive(loop, queue, futures, sample_op("later:1"))
    start = time.perf_counter()
    await loop.stop()
    assert time.perf_counter() - start < 1.5  # 10 steps of 20 ms, not 2 s of waiting per step


async def test_cancelled_samplers_stop_in_a_gathered_batch_and_in_the_running_one() -> None:
    """cancel_samplers fails a sampler's requests already taken off the queue before they run,
    and the running decode batch sees the cancellation through `cancelled()`."""
    seen: list[frozenset[str]] = []

    class Watching(StepBackend):
        def sample_continuous(
            self, batch: Sequence[str], admit: Any, deliver: Any, cancelled: Any = frozenset
        ) -> None:
            for _ in range(10):
                time.sleep(0.02)
                seen.append(frozenset(cancelled()))
            for w in batch:
                deliver(w, "cancelled" if w in seen[-1] else f"ok {w}")

    loop, queue, futures = _setup(Watching())
    running = _arrive(loop, queue, futures, sample_op("s1"))
    step = asyncio.create_task(loop.step())
    await asyncio.sleep(0.05)
    loop.cancel_samplers(["s1"])
    assert await step
    assert seen[0] == frozenset()
    assert seen[-1] == {"s1"}
    assert await outcome(futures, running) == {"result": "cancelled"}

    class Work:
        sampler_id = "s2"

    gathered = Operation("s2-op", "sample", Work(), lambda r: None)  # type: ignore[arg-type,return-value]
    request_id = _arrive(loop, queue, futures, gathered)
    loop.cancel_samplers(["s2"])
    assert await loop.step()  # nothing left to run: the backend is not called
    failed = await outcome(futures, request_id)
    assert failed["category"] == "user"
    assert "cancelled" in failed["error"]

    class KeyedWork:  # one request of a shared sampler, cancelled by its own key
        sampler_id = "shared"
        cancel_key = "k3"

    keyed = Operation("k3-op", "sample", KeyedWork(), lambda r: None)  # type: ignore[arg-type,return-value]
    request_id = _arrive(loop, queue, futures, keyed)
    loop.cancel_samplers(["k3"])
    assert await loop.step()
    assert "cancelled" in (await outcome(futures, request_id))["error"]
    await loop.stop()
