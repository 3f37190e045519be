"""Operations and the queues that order them.

Training operations of one model run strictly in seq_id order (creation is seq 0); early
arrivals wait, retries of the same (model_id, seq_id) map to the first request. Models are
independent streams: one model's operation never waits for another model's. Sampling
operations carry no order and batch freely; they are admitted round-robin by tenant
(`fair_queue.py`). The queue only holds and orders; what runs when is decided by the
engine scheduler (admission.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from tuneloop.server.engine.operations import EngineOperation
from tuneloop.server.engine.types import ForwardBackwardWork, SampleWork
from tuneloop.server.scheduler.fair_queue import RoundRobin
from tuneloop.server.scheduler.futures import Outcome

OpKind = Literal["forward_backward", "single", "sample"]


def kind_of(work: EngineOperation) -> OpKind:
    """How an operation is batched: forward_backward and sample batch, the rest run alone."""
    if isinstance(work, ForwardBackwardWork):
        return "forward_backward"
    if isinstance(work, SampleWork):
        return "sample"
    return "single"


@dataclass(eq=False)
class Operation:
    """One queued request: the engine operation it asks for and how its answer is made."""

    request_id: str
    kind: OpKind  # kind_of(work)
    work: EngineOperation
    # Runs on the event loop after success: engine result -> wire outcome. One that records
    # storage returns an awaitable (its write on a thread); the future resolves after it.
    finish: Callable[[Any], Outcome | Awaitable[Outcome]]
    model_id: str | None = None
    seq_id: int | None = None
    fingerprint: str = ""
    tenant: str = ""  # whose request: sampling is admitted round-robin by tenant
    # Runs on the event loop when the engine failed the operation (e.g. to release a sampler
    # id held for it); the failure itself is answered by the loop.
    on_failure: Callable[[], None] | None = None


class SeqConflictError(Exception):
    """A seq_id reused with different content, or one that already ran and was forgotten."""


@dataclass
class _Stream:
    next_seq: int = 0
    pending: dict[int, Operation] = field(default_factory=dict)
    # seq -> (request_id, fingerprint) of everything ever accepted, for deduplication.
    seen: dict[int, tuple[str, str]] = field(default_factory=dict)
    # seq ids whose request was rejected: the SDKs never reuse a seq_id, so the stream must
    # step over them or every later request of the model would wait forever.
    skipped: set[int] = field(default_factory=set)

    def advance(self) -> None:
        while self.next_seq in self.skipped:
            self.skipped.discard(self.next_seq)
            self.next_seq += 1


@dataclass
class Batch:
    kind: OpKind
    ops: list[Operation]


class OperationQueue:
    def __init__(self, max_sample_batch: int = 64) -> None:
        self._streams: dict[str, _Stream] = {}
        self._samples: RoundRobin[Operation] = RoundRobin(lambda op: op.tenant)
        self._max_sample_batch = max_sample_batch
        self._training_waiting = 0  # sum of the streams' pending, kept for queued_training()
        # Whether some model's next operation is here, recomputed on the event loop after
        # every change: the engine thread reads it between decode steps (a plain read) to
        # skip asking the loop for work when there is none to give.
        self._ready_hint = False

    # ---- submission -------------------------------------------------------------------------

    def existing(self, model_id: str, seq_id: int, fingerprint: str) -> str | None:
        """The request id of an identical earlier submission; SeqConflictError if it differs."""
        stream = self._streams.get(model_id)
        if stream is None or seq_id not in stream.seen:
            if stream is not None and seq_id < stream.next_seq:
                raise SeqConflictError(f"seq_id {seq_id} already ran on {model_id}")
            return None
        request_id, seen_fingerprint = stream.seen[seq_id]
        if not request_id:
            raise SeqConflictError(f"seq_id {seq_id} on {model_id} was rejected; use a new one")
        if seen_fingerprint != fingerprint:
            raise SeqConflictError(
                f"seq_id {seq_id} was already used on {model_id} with different content"
            )
        return request_id

    def submit_training(self, op: Operation) -> None:
        assert op.model_id is not None
        assert op.seq_id is not None
        stream = self._streams.setdefault(op.model_id, _Stream())
        stream.seen[op.seq_id] = (op.request_id, op.fingerprint)
        if op.seq_id not in stream.pending:
            self._training_waiting += 1
        stream.pending[op.seq_id] = op
        self._changed()

    def skip(self, model_id: str, seq_id: int, fingerprint: str) -> None:
        """Consume a seq_id whose request was rejected, so later ones still run."""
        stream = self._streams.setdefault(model_id, _Stream())
        if seq_id < stream.next_seq or seq_id in stream.seen:
            return
        stream.seen[seq_id] = ("", fingerprint)
        stream.skipped.add(seq_id)
        stream.advance()
        self._changed()

    def unblocks_waiting(self, model_id: str, seq_id: int) -> bool:
        """Whether accepted later operations of the model wait for `seq_id` to arrive."""
        stream = self._streams.get(model_id)
        return stream is not None and any(seq > seq_id for seq in stream.pending)

    def submit_sample(self, op: Operation) -> None:
        self._samples.append(op)

    def peek_sample(self) -> Operation | None:
        """The request `take_samples(1)` would hand out next."""
        return self._samples.peek()

    def take_samples(self, limit: int) -> list[Operation]:
        """Up to `limit` more queued sampling operations: one per tenant in turn, each
        tenant's oldest first."""
        return self._samples.take(limit)

    def queued_samples(self) -> int:
        """How many sampling operations wait (a plain read: safe from the engine thread)."""
        return len(self._samples)

    def queued_training(self) -> int:
        """How many training operations wait, ready or not (a plain read, as above)."""
        return self._training_waiting

    def training_ready_hint(self) -> bool:
        """`training_ready()` as of the queue's last change (a plain read, as above)."""
        return self._ready_hint

    def _changed(self) -> None:
        self._ready_hint = bool(self.ready_runs())

    def waiting_by_model(self) -> dict[str, int]:
        """Training operations accepted and not yet run, per model id (the console's view)."""
        return {m: len(s.pending) for m, s in self._streams.items() if s.pending}

    def training_ready(self) -> bool:
        """Whether some model has a training-side operation ready to run now."""
        return bool(self.ready_runs())

    @property
    def max_sample_batch(self) -> int:
        return self._max_sample_batch

    def forget_model(self, model_id: str) -> list[Operation]:
        """Drop a model's stream; return its pending operations so their futures can fail."""
        stream = self._streams.pop(model_id, None)
        if stream is None:
            return []
        self._training_waiting -= len(stream.pending)
        self._changed()
        return list(stream.pending.values())

    def drop_samples(self, keep: Callable[[Operation], bool]) -> list[Operation]:
        return self._samples.remove(lambda op: not keep(op))

    def drop_requests(self, request_ids: Collection[str]) -> list[Operation]:
        """Take these operations out of the queue unrun (their API key was revoked). A dropped
        training operation's seq_id counts as consumed, so later ones of its model still run."""
        dropped = self.drop_samples(lambda op: op.request_id not in request_ids)
        for stream in self._streams.values():
            for seq_id, op in list(stream.pending.items()):
                if op.request_id in request_ids:
                    del stream.pending[seq_id]
                    self._training_waiting -= 1
                    stream.skipped.add(seq_id)
                    dropped.append(op)
            stream.advance()
        self._changed()
        return dropped

    # ---- what is ready ----------------------------------------------------------------------

    def ready_runs(self) -> list[list[Operation]]:
        """Per model, the run of consecutive ready operations starting at next_seq."""
        runs = []
        for stream in self._streams.values():
            run: list[Operation] = []
            seq = stream.next_seq
            while seq in stream.pending or seq in stream.skipped:
                if seq in stream.pending:
                    run.append(stream.pending[seq])
                seq += 1
            if run:
                runs.append(run)
        return runs

    def leading_forward_backward(self, skip: set[str | None] | None = None) -> list[Operation]:
        """The leading run of forward_backward chunks of every model (but those in `skip`)."""
        out: list[Operation] = []
        for run in self.ready_runs():
            if skip and run[0].model_id in skip:
                continue
            for op in run:
                if op.kind != "forward_backward":
                    break
                out.append(op)
        return out

    def take(self, ops: list[Operation]) -> None:
        """Take ready training operations out to run (each its model's next, in order)."""
        for op in ops:
            assert op.model_id is not None
            assert op.seq_id is not None
            stream = self._streams[op.model_id]
            del stream.pending[op.seq_id]
            self._training_waiting -= 1
            stream.next_seq = op.seq_id + 1
            stream.advance()
        self._changed()

    def queued(self) -> list[Operation]:
        """Every operation waiting: each model's training ones, then the samples (metrics)."""
        training = [op for stream in self._streams.values() for op in stream.pending.values()]
        return training + list(self._samples)

    def has_work(self) -> bool:
        return bool(self._samples) or bool(self.ready_runs())
