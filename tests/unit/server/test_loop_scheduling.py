"""The engine loop runs an operation that touches nothing a running decode batch reads between
its steps (an optim_step or save of adapter X does not wait for sampler S's long batch), and
holds one that does touch it until the batch ends."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from tests.unit.server.test_scheduler import finish, outcome, submit
from tuneloop.server.engine.operations import CreateAdapter, CreateSampler, OptimStep
from tuneloop.server.engine.types import AdamStep, AdapterSpec, EngineError
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.loop import EngineLoop
from tuneloop.server.scheduler.queue import Operation, OperationQueue

STEP = AdamStep(1e-3, 0.9, 0.95, 1e-8, 0.0, 1.0)


class Work:
    """A sampling request of `sampler_id` that takes `steps` decode steps."""

    def __init__(self, sampler_id: str, steps: int) -> None:
        self.sampler_id, self.steps = sampler_id, steps
        self.cancel_key = None
        self.on_token = None


class DecodingBackend:
    """Decodes in 10 ms steps and logs what the engine thread did, step by step."""

    trains_between_decode_steps = True

    def __init__(self) -> None:
        self.events: list[str] = []
        self.steps = 0

    def create_adapter(self, spec: AdapterSpec) -> None:
        self.events.append(f"create {spec.adapter_id} at step {self.steps}")

    def optim_step(self, adapter_id: str, step: AdamStep) -> dict[str, float]:
        self.events.append(f"optim {adapter_id} at step {self.steps}")
        if adapter_id == "broken":
            raise EngineError("no adapter 'broken'", "user")
        return {"optim/lr": step.learning_rate}

    def create_sampler(self, sampler_id: str, base_model: str, **_kw: Any) -> None:
        self.events.append(f"sampler {sampler_id} at step {self.steps}")

    def forward_backward(self, batch: Sequence[Any]) -> list[Any]:
        time.sleep(0.04)  # a training pass: four decode steps' time
        self.events.append(f"pass {batch[0].adapter_id} at step {self.steps}")
        return [{"loss": 1.0} for _ in batch]

    def sample_continuous(
        self,
        batch: Sequence[Work],
        admit: Callable[[], Sequence[Work]],
        deliver: Callable[[Work, Any], None],
        cancelled: Callable[[], Any] = frozenset,
    ) -> None:
        left = {id(w): [w, w.steps] for w in batch}
        while left:
            time.sleep(0.01)
            self.steps += 1
            for key, (work, n) in list(left.items()):
                if n <= 1:
                    del left[key]
                    deliver(work, {"sampled": work.sampler_id})
                else:
                    left[key][1] = n - 1
            for work in admit():
                left[id(work)] = [work, work.steps]
        self.events.append(f"batch ended at step {self.steps}")

    def close(self) -> None:
        pass


def _spec(adapter_id: str) -> AdapterSpec:
    return AdapterSpec(adapter_id, "base", 4, 0)


def _training(model: str, seq: int, work: Any) -> Operation:
    return Operation("", "single", work, finish, model, seq, f"{model}/{seq}")


async def test_an_optim_step_of_x_is_not_held_behind_a_long_batch_of_sampler_s() -> None:
    backend = DecodingBackend()
    queue, futures = OperationQueue(), FutureTable()
    loop = EngineLoop(backend, queue, futures)  # type: ignore[arg-type]
    long = submit(queue, futures, Operation("", "sample", Work("s", 60), finish))  # type: ignore[arg-type]
    step = asyncio.create_task(loop.step())
    await asyncio.sleep(0.05)  # decoding
    created = submit(queue, futures, _training("x", 0, CreateAdapter(_spec("x"))))
    stepped = submit(queue, futures, _training("x", 1, OptimStep("x", STEP)))
    failing = submit(queue, futures, _training("broken", 0, OptimStep("broken", STEP)))
    loop.notify("single")
    answered = await asyncio.wait_for(futures.wait(stepped, "t", 5.0), 5.0)
    assert answered is not None
    assert not step.done()  # answered while the long request still decodes
    assert await outcome(futures, created) == {"result": None}
    assert await outcome(futures, stepped) == {"result": {"optim/lr": 1e-3}}
    # A failure there is its own request's, as anywhere.
    assert await outcome(futures, failing) == {"error": "no adapter 'broken'", "category": "user"}
    assert await step
    assert await outcome(futures, long) == {"result": {"sampled": "s"}}
    of_x = [e for e in backend.events if " x " in e]
    assert [e.split(" ")[0] for e in of_x] == ["create", "optim"]
    create_at, optim_at = (int(e.rsplit(" ", 1)[1]) for e in of_x)
    assert create_at < optim_at < 60  # in x's order, and both during the batch
    assert backend.events[-1] == "batch ended at step 60"
    await loop.stop()


async def test_an_operation_on_what_the_batch_reads_waits_for_those_rows() -> None:
    backend = DecodingBackend()
    queue, futures = OperationQueue(), FutureTable()
    loop = EngineLoop(backend, queue, futures)  # type: ignore[arg-type]
    for work in (Work("s", 20), Work("u", 40)):
        submit(queue, futures, Operation("", "sample", work, finish))  # type: ignore[arg-type]
    step = asyncio.create_task(loop.step())
    await asyncio.sleep(0.05)
    # Re-creating the sampler being read must not happen under its running rows.
    clash = submit(queue, futures, _training("x", 0, CreateSampler("s", "base", adapter_id="x")))
    later = submit(queue, futures, Operation("", "sample", Work("t", 1), finish))  # type: ignore[arg-type]
    assert await step
    assert await outcome(futures, clash) == {"result": None}
    # It ran once s's rows were done (step 20), while u's still decoded; the sample that
    # arrived after it did not join before it.
    assert backend.events == ["sampler s at step 20", "batch ended at step 40"]
    assert await outcome(futures, later) == {"result": {"sampled": "t"}}
    await loop.stop()


async def test_on_failure_runs_for_a_failed_operation_only() -> None:
    """A failed operation's hook runs on the event loop (a snapshot frees its sampler id);
    a successful one's does not."""
    backend = DecodingBackend()
    queue, futures = OperationQueue(), FutureTable()
    loop = EngineLoop(backend, queue, futures)  # type: ignore[arg-type]
    told: list[str] = []
    for model in ("broken", "fine"):
        o = _training(model, 0, OptimStep(model, STEP))
        o.on_failure = lambda model=model: told.append(model)
        submit(queue, futures, o)
    assert await loop.step()
    assert told == ["broken"]
    await loop.stop()


