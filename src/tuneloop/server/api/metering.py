"""Token metering: counted in memory as work completes, written to the registry in batches.

Completed forward_backward, forward and sample operations are counted here on the event loop;
a background task writes the sums to the registry every FLUSH_INTERVAL_S (and on session finish,
on shutdown, and before a usage read), so no request pays for a database write. Failed or
rejected work is never counted: the engine loop reports only operations that succeeded, and a
request refused at the API never reaches it. Client-side work (reward scoring, data loading)
never reaches the server, so it costs nothing.

Token classes, per operation:
- forward_backward: the datums' input tokens are "trained";
- forward (forward-only): the datums' input tokens are "prefill";
- sample: the prompt tokens are "prefill", once per request whatever num_samples is (the prompt
  is prefilled once), and the tokens generated over every returned sequence are "sampled".

Counts are kept per (tenant, UTC hour of completion, session, training run or sampler,
operation), each with its number of requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tuneloop.server.engine.types import ForwardBackwardWork, SampleResult, SampleWork
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.queue import Operation
from tuneloop.server.storage.registry import Registry, UsageCount, utcnow

log = logging.getLogger(__name__)

OPERATIONS = ("forward_backward", "forward", "sample")
TOKEN_CLASSES = ("prefill", "sampled", "trained")
HOUR_S = 3600
# Usage is for accounting and dashboards: a few seconds of lag is fine, and one write per
# interval instead of one per request keeps the database out of the request path.
FLUSH_INTERVAL_S = 2.0

_Key = tuple[str, int, str, str, str]  # tenant, hour, session_id, model_id, operation


def hour_of(when: datetime) -> int:
    """UTC epoch seconds of the start of the hour holding `when`."""
    seconds = int(when.timestamp())
    return seconds - seconds % HOUR_S


def session_of(model_or_sampler_id: str) -> str:
    # The wire protocol fixes these ids as "{session_id}:train:{n}" and
    # "{session_id}:sample:{n}" (spec 2.8), so the session needs no registry read here.
    return model_or_sampler_id.split(":", 1)[0]


class Meter:
    """Thread-safe counters per (tenant, hour, session, model, operation), drained into the
    registry. `clock` says when work completed (a test may set it)."""

    def __init__(self, clock: Callable[[], datetime] = utcnow) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        # Held across drain + write, so a flush that returns has seen every earlier count
        # committed, even one a concurrent flush had drained.
        self._flush_lock = threading.Lock()
        # prefill, sampled, trained, requests
        self._counts: dict[_Key, list[int]] = {}

    def add(
        self,
        tenant: str,
        session_id: str,
        model_id: str,
        operation: str,
        *,
        prefill: int = 0,
        sampled: int = 0,
        trained: int = 0,
        requests: int = 1,
        hour: int | None = None,
    ) -> None:
        hour = hour_of(self.clock()) if hour is None else hour
        with self._lock:
            key = (tenant, hour, session_id, model_id, operation)
            counts = self._counts.setdefault(key, [0, 0, 0, 0])
            counts[0] += prefill
            counts[1] += sampled
            counts[2] += trained
            counts[3] += requests

    def _drain(self) -> list[UsageCount]:
        with self._lock:
            drained, self._counts = self._counts, {}
        return [UsageCount(*key, *counts) for key, counts in drained.items()]

    def _restore(self, counts: list[UsageCount]) -> None:
        for c in counts:
            self.add(
                c.tenant,
                c.session_id,
                c.model_id,
                c.operation,
                prefill=c.prefill_tokens,
                sampled=c.sampled_tokens,
                trained=c.trained_tokens,
                requests=c.requests,
                hour=c.hour,
            )

    def flush(self, registry: Registry) -> int:
        """Write the pending counts; returns how many rows changed. Blocking (SQL)."""
        with self._flush_lock:
            counts = self._drain()
            if not counts:
                return 0
            try:
                registry.add_usage(counts)
            except BaseException:
                self._restore(counts)  # a failed write loses nothing: the next flush retries
                raise
            return len(counts)

    async def flush_async(self, registry: Registry) -> int:
        """`flush` on a worker thread, so the event loop keeps serving meanwhile."""
        return await asyncio.to_thread(self.flush, registry)

    async def run_flusher(self, registry: Registry, interval_s: float = FLUSH_INTERVAL_S) -> None:
        """The background task: flush every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.flush_async(registry)
            except Exception:  # the database may be busy or gone for a moment: retry later
                log.exception("writing usage counts failed; will retry")


@dataclass(frozen=True)
class Completed:
    """The tokens one successfully completed operation counts (see the module docstring)."""

    session_id: str
    model_id: str  # the training run or sampler
    operation: str  # one of OPERATIONS
    prefill: int = 0
    sampled: int = 0
    trained: int = 0


def usage_of(op: Operation, result: Any) -> Completed | None:
    """What a completed operation counts; None for work that is not metered (optim_step...)."""
    work = op.work
    if isinstance(work, ForwardBackwardWork):
        tokens = sum(int(example.tokens.size) for example in work.examples)
        session_id = session_of(work.adapter_id)
        if work.forward_only:
            return Completed(session_id, work.adapter_id, "forward", prefill=tokens)
        return Completed(session_id, work.adapter_id, "forward_backward", trained=tokens)
    if isinstance(work, SampleWork) and isinstance(result, SampleResult):
        return Completed(
            session_of(work.sampler_id),
            work.sampler_id,
            "sample",
            prefill=int(work.prompt.size),
            sampled=sum(len(s.tokens) for s in result.sequences),
        )
    return None


def record_completed(meter: Meter, futures: FutureTable, op: Operation, result: Any) -> None:
    """Count one successfully completed operation (the engine loop's completion hook)."""
    tenant = futures.tenant(op.request_id)
    usage = usage_of(op, result)
    if tenant is None or usage is None:
        return
    meter.add(
        tenant,
        usage.session_id,
        usage.model_id,
        usage.operation,
        prefill=usage.prefill,
        sampled=usage.sampled,
        trained=usage.trained,
    )


def epoch(hour: int) -> datetime:
    return datetime.fromtimestamp(hour, UTC)
