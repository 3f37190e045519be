"""The engine loop narrows a batch that raises down to the request that fails alone: every other
request of the batch gets its own result, on the batched and the continuous path."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from tests.unit.server.test_continuous_sampling import StepBackend
from tests.unit.server.test_scheduler import StubBackend, op, outcome, sample_op, submit
from tuneloop.server.engine.types import EngineError
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.loop import EngineLoop
from tuneloop.server.scheduler.queue import OperationQueue


class Touchy(StubBackend):
    """Raises for a whole batch whenever a poisoned item is in it (a user error for
    "u:..." items, a bug for the others), like a backend whose shared pass one request breaks."""

    def __init__(self, poison: set[str]) -> None:
        super().__init__(fail=set())
        self.poison = poison

    def _check(self, batch: Sequence[str]) -> None:
        hit = [w for w in batch if w in self.poison]
        if hit:
            if hit[0].startswith("u"):
                raise EngineError(f"your {hit[0]} is broken", "user")
            raise ValueError(f"{hit[0]} broke the batch")

    def forward_backward(self, batch: Sequence[str]) -> list[Any]:
        self.batches.append(list(batch))
        self._check(batch)
        return [f"ok {w}" for w in batch]

    def sample(self, batch: Sequence[str]) -> list[Any]:
        self.batches.append(list(batch))
        self._check(batch)
        return [f"ok {w}" for w in batch]


async def test_a_raising_batch_fails_only_the_requests_that_fail_alone() -> None:
    queue, futures = OperationQueue(), FutureTable()
    backend = Touchy(poison={"c:0", "u:0"})
    loop = EngineLoop(backend, queue, futures)  # type: ignore[arg-type]
    trained = {m: submit(queue, futures, op(m, 0)) for m in ("a", "b", "c", "d", "u", "e")}
    assert await loop.step()
    assert backend.batches[0] == ["a:0", "b:0", "c:0", "d:0", "u:0", "e:0"]  # one batch first
    for m in "abde":
        assert await outcome(futures, trained[m]) == {"result": f"ok {m}:0"}
    bug = await outcome(futures, trained["c"])
    assert bug["category"] == "server"
    assert "c:0 broke the batch" in bug["error"]
    assert await outcome(futures, trained["u"]) == {
        "error": "your u:0 is broken",
        "category": "user",
    }
    sampled = [submit(queue, futures, sample_op(s)) for s in ("s1", "poisoned", "s2")]
    backend.poison = {"poisoned"}
    assert await loop.step()
    assert await outcome(futures, sampled[0]) == {"result": "ok s1"}
    assert (await outcome(futures, sampled[1]))["category"] == "server"
    assert await outcome(futures, sampled[2]) == {"result": "ok s2"}
    await loop.stop()


class TouchyDecode(StepBackend):
    """A continuous decode batch that raises at its second step while "bad:N" is in it, and
    whose plain `sample` raises for "bad:N" alone too."""

    def sample_continuous(
        self,
        batch: Sequence[str],
        admit: Callable[[], Sequence[str]],
        deliver: Callable[[str, Any], None],
        cancelled: Callable[[], Any] = frozenset,
    ) -> None:
        left = {w: int(w.split(":")[1]) for w in batch}
        while left:
            time.sleep(0.01)
            self.steps += 1
            if self.steps >= 2 and any(w.startswith("bad") for w in left):
                raise RuntimeError("a row broke the decode batch")
            for w in [w for w, n in left.items() if n <= 1]:
                del left[w]
                deliver(w, f"ok {w}")
            left = {w: n - 1 for w, n in left.items()}

    def sample(self, batch: Sequence[str]) -> list[Any]:
        self.batches.append(list(batch))
        if any(w.startswith("bad") for w in batch):
            raise RuntimeError("a row broke the decode batch")
        return [f"ok {w}" for w in batch]


async def test_a_raising_decode_batch_runs_again_apart_what_it_had_not_answered() -> None:
    queue, futures = OperationQueue(), FutureTable()
    backend = TouchyDecode()
    loop = EngineLoop(backend, queue, futures)  # type: ignore[arg-type]
    ids = {w: submit(queue, futures, sample_op(w)) for w in ("quick:1", "slow:5", "bad:4", "x:3")}
    assert await loop.step()
    assert await outcome(futures, ids["quick:1"]) == {"result": "ok quick:1"}  # before the fault
    assert await outcome(futures, ids["slow:5"]) == {"result": "ok slow:5"}
    assert await outcome(futures, ids["x:3"]) == {"result": "ok x:3"}
    failed = await outcome(futures, ids["bad:4"])
    assert failed["category"] == "server"
    assert "broke the decode batch" in failed["error"]
    assert ["quick:1"] not in backend.batches  # what was answered is not run again
    await loop.stop()
