"""The engine loop: pick a batch -> run it on the backend (engine thread) -> publish results."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from tuneloop.server.engine.backend import Backend, ContinuousSampling, ReportsKVCache
from tuneloop.server.engine.isolation import bisect_failures
from tuneloop.server.engine.operations import EngineOperation, Footprint, run_operation
from tuneloop.server.engine.types import CANCELLED, EngineError, ForwardBackwardWork, SampleWork
from tuneloop.server.scheduler.admission import EngineScheduler, Joining
from tuneloop.server.scheduler.futures import FutureTable, Outcome
from tuneloop.server.scheduler.queue import Batch, Operation, OperationQueue

log = logging.getLogger(__name__)
# How long concurrency, once seen, keeps batches waiting for company.
CONCURRENCY_MEMORY_S = 30.0
# How long a cancelled sampler id is remembered: enough for work already taken off the queue
# (a batch gathering, a decode batch) to see it. Sampler ids are never reused.
CANCEL_MEMORY_S = 600.0
# How long the engine thread waits, between decode steps, for the event loop to say what joins;
# past it the step goes on without (a busy loop answers at a later step).
ASK_TIMEOUT_S = 2.0
T = TypeVar("T")
W = TypeVar("W", ForwardBackwardWork, SampleWork)


def engine_thread() -> ThreadPoolExecutor:
    """The one thread that runs the backend.

    The server builds a backend that computes in its process on this thread too (app.py):
    torch's CPU kernels run on an OpenMP runtime (libgomp) that keeps a pool of worker threads
    for every thread that has run a parallel region, and once the process holds more such
    threads than it has cores, libgomp stops letting idle workers spin between regions, so
    each of the thousands of operations of a step waits for its workers to wake. A model
    loaded on one thread and run on another left two pools: a training step of SmolLM2 took
    1.42x as long, a decode step 1.45x (bench/engine_thread.py).
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


@dataclass(eq=False)
class _Ask:
    """The engine thread's question to the event loop between two decode steps, answered at
    most once: if the thread gave up waiting, the loop takes nothing out of the queue; if the
    loop answered, the thread runs what it took, however late."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False
    answer: Joining | None = None


def failure(message: str, category: str = "server") -> Outcome:
    return Outcome.json({"error": message, "category": category}, failed=True)


def _works(batch: Batch, _kind: type[W]) -> list[W]:
    """The batch's operations as the one type its kind holds (the queue batches by kind)."""
    return [cast(W, op.work) for op in batch.ops]


def _execute(backend: Backend, batch: Batch) -> list[Any]:
    """Runs on the engine thread. Per-request failures come back as EngineError values; a
    batch call that raises is run again in halves, so only the request that fails alone fails
    (engine/isolation.py)."""
    if batch.kind == "forward_backward":
        works = _works(batch, ForwardBackwardWork)
        return bisect_failures(backend.forward_backward, works, batch.kind)
    if batch.kind == "sample":
        return bisect_failures(backend.sample, _works(batch, SampleWork), batch.kind)
    return [_run_alone(backend, op) for op in batch.ops]


def _run_alone(backend: Backend, op: Operation) -> Any:
    """One operation that runs alone: its result, or its failure as an EngineError."""
    try:
        return run_operation(backend, op.work)
    except EngineError as exc:
        return exc
    except Exception as exc:
        log.exception("backend failed a single operation")
        return EngineError(f"{type(exc).__name__}: {exc}")


