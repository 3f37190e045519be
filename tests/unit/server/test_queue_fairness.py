"""Sampling admission is round-robin by tenant; footprints let unrelated work pass."""

from __future__ import annotations

import json
from typing import Any

from tuneloop.server.engine.operations import (
    CreateSampler,
    DeleteSampler,
    Footprint,
    OptimStep,
    SaveState,
    footprint,
)
from tuneloop.server.engine.types import AdamStep
from tuneloop.server.scheduler.admission import EngineScheduler
from tuneloop.server.scheduler.fair_queue import RoundRobin
from tuneloop.server.scheduler.futures import Outcome
from tuneloop.server.scheduler.queue import Operation, OperationQueue

STEP = AdamStep(1e-3, 0.9, 0.95, 1e-8, 0.0, 1.0)


def finish(result: Any) -> Outcome:
    return Outcome(json.dumps({"result": result}).encode(), "application/json")


def sample(tenant: str, name: str) -> Operation:
    return Operation(name, "sample", name, finish, tenant=tenant)  # type: ignore[arg-type]


def test_one_tenants_single_sample_runs_in_the_first_batch_behind_anothers_flood() -> None:
    queue = OperationQueue(max_sample_batch=8)
    sched = EngineScheduler(queue)
    for i in range(1000):
        queue.submit_sample(sample("flood", f"f{i}"))
    queue.submit_sample(sample("lone", "l0"))
    batch = sched.next_batch()
    assert batch is not None
    names = [op.request_id for op in batch.ops]
    assert len(names) == 8
    assert "l0" in names[:2]  # second at the latest, not after 1,000 others
    # The flood keeps its own order.
    assert [n for n in names if n != "l0"] == [f"f{i}" for i in range(7)]


def test_a_late_arrival_is_served_before_the_flood_continues() -> None:
    queue = OperationQueue(max_sample_batch=4)
    for i in range(100):
        queue.submit_sample(sample("flood", f"f{i}"))
    assert [o.request_id for o in queue.take_samples(4)] == ["f0", "f1", "f2", "f3"]
    queue.submit_sample(sample("late", "l0"))
    queue.submit_sample(sample("late", "l1"))
    taken = [o.request_id for o in queue.take_samples(4)]
    assert taken[0] == "l0"  # the flood was served last: the newcomer goes first
    assert taken == ["l0", "f4", "l1", "f5"]


def test_round_robin_keeps_each_keys_order_and_drops_without_losing_turns() -> None:
    fifo: RoundRobin[tuple[str, int]] = RoundRobin(lambda item: item[0])
    for i in range(3):
        fifo.append(("a", i))
        fifo.append(("b", i))
    fifo.append(("c", 0))
    assert len(fifo) == 7
    assert fifo.remove(lambda item: item == ("b", 1)) == [("b", 1)]
    assert len(fifo) == 6
    assert fifo.take(10) == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 2), ("a", 2)]
    assert len(fifo) == 0
    assert fifo.take(1) == []


def test_drop_samples_of_one_sampler_across_tenants() -> None:
    queue = OperationQueue()
    for tenant in ("t1", "t2"):
        for i in range(3):
            queue.submit_sample(sample(tenant, f"{tenant}-{i}"))
    dropped = queue.drop_samples(lambda o: not o.request_id.endswith("-1"))
    assert sorted(o.request_id for o in dropped) == ["t1-1", "t2-1"]
    assert queue.queued_samples() == 4
    assert [o.request_id for o in queue.take_samples(10)] == ["t1-0", "t2-0", "t1-2", "t2-2"]


def test_footprints_say_what_conflicts() -> None:
    running = Footprint(reads=frozenset({"sampler-s"}))
    assert not footprint(OptimStep("adapter-x", STEP)).conflicts(running)
    save = SaveState("adapter-x", __import__("pathlib").Path("/nonexistent"), True, False, "t")
    assert not footprint(save).conflicts(running)
    assert footprint(DeleteSampler("sampler-s")).conflicts(running)
    assert footprint(CreateSampler("sampler-s", "base", adapter_id="adapter-x")).conflicts(running)
    # A snapshot reads its adapter: it must wait for the adapter's optim_step, not the reverse.
    snapshot = footprint(CreateSampler("sampler-t", "base", adapter_id="adapter-x"))
    assert snapshot.conflicts(footprint(OptimStep("adapter-x", STEP)))
    assert not snapshot.conflicts(footprint(OptimStep("adapter-y", STEP)))