async def test_work_is_neither_lost_nor_doubled_when_the_event_loop_answers_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine thread waits only so long for the event loop between two decode steps. An
    answer it gave up on takes nothing out of the queue, and one given in time is run, so an
    operation queued while the loop is stalled still runs, once, in its model's order."""
    from tuneloop.server.scheduler import loop as loop_module

    monkeypatch.setattr(loop_module, "ASK_TIMEOUT_S", 0.02)
    backend = DecodingBackend()
    queue, futures = OperationQueue(), FutureTable()
    loop = EngineLoop(backend, queue, futures)  # type: ignore[arg-type]
    submit(queue, futures, Operation("", "sample", Work("s", 80), finish))  # type: ignore[arg-type]
    step = asyncio.create_task(loop.step())
    await asyncio.sleep(0.05)  # decoding
    ids = [
        submit(queue, futures, _training("x", 0, CreateAdapter(_spec("x")))),
        submit(queue, futures, _training("x", 1, OptimStep("x", STEP))),
    ]
    loop.notify("single")
    for _ in range(5):  # the loop stalls past the engine thread's wait, again and again
        time.sleep(0.05)  # noqa: ASYNC251 - stalls the event loop on purpose
        await asyncio.sleep(0)
    assert await step
    for request_id in ids:
        assert not (await outcome(futures, request_id)).get("error")
    of_x = [e.split(" ")[0] for e in backend.events if " x " in e]
    assert of_x == ["create", "optim"]  # each once, in order
    await loop.stop()


async def test_training_passes_between_decode_steps_get_at_most_the_decode_steps_time() -> None:
    """A forward_backward pass between decode steps is followed by as much time of decode steps
    before the next: a 40 ms pass by about four 10 ms steps, so a stream of training cannot
    stall the decode batch, nor the reverse."""
    from tuneloop.server.engine.types import ForwardBackwardWork

    backend = DecodingBackend()
    queue, futures = OperationQueue(), FutureTable()
    loop = EngineLoop(backend, queue, futures)  # type: ignore[arg-type]
    submit(queue, futures, Operation("", "sample", Work("s", 100), finish))  # type: ignore[arg-type]
    step = asyncio.create_task(loop.step())
    await asyncio.sleep(0.05)  # decoding
    ids = []
    for seq_id in range(10):  # x's loop: forward_backward, optim_step, forward_backward, ...
        work: Any = (
            ForwardBackwardWork("x", (), "cross_entropy", {}, False)
            if seq_id % 2 == 0
            else OptimStep("x", STEP)
        )
        kind = "forward_backward" if seq_id % 2 == 0 else "single"
        ids.append(
            submit(queue, futures, Operation("", kind, work, finish, "x", seq_id, str(seq_id)))
        )
    loop.notify("forward_backward")
    assert await step
    for request_id in ids:
        assert "error" not in await outcome(futures, request_id)
    passes = [int(e.rsplit(" ", 1)[1]) for e in backend.events if e.startswith("pass x")]
    assert len(passes) == 5
    assert passes[-1] < 100  # all during the batch
    gaps = [b - a for a, b in itertools.pairwise(passes)]
    assert min(gaps) >= 3, passes  # each pass earned by the decode steps after the one before
    await loop.stop()