class EngineLoop:
    def __init__(
        self,
        backend: Backend,
        queue: OperationQueue,
        futures: FutureTable,
        gather_s: float = 0.0,
        on_success: Callable[[Operation, Any], None] | None = None,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.backend = backend
        # Told of every operation that succeeded, with its engine result (usage metering).
        self.on_success = on_success
        # A sampling or forward_backward batch waits this long for company: requests that
        # arrive together (a client's burst of samples, several tenants' steps) then share one
        # batch instead of the first running alone and the rest after it (measured: 8
        # concurrent sample requests ran at 0.66x of one batch of 8 without it). It waits only
        # while requests of that kind were seen arriving during a running batch in the last
        # CONCURRENCY_MEMORY_S, so a lone client calling one request at a time pays no added
        # latency, and a client that sends bursts and then waits keeps its bursts batched.
        self.gather_s = gather_s
        self._arrivals = {"sample": 0, "forward_backward": 0}
        self._overlap_seen_at = {"sample": -math.inf, "forward_backward": -math.inf}
        self.queue = queue
        self.scheduler = EngineScheduler(
            queue,
            backend.kv_cache_use if isinstance(backend, ReportsKVCache) else lambda: None,
            train_between_steps=bool(getattr(backend, "trains_between_decode_steps", False)),
        )
        self.futures = futures
        # One engine thread: the backend is never called concurrently, so it needs no locks.
        # `executor`, when given, is the `engine_thread()` that built the backend; the loop
        # owns it either way and shuts it down in stop().
        self._executor = executor if executor is not None else engine_thread()
        # (seconds of backend work finished, perf_counter() when the running work began or
        # None): written on the engine thread only, replaced whole so a reader on another
        # thread sees a consistent pair. See busy_seconds().
        self._busy: tuple[float, float | None] = (0.0, None)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Set by stop(): a running decode batch then takes in no more requests, since the loop
        # that would hand them over is blocked waiting for the engine thread to finish.
        self._stopping = False
        # Samplers whose requests must stop (their session ended), with when they were named.
        # Written on the event loop only; the engine thread reads the frozenset view, whose
        # replacement is atomic.
        self._cancelled_at: dict[str, float] = {}
        self._cancelled: frozenset[str] = frozenset()
        # The batch on the engine now, as (kind, operations), or None: for monitoring only.
        self.running: tuple[str, int] | None = None
        # Finish steps still storing their results (see _publish), held until done.
        self._finishing: set[asyncio.Task[None]] = set()

    def notify(self, kind: str | None = None) -> None:
        """New work was queued; `kind` ("sample", "forward_backward", ...) feeds the gather rule."""
        if kind in self._arrivals:
            self._arrivals[kind] += 1
        self._wake.set()

    def cancel_samplers(self, ids: Iterable[str]) -> None:
        """Stop the requests of these samplers (or with these `SampleWork.cancel_key`s) wherever
        they are past the queue: a gathering batch fails them before it runs, a running decode
        batch drops their rows at its next step."""
        now = time.monotonic()
        self._cancelled_at.update((i, now) for i in ids)
        self._cancelled_at = {
            k: t for k, t in self._cancelled_at.items() if now - t < CANCEL_MEMORY_S
        }
        self._cancelled = frozenset(self._cancelled_at)

    def _drop_cancelled(self, batch: Batch) -> None:
        if batch.kind != "sample" or not self._cancelled:
            return
        kept = []
        for op in batch.ops:
            if self._is_cancelled(op):
                self._publish(op, EngineError(CANCELLED, "user"))
            else:
                kept.append(op)
        batch.ops[:] = kept

    def _timed(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` on the engine thread, counting its duration as busy time."""
        done, _ = self._busy
        started = time.perf_counter()
        self._busy = (done, started)
        try:
            return fn(*args)
        finally:
            self._busy = (done + time.perf_counter() - started, None)

    def busy_seconds(self) -> float:
        """Seconds the engine thread has spent on backend work since start, the work running
        now included (a decode run may last minutes): its rate is the busy fraction."""
        done, since = self._busy
        return done + (time.perf_counter() - since if since is not None else 0.0)

    def _is_cancelled(self, op: Operation) -> bool:
        ids = (getattr(op.work, "sampler_id", None), getattr(op.work, "cancel_key", None))
        return any(i is not None and i in self._cancelled for i in ids)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a direct backend call on the engine thread, between batches."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._timed, lambda: fn(*args, **kwargs))

    async def perform(self, op: EngineOperation) -> Any:
        """Run one operation on the engine thread, between batches, outside any model's order
        (creating a sampler from a checkpoint, freeing what a finished session held). Raises
        what the backend raised."""
        return await self.call(run_operation, self.backend, op)

    async def step(self) -> bool:
        batch = self.scheduler.next_batch()
        if batch is None:
            return False
        recent = time.monotonic() - self._overlap_seen_at.get(batch.kind, -math.inf)
        if self.gather_s > 0 and recent < CONCURRENCY_MEMORY_S:
            await asyncio.sleep(self.gather_s)
            self.scheduler.gather_more(batch)
        if batch.kind in self._arrivals:
            self._arrivals[batch.kind] = 0
        self._drop_cancelled(batch)
        if not batch.ops:
            return True
        self.running = (batch.kind, len(batch.ops))
        try:
            if batch.kind == "sample" and isinstance(self.backend, ContinuousSampling):
                await self._sample_continuously(batch)
                return True
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(
                self._executor, self._timed, _execute, self.backend, batch
            )
        finally:
            self.running = None
        if self._arrivals.get(batch.kind, 0) > 0:
            # Requests of this kind arrived while the batch ran: clients work concurrently.
            self._overlap_seen_at[batch.kind] = time.monotonic()
        for op, result in zip(batch.ops, results, strict=True):
            self._publish(op, result)
        return True

    def _publish(self, op: Operation, result: Any) -> None:
        outcome = self._outcome(op, result)
        if not isinstance(outcome, Outcome):
            # A finish step that stores its result off the event loop: the future resolves once
            # it is stored (a client reads the stored row right after).
            task = asyncio.ensure_future(self._publish_stored(op, result, outcome))
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)
            return
        self._resolve(op, result, outcome)

    async def _publish_stored(
        self, op: Operation, result: Any, pending: Awaitable[Outcome]
    ) -> None:
        try:
            outcome = await pending
        except Exception as exc:
            log.exception("finishing %s failed", op.request_id)
            outcome = failure(f"{type(exc).__name__}: {exc}")
        self._resolve(op, result, outcome)

    def _resolve(self, op: Operation, result: Any, outcome: Outcome) -> None:
        if not outcome.failed and self.on_success is not None:
            try:
                self.on_success(op, result)
            except Exception:  # a metering bug must not fail the user's request
                log.exception("on_success hook failed for %s", op.request_id)
        self.futures.resolve(op.request_id, outcome)

    def _answer(self, ask: _Ask, running: Footprint, passes_due: bool) -> None:
        """On the event loop, between two decode steps: what the scheduler lets run now, unless
        the engine thread stopped waiting for the answer (then nothing leaves the queue)."""
        try:
            with ask.lock:
                if not ask.abandoned:
                    joining = ask.answer = self.scheduler.between_steps(running, passes_due)
                    if joining.samples:
                        self._arrivals["sample"] = 0
                        self._overlap_seen_at["sample"] = time.monotonic()
        finally:  # a failed answer must not hold the engine thread for the whole wait
            ask.done.set()

    async def _sample_continuously(self, batch: Batch) -> None:
        """Run a sampling batch that requests join while it decodes; each result is published
        as soon as the engine delivers it, and every operation gets exactly one result."""
        loop = asyncio.get_running_loop()
        backend = self.backend
        assert isinstance(backend, ContinuousSampling)
        ops = {id(op.work): op for op in batch.ops}  # engine thread only, until it returns
        # A forward_backward pass between decode steps is followed by at least as much time of
        # decode steps before the next one: training and sampling share the engine half and
        # half while both have work, and neither stalls the other.
        last_pass = (0.0, 0.0)  # (when the last pass ended, how long it took)

        def admit() -> list[Any]:
            nonlocal last_pass
            queue = self.queue
            if self._stopping or not (queue.queued_samples() or queue.training_ready_hint()):
                return []  # no thread hop
            reads = frozenset(getattr(op.work, "sampler_id", "") for op in ops.values())
            ask = _Ask()
            passes_due = time.perf_counter() - last_pass[0] >= last_pass[1]
            try:
                loop.call_soon_threadsafe(self._answer, ask, Footprint(reads=reads), passes_due)
            except RuntimeError:  # the loop is closed
                return []
            # Bounded: a loop that is shutting down never answers. Work the loop took out of
            # the queue is run here whenever the answer came; after the wait, none is taken.
            ask.done.wait(timeout=ASK_TIMEOUT_S)
            with ask.lock:
                ask.abandoned = True
                joining = ask.answer
            if joining is None:
                return []
            for op in joining.singles:  # in their models' order, each before the next is taken
                loop.call_soon_threadsafe(self._publish, op, _run_alone(backend, op))
            if joining.training:  # several models' forward_backward chunks in one pass
                training = Batch("forward_backward", joining.training)
                pass_started = time.perf_counter()
                results = _execute(backend, training)
                ended = time.perf_counter()
                last_pass = (ended, ended - pass_started)
                for op, result in zip(training.ops, results, strict=True):
                    loop.call_soon_threadsafe(self._publish, op, result)
            ops.update((id(op.work), op) for op in joining.samples)
            return [op.work for op in joining.samples]

        def deliver(work: Any, result: Any) -> None:
            op = ops.pop(id(work), None)
            if op is not None:
                loop.call_soon_threadsafe(self._publish, op, result)

        def run() -> None:
            backend.sample_continuous(
                _works(batch, SampleWork), admit, deliver, lambda: self._cancelled
            )

        try:
            await loop.run_in_executor(self._executor, self._timed, run)
        except Exception as exc:  # a backend bug fails what it had not answered, never the loop
            log.exception("backend failed a continuous sampling batch")
            error = EngineError(f"{type(exc).__name__}: {exc}")
            await self._sample_apart(list(ops.values()), error)
            return
        for op in ops.values():
            self._publish(op, EngineError("the sampling batch ended without this request"))

    async def _sample_apart(self, left: list[Operation], error: EngineError) -> None:
        """The requests a failed decode batch had not answered, run again in halves so that
        only one that fails alone fails. A streaming request may have been told some tokens
        already (telling them again would repeat them): it gets the batch's error."""
        again = []
        for op in left:
            if self._is_cancelled(op):
                self._publish(op, EngineError(CANCELLED, "user"))
            elif getattr(op.work, "on_token", None) is not None:
                self._publish(op, error)
            else:
                again.append(op)
        if not again:
            return
        works = [cast(SampleWork, op.work) for op in again]
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(
            self._executor, self._timed, bisect_failures, self.backend.sample, works, "sample"
        )
        for op, result in zip(again, results, strict=True):
            self._publish(op, result)

    @staticmethod
    def _outcome(op: Operation, result: Any) -> Outcome | Awaitable[Outcome]:
        if isinstance(result, EngineError):
            if op.on_failure is not None:
                try:
                    op.on_failure()
                except Exception:
                    log.exception("on_failure hook failed for %s", op.request_id)
            return failure(str(result), result.category)
        try:
            return op.finish(result)
        except Exception as exc:
            log.exception("finishing %s failed", op.request_id)
            return failure(f"{type(exc).__name__}: {exc}")

    async def run(self) -> None:
        while True:
            if not await self.step():
                self._wake.clear()
                if not self.queue.has_work():
                    await self._wake.wait()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="engine-loop")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True, cancel_futures=True)
        await asyncio.gather(*self._finishing, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self.backend.close)
