"""Per-step training curves and recent throughput, recorded from what the engine completes.

The engine loop tells `RunCurves.record` of every operation that succeeded (after its finish
step, so the run's step count already includes an optim_step). forward_backward results of a run
accumulate until its next optim_step, which closes the step: one point with the step's
forward_backward metrics (`:sum` metrics summed over the step's calls, others averaged), the
optim_step's metrics, the tokens trained and the seconds since the run's previous step closed
(None for the first step this process saw). Points go to the registry database
(storage/run_metrics.py). Tokens of every class are also kept for the last minute in memory, for
the operator view's tokens per second.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tuneloop.server.engine.types import (
    ForwardBackwardResult,
    ForwardBackwardWork,
    SampleResult,
    SampleWork,
)
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.queue import Operation
from tuneloop.server.storage.registry import Registry
from tuneloop.server.storage.run_metrics import RunMetricsStore

__all__ = ["MAX_TRACKED_RUNS", "THROUGHPUT_WINDOW_S", "RunCurves"]

log = logging.getLogger(__name__)
THROUGHPUT_WINDOW_S = 60.0
# Runs whose step state is held in memory; past this the least recently stepped are forgotten
# (their next step then has no step time), so a server that saw many runs holds no more.
MAX_TRACKED_RUNS = 10_000
OPTIM_STEP = "OptimStep"  # the request type api/training.py gives optim_step futures


@dataclass
class _Pending:
    """forward_backward results of a run since its last optim_step."""

    calls: int = 0
    tokens: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, tokens: int, metrics: dict[str, float]) -> None:
        self.calls += 1
        self.tokens += tokens
        for name, value in metrics.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(value)
            self.counts[name] = self.counts.get(name, 0) + 1

    def metrics(self) -> dict[str, float]:
        return {
            name: total if name.endswith(":sum") else total / self.counts[name]
            for name, total in self.sums.items()
        }


class RunCurves:
    def __init__(
        self,
        store: RunMetricsStore,
        registry: Registry,
        futures: FutureTable,
        clock: Any = time.monotonic,
    ) -> None:
        self.store = store
        self.registry = registry
        self.futures = futures
        self.clock = clock
        self._pending: dict[str, _Pending] = {}
        self._last_step_at: dict[str, float] = {}
        # (completed at, tenant, token class, tokens), the last THROUGHPUT_WINDOW_S of them
        self._recent: collections.deque[tuple[float, str, str, int]] = collections.deque()

    def record(self, op: Operation, result: Any) -> None:
        """The engine loop's completion hook (on the event loop)."""
        tenant = self.futures.tenant(op.request_id)
        if tenant is None:
            return
        work = op.work
        now = self.clock()
        if isinstance(work, ForwardBackwardWork) and isinstance(result, ForwardBackwardResult):
            tokens = sum(int(example.tokens.size) for example in work.examples)
            if work.forward_only:
                self._count(now, tenant, "prefill", tokens)
                return
            self._count(now, tenant, "trained", tokens)
            self._pending.setdefault(work.adapter_id, _Pending()).add(tokens, result.metrics)
            if len(self._pending) > MAX_TRACKED_RUNS:  # runs that never step: oldest first
                self._pending.pop(next(iter(self._pending)))
        elif isinstance(work, SampleWork) and isinstance(result, SampleResult):
            self._count(now, tenant, "prefill", int(work.prompt.size))
            self._count(now, tenant, "sampled", sum(len(s.tokens) for s in result.sequences))
        elif (
            op.model_id is not None
            and isinstance(result, dict)
            and self.futures.kind(op.request_id, tenant) == OPTIM_STEP
        ):
            self._close_step(op.model_id, tenant, now, result)

    def _close_step(self, run_id: str, tenant: str, now: float, optim: dict[str, Any]) -> None:
        pending = self._pending.pop(run_id, _Pending())
        previous = self._last_step_at.pop(run_id, None)
        self._last_step_at[run_id] = now  # re-inserted: the dict is ordered by last step
        while len(self._last_step_at) > MAX_TRACKED_RUNS:
            self.forget(next(iter(self._last_step_at)))
        run = self.registry.training_run(run_id, tenant)
        if run is None:
            return
        metrics = pending.metrics()
        metrics |= {k: float(v) for k, v in optim.items() if isinstance(v, int | float)}
        self.store.record(
            run_id,
            tenant,
            run.training_step,
            trained_tokens=pending.tokens,
            step_s=now - previous if previous is not None else None,
            metrics=metrics,
        )

    def forget(self, run_id: str) -> None:
        self._pending.pop(run_id, None)
        self._last_step_at.pop(run_id, None)

    def _count(self, now: float, tenant: str, token_class: str, tokens: int) -> None:
        self._recent.append((now, tenant, token_class, tokens))
        while self._recent and now - self._recent[0][0] > THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def tokens_per_s(self, tenant: str | None = None) -> dict[str, float]:
        """Tokens per second by class over the last THROUGHPUT_WINDOW_S (all tenants if None)."""
        now = self.clock()
        totals = {"prefill": 0, "sampled": 0, "trained": 0}
        for at, who, token_class, tokens in self._recent:
            if now - at <= THROUGHPUT_WINDOW_S and (tenant is None or who == tenant):
                totals[token_class] += tokens
        return {k: v / THROUGHPUT_WINDOW_S for k, v in totals.items()}
