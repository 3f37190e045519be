"""Operations that touch nothing a decode batch reads run between its steps on the real torch
engine (forward_backward passes included), and change nothing the batch draws: its tokens are
those it draws alone; a worker group, whose ranks are inside their decode sessions, runs them
after the batch instead."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.unit.engine.conftest import (
    TINY,
    adam,
    adapter_spec,
    example,
    forward,
    max_diff,
    ok,
    seq,
    stepping,
    work,
)
from tuneloop.server.engine.operations import CreateAdapter, CreateSampler, OptimStep, SaveState
from tuneloop.server.engine.types import SampleWork
from tuneloop.server.scheduler.futures import FutureTable, Outcome
from tuneloop.server.scheduler.loop import EngineLoop
from tuneloop.server.scheduler.queue import Operation, OperationQueue, kind_of


def _long_sample(sampler_id: str) -> SampleWork:
    return SampleWork(
        sampler_id=sampler_id,
        prompt=seq(12, 7),
        num_samples=2,
        max_tokens=120,
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        seed=11,
        stop_token_ids=(),
        stop_strings=(),
    )


def _finish(result: Any) -> Outcome:
    return Outcome(json.dumps({"ok": True}).encode(), "application/json")


def _keeping(results: list[Any]) -> Any:
    def finish(result: Any) -> Outcome:
        results.append(result)
        return _finish(result)

    return finish


async def test_training_operations_run_mid_decode_and_leave_its_draw_unchanged(
    backend: Any, tmp_path: Path
) -> None:
    backend.create_adapter(adapter_spec("x"))
    ok(backend.forward_backward([work("x", [example(seq(16, 3))])])[0])
    backend.create_sampler("sx", TINY, adapter_id="x")
    [alone] = backend.sample([_long_sample("sx")])
    reference = [s.tokens for s in ok(alone).sequences]
    trained = example(seq(20, 5))
    before = forward(backend, "x", [trained])  # forward-only: accumulates nothing

    queue, futures = OperationQueue(), FutureTable()
    loop = EngineLoop(backend, queue, futures)
    sampled: list[Any] = []
    long = futures.create("t", "Sample")
    queue.submit_sample(Operation(long, "sample", _long_sample("sx"), sampled.append))
    step = await stepping(loop)
    ops = [
        ("x", 1, work("x", [trained])),  # a training pass between two decode steps
        ("x", 2, OptimStep("x", adam())),
        ("x", 3, SaveState("x", tmp_path / "saved", True, False, "tinker://x/weights/saved")),
        ("x", 4, CreateSampler("sx2", TINY, adapter_id="x")),
        ("y", 0, CreateAdapter(adapter_spec("y"))),
    ]
    queue.skip("x", 0, "")  # x was created above, outside the queue
    ids = []
    passes: list[Any] = []
    for model, seq_id, op in ops:
        request_id = futures.create("t", "op")
        done = _finish if kind_of(op) != "forward_backward" else _keeping(passes)
        queue.submit_training(
            Operation(request_id, kind_of(op), op, done, model, seq_id, f"{model}{seq_id}")
        )
        ids.append(request_id)
    loop.notify("single")
    for request_id in ids:
        answer = await asyncio.wait_for(futures.wait(request_id, "t", 30.0), 30.0)
        assert answer is not None
        assert json.loads(answer.body) == {"ok": True}, answer.body
        assert not step.done(), "answered only after the decode batch ended"
    # The pass saw the adapter as it was: its logprobs are the forward's before it.
    assert max_diff(passes[0].logprobs, before) < 1e-6
    assert await step
    assert [s.tokens for s in sampled[0].sequences] == reference
    assert (tmp_path / "saved").is_dir()
    # The snapshot taken mid-decode is of the stepped adapter, not of the one sampled.
    assert set(backend.sampler_state("sx2")[1]) == set(backend.sampler_state("sx")[1])
    stepped = backend.sampler_state("sx2")[1]
    frozen = backend.sampler_state("sx")[1]
    assert any(not np.allclose(stepped[k].numpy(), frozen[k].numpy()) for k in stepped)
    await loop.stop()


async def test_a_worker_group_runs_training_queued_mid_decode_after_the_batch(
    group: Any, single: Any
) -> None:
    """The ranks are inside their decode sessions: what is queued waits for the batch to end,
    new samples with it, and then runs; the batch draws what one process draws alone."""
    for be in (group, single):
        be.create_adapter(adapter_spec("gx"))
        be.create_sampler("gsx", TINY, adapter_id="gx")
    [alone] = single.sample([_long_sample("gsx")])
    queue, futures = OperationQueue(), FutureTable()
    loop = EngineLoop(group, queue, futures)
    assert not loop.scheduler.train_between_steps
    sampled: list[Any] = []
    long = futures.create("t", "Sample")
    queue.submit_sample(Operation(long, "sample", _long_sample("gsx"), sampled.append))
    step = await stepping(loop)
    queue.skip("gx", 0, "")  # created above, outside the queue
    stepped = futures.create("t", "op")
    queue.submit_training(
        Operation(stepped, "single", OptimStep("gx", adam()), _finish, "gx", 1, "gx1")
    )
    loop.notify("single")
    assert await asyncio.wait_for(step, 60.0)
    assert [s.tokens for s in sampled[0].sequences] == [s.tokens for s in ok(alone).sequences]
    assert await loop.step()  # the optim_step, now that the ranks are free
    answer = await asyncio.wait_for(futures.wait(stepped, "t", 30.0), 30.0)
    assert answer is not None
    assert json.loads(answer.body) == {"ok": True}, answer.body
    # Not loop.stop(): it would close the module's shared group and engine.
