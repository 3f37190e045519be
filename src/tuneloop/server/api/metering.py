"""Token metering: counted in memory as work completes, written to the registry in batches.

Completed forward_backward and sample operations are counted here on the event loop; a
background task writes the sums to the registry every FLUSH_INTERVAL_S (and on session finish,
on shutdown, and before a usage read), so no request pays for an SQLite write. Failed or
rejected work is never counted: the engine loop reports only operations that succeeded.

Kinds:
- "train": input tokens of forward_backward datums (not forward-only);
- "forward": input tokens of forward-only datums;
- "sample_prompt": prompt tokens of a sample request, once per request whatever num_samples
  is (the prompt is prefilled once);
- "sample_generated": tokens generated, summed over every returned sequence.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from tuneloop.server.engine.types import ForwardBackwardWork, SampleResult, SampleWork
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.queue import Operation
from tuneloop.server.storage.registry import Registry, UsageCount, UsageTotal

log = logging.getLogger(__name__)

KINDS = ("train", "forward", "sample_prompt", "sample_generated")
# Usage is for accounting and dashboards: a few seconds of lag is fine, and one write per
# interval instead of one per request keeps SQLite out of the request path.
FLUSH_INTERVAL_S = 2.0

_Key = tuple[str, str, str, str]  # tenant, session_id, model_id, kind


def session_of(model_or_sampler_id: str) -> str:
    # The wire protocol fixes these ids as "{session_id}:train:{n}" and
    # "{session_id}:sample:{n}" (spec 2.8), so the session needs no registry read here.
    return model_or_sampler_id.split(":", 1)[0]


class Meter:
    """Thread-safe counters per (tenant, session, model, kind), drained into the registry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Held across drain + write, so a flush that returns has seen every earlier count
        # committed, even one a concurrent flush had drained.
        self._flush_lock = threading.Lock()
        self._counts: dict[_Key, list[int]] = {}

    def add(
        self, tenant: str, session_id: str, model_id: str, kind: str, tokens: int, requests: int = 1
    ) -> None:
        with self._lock:
            counts = self._counts.setdefault((tenant, session_id, model_id, kind), [0, 0])
            counts[0] += tokens
            counts[1] += requests

    def _drain(self) -> list[UsageCount]:
        with self._lock:
            drained, self._counts = self._counts, {}
        return [UsageCount(*key, tokens, requests) for key, (tokens, requests) in drained.items()]

    def _restore(self, counts: list[UsageCount]) -> None:
        for c in counts:
            self.add(c.tenant, c.session_id, c.model_id, c.kind, c.tokens, c.requests)

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


def record_completed(meter: Meter, futures: FutureTable, op: Operation, result: Any) -> None:
    """Count one successfully completed operation (the engine loop's completion hook)."""
    tenant = futures.tenant(op.request_id)
    if tenant is None:
        return
    work = op.work
    if isinstance(work, ForwardBackwardWork):
        tokens = sum(int(example.tokens.size) for example in work.examples)
        kind = "forward" if work.forward_only else "train"
        meter.add(tenant, session_of(work.adapter_id), work.adapter_id, kind, tokens)
    elif isinstance(work, SampleWork) and isinstance(result, SampleResult):
        session_id = session_of(work.sampler_id)
        meter.add(tenant, session_id, work.sampler_id, "sample_prompt", int(work.prompt.size))
        generated = sum(len(s.tokens) for s in result.sequences)
        meter.add(tenant, session_id, work.sampler_id, "sample_generated", generated)


def summarize(totals: list[UsageTotal]) -> tuple[dict[str, int], dict[str, int]]:
    """(tokens per kind, requests per kind), every kind present, summed over tenants."""
    tokens = dict.fromkeys(KINDS, 0)
    requests = dict.fromkeys(KINDS, 0)
    for t in totals:
        tokens[t.kind] = tokens.get(t.kind, 0) + t.tokens
        requests[t.kind] = requests.get(t.kind, 0) + t.requests
    return tokens, requests
