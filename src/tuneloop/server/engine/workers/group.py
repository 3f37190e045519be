"""`WorkerGroupBackend`: the `Backend` protocol over a group of worker processes.

Runs in the server process on the engine thread (calls never overlap). Training is data
parallel: each forward_backward batch is sharded by tokens across the ranks, each rank
accumulates the loss-sum gradients of its shard, and optim_step all-reduces (sums) them before
every rank applies the same AdamW step, so the adapters stay identical with no weights sent.
Sampling requests are split across the ranks by cost; every sampler exists on every rank.
Continuous sampling (`sample_continuous`) runs each rank's own continuous batching on its share,
admits joining requests to the least-loaded rank and streams tokens back (continuous.py; a
sharded group's ranks decode every request in lockstep instead: sharded_session.py).

Recovery: a worker that dies is seen at once (its process sentinel; a watchdog notices one
that dies between calls within a second). The whole group is then restarted and restored from
`snapshots.Snapshots`: each adapter as of its last optim_step, the forward_backward requests
applied since (replayed, so accumulated gradients come back), every sampler. The call that was
in flight is then run again: its effects died with the group, so nothing is applied twice, and
the request's future gets its result as if nothing happened. Only when the group cannot be
restored (MAX_ATTEMPTS in a row) does the call fail, with a server error.

Operations other than sampling arrive as values (`run_operation`) and travel to the ranks as
such. The module runs past 400 lines because the life cycle, the recovery and each operation's
bookkeeping in the snapshots share one lock and one snapshot, and read best together.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TypeVar, assert_never

from tuneloop.server.engine.operations import (
    CreateAdapter,
    CreateSampler,
    DeleteAdapter,
    DeleteSampler,
    LoadAdapter,
    LoadState,
    OptimStep,
    SaveSamplerWeights,
    SaveState,
    SingleOperation,
)
from tuneloop.server.engine.types import (
    AdamStep,
    AdapterSpec,
    EngineError,
    ForwardBackwardResult,
    ForwardBackwardWork,
    ModelSpec,
    SampleResult,
    SampleWork,
)
from tuneloop.server.engine.workers.continuous import (
    GroupContinuousRun,
    Streams,
    sample_in_batches,
)
from tuneloop.server.engine.workers.placement import Placement
from tuneloop.server.engine.workers.protocol import Call, Failure, WorkerDiedError, engine_item
from tuneloop.server.engine.workers.sharding import (
    merge_results,
    shard_batch,
    shard_works,
    split_samples,
)
from tuneloop.server.engine.workers.snapshots import DISK_EVERY_STEPS, SamplerRecord, Snapshots

log = logging.getLogger(__name__)
T = TypeVar("T")
# Restarts tried for one call (a request that kills its worker every time fails after these).
MAX_ATTEMPTS = 3
WATCHDOG_PERIOD_S = 0.5


class WorkerGroupBackend:
    # A sampling session over the ranks' pipes: each rank decodes its own share (a sharded
    # group's ranks decode every request together, in lockstep: sharded_session.py).
    continuous_run: type[GroupContinuousRun] = GroupContinuousRun

    def __init__(
        self,
        make_placement: Callable[[], Placement],
        *,
        state_dir: Path | None = None,
        disk_every: int = DISK_EVERY_STEPS,
    ) -> None:
        self._make_placement = make_placement
        self._state_dir = state_dir
        self._snap = Snapshots(state_dir / "snapshots" if state_dir else None, disk_every)
        # Held by every call and by the watchdog's restart: the backend is used from the engine
        # thread only, but the watchdog restarts a group whose worker died between calls.
        self._lock = threading.RLock()
        self._placement: Placement | None = None
        self.generation = 0
        self.restarts = 0
        self.last_recovery_s: float | None = None
        # time.monotonic() when the last death was seen and when the group was whole again
        self.last_detected_at: float | None = None
        self.last_restored_at: float | None = None
        hellos = self._start()
        self._models: list[ModelSpec] = list(hellos[0]["models"])
        self._closing = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="worker-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def size(self) -> int:
        return self._size

    def worker_pids(self) -> list[int]:
        """The current workers' pids (no lock: callable while a call runs)."""
        placement = self._placement
        return placement.pids() if placement is not None else []

    # ---- life cycle and recovery ----------------------------------------------------------

    def _start(self) -> list[Any]:
        placement = self._make_placement()
        try:
            hellos = placement.start()
        except BaseException:
            placement.stop(graceful=False)
            raise
        self._placement = placement
        self._size = placement.size
        self.generation += 1
        log.warning(
            "worker group %d up: %d workers, pids %s, devices %s",
            self.generation,
            placement.size,
            placement.pids(),
            [h["device"] for h in hellos],
        )
        self._write_status()
        return hellos

    def _write_status(self) -> None:
        """pids and restarts in <state_dir>/workers.json, for operators and tests."""
        if self._state_dir is None or self._placement is None:
            return
        self._state_dir.mkdir(parents=True, exist_ok=True)
        status = {
            "pids": self._placement.pids(),
            "generation": self.generation,
            "restarts": self.restarts,
            "last_recovery_s": self.last_recovery_s,
        }
        tmp = self._state_dir / "workers.json.tmp"
        tmp.write_text(json.dumps(status))
        os.replace(tmp, self._state_dir / "workers.json")

    def _stop_placement(self, graceful: bool = False) -> None:
        if self._placement is not None:
            self._placement.stop(graceful)
            self._placement = None

    def _recover(self, reason: str) -> None:
        """Restart the whole group and restore every adapter, sampler and pending gradient."""
        started = self.last_detected_at = time.monotonic()
        error = reason
        for _ in range(MAX_ATTEMPTS):
            self._stop_placement()
            try:
                self._start()
                self._restore()
            except WorkerDiedError as exc:
                error = str(exc)
                log.warning("restoring the worker group failed (%s); trying again", exc)
                continue
            self.restarts += 1
            self.last_restored_at = time.monotonic()
            self.last_recovery_s = self.last_restored_at - started
            log.warning(
                "worker group restored in %.2f s after %s: %d adapters, %d samplers, "
                "%d forward_backward batches replayed",
                self.last_recovery_s,
                reason,
                len(self._snap.adapters),
                len(self._snap.samplers),
                len(self._snap.pending),
            )
            self._write_status()
            return
        self._stop_placement()
        raise EngineError(f"the worker group could not be restarted ({error})")

    def _restore(self) -> None:
        for record in self._snap.adapters.values():
            self._all("restore_adapter", record.spec, record.factors, record.optimizer)
        for sampler_id, sampler in self._snap.samplers.items():
            self._all(
                "restore_sampler", sampler_id, sampler.base_model, sampler.spec, sampler.factors
            )
        for batch in self._snap.pending:
            self._forward_backward(batch, record=False)

    def _run(self, op: Callable[[], T]) -> T:
        """Run one call; if a worker dies, restore the group and run it again."""
        with self._lock:
            for _ in range(MAX_ATTEMPTS):
                try:
                    if self._placement is None:
                        self._recover("a failed restart")
                    elif dead := self._placement.dead():
                        self._recover(f"worker {dead[0]} died")
                    return op()
                except WorkerDiedError as exc:
                    log.warning("%s during a call; restarting the worker group", exc)
                    self._recover(str(exc))
            raise EngineError(
                f"the worker group lost a worker on this request {MAX_ATTEMPTS} times in a row"
            )

    def _watch(self) -> None:
        """Restart a group whose worker died between calls (during a call, the call sees it)."""
        while not self._closing.wait(WATCHDOG_PERIOD_S):
            if not self._lock.acquire(blocking=False):
                continue  # a call is running: it sees a death itself
            try:
                if self._closing.is_set() or self._placement is None:
                    continue
                dead = self._placement.dead()
                if dead:
                    log.warning("worker %d died between calls", dead[0])
                    self._recover(f"worker {dead[0]} died")
            except Exception:
                log.exception("the worker watchdog failed to restart the group")
            finally:
                self._lock.release()

    def close(self) -> None:
        self._closing.set()
        self._watchdog.join(timeout=5.0)
        with self._lock:
            self._stop_placement(graceful=True)

    # ---- calls to the workers ---------------------------------------------------------------

    def _call(self, calls: dict[int, Call]) -> dict[int, Any]:
        if self._placement is None:
            raise WorkerDiedError(0, "no running group")
        return self._placement.call(calls)

    def _all(self, method: str, *args: Any) -> list[Any]:
        """The same call on every rank; the first failure raised (ranks agree on engine errors:
        they hold the same adapters and samplers)."""
        replies = self._call({rank: Call(method, args) for rank in range(self.size)})
        return [_value(replies[rank]) for rank in range(self.size)]

    def _one(self, method: str, *args: Any) -> Any:
        return _value(self._call({0: Call(method, args)})[0])

    # ---- Backend ----------------------------------------------------------------------------

    def models(self) -> Sequence[ModelSpec]:
        return list(self._models)

    def forward_backward(
        self, batch: Sequence[ForwardBackwardWork]
    ) -> list[ForwardBackwardResult | EngineError]:
        return self._run(lambda: self._forward_backward(list(batch)))

    def _forward_backward(
        self, batch: list[ForwardBackwardWork], record: bool = True
    ) -> list[ForwardBackwardResult | EngineError]:
        results: dict[int, ForwardBackwardResult | EngineError] = {}
        live = list(range(len(batch)))
        while live:
            sub = [batch[i] for i in live]
            shards = shard_batch(sub, self.size)
            replies = self._call(
                {
                    rank: Call("forward_backward", (shard_works(sub, parts),))
                    for rank, parts in enumerate(shards)
                }
            )
            failure = next((r for r in replies.values() if isinstance(r, Failure)), None)
            if failure is not None:  # a rank failed as a whole: take back what the others did
                self._all("revert_gradients")
                _value(failure)
            per_rank = [[engine_item(x) for x in replies[rank]] for rank in range(self.size)]
            merged, partial = merge_results(sub, shards, per_rank)
            if not partial:
                results.update(zip(live, merged, strict=True))
                break
            # A request failed on one rank after another applied its share of gradients (a
            # datum with a non-finite loss): every rank takes the batch back, and it runs again
            # without the requests that failed.
            self._all("revert_gradients")
            for j in partial:
                results[live[j]] = merged[j]
            live = [i for j, i in enumerate(live) if j not in partial]
        ordered = [results[i] for i in range(len(batch))]
        if record:
            self._snap.trained(
                [
                    work
                    for work, result in zip(batch, ordered, strict=True)
                    if not work.forward_only and not isinstance(result, EngineError)
                ]
            )
        return ordered

    # Every operation but sampling travels to the ranks as its value (engine/operations.py):
    # the call in flight when a worker dies is that value, run again on the restored group.

    def run_operation(self, op: SingleOperation) -> Any:
        """Run `op` on the group; if a worker dies, restore the group and run it again."""
        return self._run(lambda: self._perform(op))

    def _perform(self, op: SingleOperation) -> Any:
        match op:
            case CreateAdapter(spec=spec) | LoadAdapter(spec=spec):
                self._all("operation", op)
                factors, optimizer = self._one("adapter_state", spec.adapter_id)
                self._snap.set_adapter(spec, factors, optimizer)
                return None
            case DeleteAdapter(adapter_id=adapter_id):
                self._all("operation", op)
                self._snap.remove_adapter(adapter_id)
                return None
            case OptimStep():
                return self._optim_step(op)
            case SaveState():
                size = int(self._one("operation", op))
                if op.optimizer:
                    self._snap.saved(op.adapter_id, op.directory)
                return size
            case SaveSamplerWeights():
                return int(self._one("operation", op))
            case LoadState():
                return self._load_state(op)
            case CreateSampler():
                self._all("operation", op)
                record = SamplerRecord(op.base_model)
                if op.adapter_id is not None:  # the adapter's snapshot is its current state
                    source = self._snap.adapters[op.adapter_id]
                    record = SamplerRecord(op.base_model, source.spec, source.factors)
                elif op.weights_dir is not None:
                    spec, factors = self._one("sampler_state", op.sampler_id)
                    record = SamplerRecord(op.base_model, spec, factors)
                self._snap.samplers[op.sampler_id] = record
                return None
            case DeleteSampler(sampler_id=sampler_id):
                self._all("operation", op)
                self._snap.samplers.pop(sampler_id, None)
                return None
            case _:
                assert_never(op)

    def _optim_step(self, op: OptimStep) -> dict[str, float]:
        replies = self._call(
            {r: Call("optim_step", (op.adapter_id, op.step, r == 0)) for r in range(self.size)}
        )
        failures = [r for r in replies.values() if isinstance(r, Failure)]
        if failures:
            if any(f.traceback for f in failures):  # a bug, ranks may differ: restore
                self._recover("a failed optim_step")
            else:  # the ranks refused alike (a non-finite gradient): the gradients are gone
                self._snap.drop_pending(op.adapter_id)
            _value(failures[0])
        metrics, (factors, optimizer) = replies[0]
        self._snap.stepped(op.adapter_id, factors, optimizer)
        return dict(metrics)

    def _load_state(self, op: LoadState) -> None:
        record = self._snap.adapters.get(op.adapter_id)
        if record is None:
            raise EngineError(f"no adapter {op.adapter_id!r}", "user")
        try:
            self._all("operation", op)
        except EngineError:
            # A checkpoint that does not fit may have been copied in part: back to before.
            self._all("restore_adapter", record.spec, record.factors, record.optimizer)
            self._snap.drop_pending(op.adapter_id)
            raise
        factors, state = self._one("adapter_state", op.adapter_id)
        self._snap.set_adapter(record.spec, factors, state)

    # The Backend protocol's methods, as operations.

    def create_adapter(self, spec: AdapterSpec) -> None:
        self.run_operation(CreateAdapter(spec))

    def delete_adapter(self, adapter_id: str) -> None:
        self.run_operation(DeleteAdapter(adapter_id))

    def optim_step(self, adapter_id: str, step: AdamStep) -> dict[str, float]:
        metrics: dict[str, float] = self.run_operation(OptimStep(adapter_id, step))
        return metrics

    def save_state(self, adapter_id: str, directory: Path, *, optimizer: bool) -> int:
        op = SaveState(adapter_id, directory, optimizer, overwrite=True, target=str(directory))
        size: int = self.run_operation(op)
        return size

    def save_sampler_weights(self, adapter_id: str, directory: Path) -> int:
        size: int = self.run_operation(SaveSamplerWeights(adapter_id, directory))
        return size

    def load_state(self, adapter_id: str, directory: Path, *, optimizer: bool) -> None:
        self.run_operation(LoadState(adapter_id, directory, optimizer, str(directory)))

    def create_sampler(
        self,
        sampler_id: str,
        base_model: str,
        *,
        adapter_id: str | None = None,
        weights_dir: Path | None = None,
    ) -> None:
        self.run_operation(CreateSampler(sampler_id, base_model, adapter_id, weights_dir))

    def delete_sampler(self, sampler_id: str) -> None:
        self.run_operation(DeleteSampler(sampler_id))

    def sample(self, batch: Sequence[SampleWork]) -> list[SampleResult | EngineError]:
        def op() -> list[SampleResult | EngineError]:
            parts = split_samples(batch, self.size)
            replies = self._call(
                {
                    rank: Call("sample", ([batch[i] for i in indices],))
                    for rank, indices in enumerate(parts)
                    if indices
                }
            )
            results: dict[int, SampleResult | EngineError] = {}
            for rank, reply in replies.items():
                if isinstance(reply, Failure):
                    results.update(dict.fromkeys(parts[rank], reply.error.error()))
                else:
                    results.update(zip(parts[rank], map(engine_item, reply), strict=True))
            return [results[i] for i in range(len(batch))]

        return self._run(op)

    def sample_continuous(
        self,
        batch: Sequence[SampleWork],
        admit: Callable[[], Sequence[SampleWork]],
        deliver: Callable[[SampleWork, SampleResult | EngineError], None],
        cancelled: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        """`ContinuousSampling` over the ranks (continuous.py): each decodes its share with
        continuous batching, tokens and answers are told as they arrive, and a rank's death is
        recovered from as in any call. Workers without pipes (Ray) sample whole batches."""
        with self._lock:
            try:
                if self._placement is None:
                    self._recover("a failed restart")
                elif dead := self._placement.dead():
                    self._recover(f"worker {dead[0]} died")
            except EngineError as exc:
                for work in batch:
                    deliver(work, exc)
                return
            if not isinstance(self._placement, Streams):
                sample_in_batches(self.sample, batch, admit, deliver, cancelled)
                return
            run = self.continuous_run(
                self._links, self._recover, admit, deliver, cancelled, MAX_ATTEMPTS
            )
            run.run(batch)

    def _links(self) -> list[Any]:
        if not isinstance(self._placement, Streams):
            raise WorkerDiedError(0, "no running group")
        return self._placement.links()


def _value(reply: Any) -> Any:
    if isinstance(reply, Failure):
        if reply.traceback:
            log.error("a worker failed a call:\n%s", reply.traceback)
        raise reply.error.error()
    return reply
