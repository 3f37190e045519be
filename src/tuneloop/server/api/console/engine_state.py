"""The operator view of the engine: queues, the running batch, KV use, throughput, workers.

Read from what the scheduler and the backend expose, never by calling into the engine thread:
the view must not wait behind a long batch. Parts a backend does not have (a KV cache on the
fake backend, workers on a single-process one) are None and shown as such.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tuneloop.server.api.console.curves import RunCurves
from tuneloop.server.api.state import ServerState
from tuneloop.server.engine.backend import ReportsKVCache

__all__ = ["EngineState", "WorkerGroupState", "engine_state", "worker_group_state"]


@dataclass(frozen=True)
class WorkerGroupState:
    workers: int
    pids: list[int]
    alive: int
    generation: int
    restarts: int
    last_recovery_s: float | None


@dataclass(frozen=True)
class EngineState:
    backend: str
    models: list[str]
    # Training operations waiting, per base model and per run; sampling requests waiting.
    training_waiting_by_model: dict[str, int]
    training_waiting_by_run: dict[str, int]
    samples_waiting: int
    running: tuple[str, int] | None
    kv_tokens_in_use: int | None
    kv_token_budget: int | None
    tokens_per_s: dict[str, float]
    futures_in_table: int
    workers: WorkerGroupState | None

    def as_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["running"] = (
            {"kind": self.running[0], "operations": self.running[1]} if self.running else None
        )
        out["workers"] = dict(self.workers.__dict__) if self.workers else None
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def worker_group_state(backend: Any) -> WorkerGroupState | None:
    """The worker group's workers, pids alive, generation and restarts; None for a backend
    that runs in this process."""
    pids_of = getattr(backend, "worker_pids", None)
    if pids_of is None:
        return None
    pids = list(pids_of())
    return WorkerGroupState(
        workers=int(getattr(backend, "size", len(pids))),
        pids=pids,
        # Ray workers run on other hosts: their pids are not ours to check.
        alive=sum(_alive(p) for p in pids),
        generation=int(getattr(backend, "generation", 0)),
        restarts=int(getattr(backend, "restarts", 0)),
        last_recovery_s=getattr(backend, "last_recovery_s", None),
    )


def engine_state(state: ServerState, curves: RunCurves) -> EngineState:
    backend = state.engine.backend
    by_run = state.queue.waiting_by_model()
    by_model: dict[str, int] = {}
    for run_id, waiting in by_run.items():
        run = state.registry.training_run_any_tenant(run_id)
        name = run.base_model if run is not None else "(being created)"
        by_model[name] = by_model.get(name, 0) + waiting
    # The metrics' reading (counters of the KV pools, safe while a decode step runs); a
    # backend with no KV cache (the fake one) reports a budget of 0.
    kv = backend.kv_cache_use() if isinstance(backend, ReportsKVCache) else None
    kv = kv if kv is not None and kv.token_budget else None
    return EngineState(
        backend=type(backend).__name__,
        models=sorted(state.models),
        training_waiting_by_model=by_model,
        training_waiting_by_run=by_run,
        samples_waiting=state.queue.queued_samples(),
        running=state.engine.running,
        kv_tokens_in_use=kv.tokens if kv is not None else None,
        kv_token_budget=kv.token_budget if kv is not None else None,
        tokens_per_s=curves.tokens_per_s(),
        futures_in_table=len(state.futures),
        workers=worker_group_state(backend),
    )
