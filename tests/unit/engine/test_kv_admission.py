"""Under KV-cache pressure the real engine admits the next tenant, not the oldest request: a
tenant's one request arriving behind another's flood is answered after a few of the flood's,
not after all of them, and every request still gets what it draws alone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from tests.unit.engine.conftest import TINY, ok, seq, stepping
from tuneloop.server.engine.kv.block_manager import worst_case_blocks
from tuneloop.server.engine.types import SampleWork
from tuneloop.server.scheduler.futures import FutureTable, Outcome
from tuneloop.server.scheduler.loop import EngineLoop
from tuneloop.server.scheduler.queue import Operation, OperationQueue

BLOCK = 16
POOL = 16  # blocks: room for four requests at a time
FLOOD = 20


def _work(seed: int) -> SampleWork:
    return SampleWork("s", seq(12, seed), 1, 40, 1.0, -1, 1.0, seed, (), ())


async def test_a_lone_tenant_gets_freed_blocks_before_a_flood_drains(tmp_path: Path) -> None:
    from tuneloop.server.engine.torch_backend import TorchBackend

    assert worst_case_blocks(12, 1, 40, BLOCK) * 4 == POOL
    backend = TorchBackend(
        [TINY],
        cache_dir=tmp_path,
        device="cpu",
        sample_token_budget=POOL * BLOCK,
        kv_block_size=BLOCK,
    )
    try:
        backend.create_sampler("s", TINY)
        lone_work = _work(999)
        [alone] = backend.sample([lone_work])
        queue, futures = OperationQueue(), FutureTable()
        loop = EngineLoop(backend, queue, futures)
        order: list[str] = []
        results: dict[str, Any] = {}

        def finish(name: str) -> Any:
            def done(result: Any) -> Outcome:
                order.append(name)
                results[name] = result
                return Outcome(b"{}", "application/json")

            return done

        flood = [f"a{i}" for i in range(FLOOD)]
        for i, name in enumerate(flood):
            request_id = futures.create("t", "Sample")
            queue.submit_sample(Operation(request_id, "sample", _work(i), finish(name), tenant="A"))
        step = await stepping(loop)
        lone = futures.create("t", "Sample")
        queue.submit_sample(Operation(lone, "sample", lone_work, finish("b"), tenant="B"))
        assert await asyncio.wait_for(step, 120.0)
        assert sorted(order) == sorted([*flood, "b"])
        # Four decode at a time; B takes the first blocks that free up after it arrives.
        assert order.index("b") <= 8, order
        assert [s.tokens for s in results["b"].sequences] == [s.tokens for s in ok(alone).sequences]
        assert np.isfinite(results["a0"].sequences[0].logprobs).all()
    finally:
        backend.close()
