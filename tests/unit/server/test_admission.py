"""The engine scheduler: what runs between decode steps, and sampling admission by KV room."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from tuneloop.server.engine.backend import KVCacheUse
from tuneloop.server.engine.kv.block_manager import worst_case_blocks
from tuneloop.server.engine.operations import CreateSampler, Footprint, OptimStep
from tuneloop.server.engine.types import AdamStep, ForwardBackwardWork, SampleWork
from tuneloop.server.scheduler.admission import EngineScheduler
from tuneloop.server.scheduler.futures import Outcome
from tuneloop.server.scheduler.queue import Operation, OperationQueue, kind_of

STEP = AdamStep(1e-3, 0.9, 0.95, 1e-8, 0.0, 1.0)
RUNNING = Footprint(reads=frozenset({"sampler-s"}))  # the decode batch reads one snapshot


def finish(result: Any) -> Outcome:
    return Outcome(json.dumps({"result": result}).encode(), "application/json")


def training(model: str, seq_id: int, work: Any) -> Operation:
    return Operation(f"{model}/{seq_id}", kind_of(work), work, finish, model, seq_id, "")


def fwdbwd(adapter: str) -> ForwardBackwardWork:
    return ForwardBackwardWork(adapter, (), "cross_entropy", {}, forward_only=False)


def sample(tenant: str, name: str, prompt: int = 8, n: int = 1, new: int = 16) -> Operation:
    work = SampleWork("sampler-s", np.zeros(prompt, np.int64), n, new, 1.0, -1, 1.0, 0, (), ())
    return Operation(name, "sample", work, finish, tenant=tenant)


def names(ops: list[Operation]) -> list[str]:
    return [op.request_id for op in ops]


def kv(free: int, *, running: int = 1, waiting: int = 0, total: int = 64) -> KVCacheUse:
    return KVCacheUse(0, total * 16, 0, 16, total, free, running, waiting)


def test_unrelated_training_runs_between_steps_and_samples_still_join() -> None:
    queue = OperationQueue()
    sched = EngineScheduler(queue)
    queue.submit_training(training("x", 0, fwdbwd("x")))
    queue.submit_training(training("x", 1, fwdbwd("x")))
    queue.submit_training(training("x", 2, OptimStep("x", STEP)))
    queue.submit_training(training("y", 0, OptimStep("y", STEP)))
    queue.submit_sample(sample("t", "s0"))
    joining = sched.between_steps(RUNNING)
    assert names(joining.training) == ["x/0", "x/1"]  # both chunks, one pass
    assert names(joining.singles) == ["y/0"]
    assert names(joining.samples) == ["s0"]  # nothing ready conflicts: sampling goes on
    # x's optim_step is next in x's order: it runs at the next step boundary, after the pass.
    assert names(sched.between_steps(RUNNING).singles) == ["x/2"]
    assert queue.queued_training() == 0


def test_training_that_touches_what_the_batch_reads_waits_and_holds_new_samples() -> None:
    queue = OperationQueue()
    sched = EngineScheduler(queue)
    # Re-creating the sampler the batch reads must wait for the batch to end.
    queue.submit_training(training("y", 0, CreateSampler("sampler-s", "base", adapter_id="y")))
    queue.submit_training(training("x", 0, fwdbwd("x")))
    queue.submit_sample(sample("t", "s0"))
    joining = sched.between_steps(RUNNING)
    assert names(joining.training) == ["x/0"]
    assert joining.singles == []
    assert joining.samples == []  # so that the batch drains and y's operation gets its turn
    assert queue.queued_training() == 1
    assert queue.queued_samples() == 1


def test_a_backend_that_cannot_train_mid_batch_lets_the_batch_drain() -> None:
    queue = OperationQueue()
    sched = EngineScheduler(queue, train_between_steps=False)
    queue.submit_training(training("x", 0, OptimStep("x", STEP)))
    queue.submit_sample(sample("t", "s0"))
    joining = sched.between_steps(RUNNING)
    assert (joining.singles, joining.training, joining.samples) == ([], [], [])
    batch = sched.next_batch()  # once the batch ended, training and sampling take turns
    assert batch is not None
    assert batch.kind in ("single", "sample")


def test_samples_join_up_to_the_free_kv_blocks_in_tenant_turns() -> None:
    queue = OperationQueue()
    use = kv(free=0)
    sched = EngineScheduler(queue, lambda: use)
    for i in range(6):
        queue.submit_sample(sample("flood", f"f{i}", prompt=8, new=16))
    each = worst_case_blocks(8, 1, 16, 16)
    assert each == 2
    assert sched.between_steps(RUNNING).samples == []  # the cache is full: they stay queued
    use = kv(free=each + 1)
    assert names(sched.between_steps(RUNNING).samples) == ["f0"]
    queue.submit_sample(sample("late", "l0", prompt=8, new=16))
    use = kv(free=2 * each)
    # Blocks freed: the tenant that waited gets them first, not the flood's next request.
    assert names(sched.between_steps(RUNNING).samples) == ["l0", "f1"]
    use = kv(free=100, waiting=1)
    assert sched.between_steps(RUNNING).samples == []  # the engine holds one it cannot start
    use = kv(free=100)
    assert names(sched.between_steps(RUNNING).samples) == ["f2", "f3", "f4", "f5"]


def test_one_request_is_taken_when_nothing_runs_even_if_it_is_larger_than_what_is_free() -> None:
    queue = OperationQueue()
    use = kv(free=1, running=0)
    sched = EngineScheduler(queue, lambda: use)
    queue.submit_sample(sample("t", "big", prompt=64, n=4, new=64))
    queue.submit_sample(sample("t", "next"))
    # The engine runs it alone with what it has, or answers it with an error.
    assert names(sched.between_steps(RUNNING).samples) == ["big"]
    batch_queue = OperationQueue(max_sample_batch=8)
    between = EngineScheduler(batch_queue, lambda: kv(free=0, running=0, total=4))
    for i in range(3):
        batch_queue.submit_sample(sample("t", f"s{i}", prompt=8, new=16))
    batch = between.next_batch()  # a new batch is sized by the whole pool: two fit in 4 blocks
    assert batch is not None
    assert names(batch.ops) == ["s0", "s1"]
    between.gather_more(batch)
    assert names(batch.ops) == ["s0", "s1"]
