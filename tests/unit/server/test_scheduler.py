"""OperationQueue ordering and batching policy, and the EngineLoop's failure isolation."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import pytest

from tuneloop.server.engine.operations import OptimStep
from tuneloop.server.engine.types import AdamStep, EngineError
from tuneloop.server.scheduler.admission import EngineScheduler
from tuneloop.server.scheduler.futures import FutureTable, Outcome
from tuneloop.server.scheduler.loop import EngineLoop
from tuneloop.server.scheduler.queue import (
    Batch,
    Operation,
    OperationQueue,
    OpKind,
    SeqConflictError,
)


def finish(result: Any) -> Outcome:
    return Outcome(json.dumps({"result": result}).encode(), "application/json")


def op(model: str, seq: int, kind: OpKind = "forward_backward", fingerprint: str = "") -> Operation:
    return Operation(
        f"{model}/{seq}", kind, f"{model}:{seq}", finish, model, seq, fingerprint or f"{seq}"
    )


def sample_op(name: str) -> Operation:
    return Operation(name, "sample", name, finish)


def ids(batch: Batch | None) -> list[str]:
    assert batch is not None
    return [o.request_id for o in batch.ops]


def drain(queue: OperationQueue) -> list[Batch]:
    sched = EngineScheduler(queue)
    out = []
    while (batch := sched.next_batch()) is not None:
        out.append(batch)
    return out


# ---- ordering ----------------------------------------------------------------------------------


def test_early_arrivals_wait_for_their_turn() -> None:
    queue = OperationQueue()
    sched = EngineScheduler(queue)
    queue.submit_training(op("m", 2, "single"))
    queue.submit_training(op("m", 1))
    assert sched.next_batch() is None  # seq 0 (creation) has not arrived
    assert not queue.has_work()
    queue.submit_training(op("m", 0, "single"))
    assert queue.has_work()
    assert ids(sched.next_batch()) == ["m/0"]
    assert ids(sched.next_batch()) == ["m/1"]
    assert ids(sched.next_batch()) == ["m/2"]
    assert sched.next_batch() is None


def test_a_gap_blocks_only_its_own_model() -> None:
    queue = OperationQueue()
    sched = EngineScheduler(queue)
    for o in (op("a", 0, "single"), op("a", 2, "single"), op("b", 0, "single")):
        queue.submit_training(o)
    assert ids(sched.next_batch()) == ["a/0", "b/0"]
    assert sched.next_batch() is None
    queue.submit_training(op("a", 1, "single"))
    assert [ids(b) for b in drain(queue)] == [["a/1"], ["a/2"]]


def test_dedup_and_conflict() -> None:
    queue = OperationQueue()
    queue.submit_training(op("m", 0, "single", fingerprint="create"))
    assert queue.existing("m", 0, "create") == "m/0"
    with pytest.raises(SeqConflictError):
        queue.existing("m", 0, "different")
    assert queue.existing("m", 1, "x") is None
    assert queue.existing("other", 0, "create") is None
    queue.submit_training(op("m", 2, "single", fingerprint="early"))
    assert queue.existing("m", 2, "early") == "m/2"  # waiting, still deduplicated
    with pytest.raises(SeqConflictError):
        queue.existing("m", 2, "late")
    drain(queue)
    # After running, a retry still maps to the first request; other content conflicts.
    assert queue.existing("m", 0, "create") == "m/0"
    with pytest.raises(SeqConflictError):
        queue.existing("m", 0, "different")


# ---- batching ----------------------------------------------------------------------------------


def test_consecutive_forward_backward_chunks_and_model_heads_share_one_batch() -> None:
    queue = OperationQueue()
    sched = EngineScheduler(queue)
    for model in ("a", "b", "c"):
        queue.submit_training(op(model, 0, "single"))
    assert ids(sched.next_batch()) == ["a/0", "b/0", "c/0"]  # one engine trip for all singles
    for o in (
        op("a", 1),
        op("a", 2),
        op("a", 3),
        op("a", 4, "single"),
        op("a", 5),
        op("b", 1),
        op("c", 2),  # not ready: c's seq 1 is missing
    ):
        queue.submit_training(o)
    batch = sched.next_batch()
    assert batch is not None
    assert batch.kind == "forward_backward"
    assert ids(batch) == ["a/1", "a/2", "a/3", "b/1"]
    # a's optim step is next; the chunk after it does not jump the queue.
    assert ids(sched.next_batch()) == ["a/4"]
    assert ids(sched.next_batch()) == ["a/5"]
    assert sched.next_batch() is None


def test_samples_batch_up_to_the_limit_in_order() -> None:
    queue = OperationQueue(max_sample_batch=4)
    for i in range(10):
        queue.submit_sample(sample_op(f"s{i}"))
    batches = drain(queue)
    assert [len(b.ops) for b in batches] == [4, 4, 2]
    assert [i for b in batches for i in ids(b)] == [f"s{i}" for i in range(10)]


def test_training_and_sampling_alternate_so_neither_starves() -> None:
    queue = OperationQueue(max_sample_batch=2)
    queue.submit_training(op("m", 0, "single"))
    for seq in range(1, 41):
        queue.submit_training(op("m", seq, "forward_backward" if seq % 2 else "single"))
    for i in range(60):
        queue.submit_sample(sample_op(f"s{i}"))
    kinds = [b.kind == "sample" for b in drain(queue)]
    # While both kinds have work, no two batches in a row are of the same side.
    both = kinds[: 2 * 30]
    assert all(x != y for x, y in itertools.pairwise(both))
    assert sum(kinds) == 30  # every sample batch ran
    assert len(kinds) - sum(kinds) == 41  # and every training operation


def test_sampling_is_not_starved_by_many_models() -> None:
    queue = OperationQueue(max_sample_batch=1)
    for model in "abcdefgh":
        queue.submit_training(op(model, 0, "single"))
        for seq in range(1, 21):
            queue.submit_training(op(model, seq, "forward_backward" if seq % 2 else "single"))
    for i in range(10):
        queue.submit_sample(sample_op(f"s{i}"))
    batches = drain(queue)
    served = [i for i, b in enumerate(batches) if b.kind == "sample"]
    assert len(served) == 10
    assert max(b - a for a, b in itertools.pairwise([-1, *served])) <= 3


def test_unchosen_samples_keep_their_order() -> None:
    queue = OperationQueue(max_sample_batch=3)
    queue.submit_training(op("m", 0, "single"))
    queue.submit_training(op("m", 1))
    for i in range(5):
        queue.submit_sample(sample_op(f"s{i}"))
    order = [i for b in drain(queue) if b.kind == "sample" for i in ids(b)]
    assert order == [f"s{i}" for i in range(5)]


def test_drop_samples() -> None:
    queue = OperationQueue()
    for i in range(4):
        queue.submit_sample(sample_op(f"s{i}"))
    dropped = queue.drop_samples(lambda o: o.request_id != "s2")
    assert [o.request_id for o in dropped] == ["s2"]
    assert [i for b in drain(queue) for i in ids(b)] == ["s0", "s1", "s3"]


# ---- engine loop -------------------------------------------------------------------------------


class StubBackend:
    """Fails the items it is told to, the way a real backend reports per-request failures."""

    def __init__(self, fail: set[str], explode: bool = False) -> None:
        self.fail = fail
        self.explode = explode
        self.batches: list[list[str]] = []
        self.closed = False

    def forward_backward(self, batch: Sequence[str]) -> list[Any]:
        self.batches.append(list(batch))
        if self.explode:
            raise RuntimeError("device on fire")
        return [EngineError(f"bad {w}", "user") if w in self.fail else f"ok {w}" for w in batch]

    def sample(self, batch: Sequence[str]) -> list[Any]:
        self.batches.append(list(batch))
        return [EngineError(f"bad {w}", "user") if w in self.fail else f"ok {w}" for w in batch]

    def optim_step(self, adapter_id: str, step: AdamStep) -> Any:
        """A single operation: its answer, or the failure its adapter id asks for."""
        if adapter_id == "boom":
            raise ValueError("disk full")
        if adapter_id == "user_error":
            raise EngineError("no such checkpoint", "user")
        return step.learning_rate

    def close(self) -> None:
        self.closed = True


def optim(adapter_id: str, learning_rate: float = 1.0) -> OptimStep:
    return OptimStep(adapter_id, AdamStep(learning_rate, 0.9, 0.95, 1e-8, 0.0, 0.0))


def submit(queue: OperationQueue, futures: FutureTable, o: Operation) -> str:
    o.request_id = futures.create("t", o.kind)
    if o.kind == "sample":
        queue.submit_sample(o)
    else:
        queue.submit_training(o)
    return o.request_id


async def outcome(futures: FutureTable, request_id: str) -> dict[str, Any]:
    result = await futures.wait(request_id, "t", 0.0)
    assert result is not None
    body: dict[str, Any] = json.loads(result.body)
    return body


async def test_one_failing_item_fails_only_its_own_future() -> None:
    queue, futures = OperationQueue(), FutureTable()
    backend = StubBackend(fail={"b:0", "s1"})
    loop = EngineLoop(backend, queue, futures)  # type: ignore[arg-type]
    trained = [submit(queue, futures, op(m, 0)) for m in "abc"]
    assert await loop.step()
    assert backend.batches == [["a:0", "b:0", "c:0"]]  # one batch, three adapters
    assert [await outcome(futures, r) for r in trained] == [
        {"result": "ok a:0"},
        {"error": "bad b:0", "category": "user"},
        {"result": "ok c:0"},
    ]
    sampled = [submit(queue, futures, sample_op(f"s{i}")) for i in range(3)]
    assert await loop.step()
    assert [await outcome(futures, r) for r in sampled] == [
        {"result": "ok s0"},
        {"error": "bad s1", "category": "user"},
        {"result": "ok s2"},
    ]
    # b's stream goes on after its failure.
    later = submit(queue, futures, op("b", 1))
    assert await loop.step()
    assert await outcome(futures, later) == {"result": "ok b:1"}
    assert not await loop.step()
    await loop.stop()
    assert backend.closed


async def test_failing_single_operation_fails_only_itself() -> None:
    queue, futures = OperationQueue(), FutureTable()
    loop = EngineLoop(StubBackend(fail=set()), queue, futures)  # type: ignore[arg-type]

    works = {"a": optim("a", 1), "b": optim("boom"), "c": optim("user_error"), "d": optim("d", 4)}
    request_ids = {
        m: submit(queue, futures, Operation("", "single", w, finish, m, 0, "x"))
        for m, w in works.items()
    }
    assert await loop.step()
    assert await outcome(futures, request_ids["a"]) == {"result": 1}
    failed = await outcome(futures, request_ids["b"])
    assert failed["category"] == "server"
    assert "disk full" in failed["error"]
    assert await outcome(futures, request_ids["c"]) == {
        "error": "no such checkpoint",
        "category": "user",
    }
    assert await outcome(futures, request_ids["d"]) == {"result": 4}
    await loop.stop()


async def test_backend_raising_fails_the_batch_but_not_the_loop() -> None:
    queue, futures = OperationQueue(), FutureTable()
    backend = StubBackend(fail=set(), explode=True)
    loop = EngineLoop(backend, queue, futures)  # type: ignore[arg-type]
    first = [submit(queue, futures, op(m, 0)) for m in "ab"]
    assert await loop.step()
    for request_id in first:
        body = await outcome(futures, request_id)
        assert body["category"] == "server"
        assert "device on fire" in body["error"]
    backend.explode = False
    later = submit(queue, futures, op("a", 1))
    assert await loop.step()
    assert await outcome(futures, later) == {"result": "ok a:1"}
    await loop.stop()


async def test_a_failing_finish_fails_only_that_future() -> None:
    queue, futures = OperationQueue(), FutureTable()
    loop = EngineLoop(StubBackend(fail=set()), queue, futures)  # type: ignore[arg-type]

    def bad_finish(_result: Any) -> Outcome:
        raise KeyError("registry row")

    broken = submit(queue, futures, Operation("", "single", optim("a", 1), bad_finish, "a", 0))
    fine = submit(queue, futures, Operation("", "single", optim("b", 2), finish, "b", 0))
    assert await loop.step()
    assert (await outcome(futures, broken))["category"] == "server"
    assert await outcome(futures, fine) == {"result": 2}
    await loop.stop()
