"""`ShardedGroupBackend`: a worker group whose ranks hold 1/N each of the base weights (FSDP2).

The replicated group (group.py) divides the work: each rank holds a whole model and runs its
share of a batch. Here no rank holds a whole model: every forward all-gathers each layer from
all ranks, so every rank must run every forward. The group therefore sends each call to every
rank with the same data (the whole training batch, the whole sampling batch) and takes rank 0's
reply; the ranks' replies are the same bits (sharded_runtime.py). What is kept from the
replicated group: the calls, the snapshots and the recovery (a rank that dies restarts the whole
group, which restores every adapter and sampler from the server's copies and replays the
forward_backward requests since each adapter's last step; the call in flight then runs again).

Continuous sampling keeps its meaning: requests that arrive while a batch decodes join it at
the next decode step, and tokens stream per step. Every rank decodes every request, so the
group decides at each step, once for all ranks, what joins and what is cancelled
(sharded_session.py); rank 0 streams and answers. Ray actors, which have no pipe to stream on,
sample whole batches in turn, as a replicated group of them does.

Save and load: LoRA factors are not sharded (fsdp.py), so rank 0 writes the same PEFT files one
process writes, and any group size (one process included) reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tuneloop.server.engine.types import (
    EngineError,
    ForwardBackwardResult,
    ForwardBackwardWork,
    SampleResult,
    SampleWork,
)
from tuneloop.server.engine.workers.group import WorkerGroupBackend
from tuneloop.server.engine.workers.protocol import Call, Failure, engine_item
from tuneloop.server.engine.workers.sharded_session import LockstepContinuousRun

__all__ = ["ShardedGroupBackend", "describe_memory"]

log = logging.getLogger(__name__)


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def describe_memory(reports: Sequence[dict[str, Any]]) -> str:
    """One line per rank and model: what it holds for weights, adapters, optimizer, KV cache."""
    lines = []
    for report in reports:
        for name, m in report["models"].items():
            lines.append(
                f"rank {report['rank']} {name}: weights {_mb(m['weights'])} of "
                f"{_mb(m['weights_total'])} ({_mb(m['weights_replicated'])} replicated), "
                f"adapters {_mb(m['adapters'])}, optimizer {_mb(m['optimizer'])}, "
                f"KV cache {_mb(m['kv_cache'])}"
            )
    return "\n".join(lines)


class ShardedGroupBackend(WorkerGroupBackend):
    continuous_run = LockstepContinuousRun
    rank_memory: list[dict[str, Any]]

    def _start(self) -> list[Any]:
        hellos = super()._start()
        self.rank_memory = [hello["memory"] for hello in hellos]
        log.warning("sharded worker group, per rank:\n%s", describe_memory(self.rank_memory))
        return hellos

    def memory(self) -> list[dict[str, Any]]:
        """What each rank holds now (bytes per model: weights, adapters, optimizer, KV cache)."""
        reports: list[dict[str, Any]] = self._run(lambda: self._all("memory"))
        self.rank_memory = reports
        return reports

    def live_tensor_bytes(self) -> list[int]:
        """Per rank, the bytes of every live tensor (weights, factors, KV pools, buffers)."""
        return [int(n) for n in self._run(lambda: self._all("live_tensor_bytes"))]

    def _same_on_all(self, method: str, *args: Any) -> Any:
        """`method` on every rank with the same arguments; rank 0's reply (a rank that failed
        as a whole raises, after every rank took back the gradients of this call)."""
        replies = self._call({rank: Call(method, args) for rank in range(self.size)})
        failure = next((r for r in replies.values() if isinstance(r, Failure)), None)
        if failure is not None:
            if method == "forward_backward":
                self._all("revert_gradients")
            if failure.traceback:
                log.error("a worker failed a call:\n%s", failure.traceback)
            raise failure.error.error()
        return replies[0]

    def _forward_backward(
        self, batch: list[ForwardBackwardWork], record: bool = True
    ) -> list[ForwardBackwardResult | EngineError]:
        results = [engine_item(x) for x in self._same_on_all("forward_backward", batch)]
        if record:
            self._snap.trained(
                [
                    work
                    for work, result in zip(batch, results, strict=True)
                    if not work.forward_only and not isinstance(result, EngineError)
                ]
            )
        return results

    def sample(self, batch: Sequence[SampleWork]) -> list[SampleResult | EngineError]:
        def op() -> list[SampleResult | EngineError]:
            return [engine_item(x) for x in self._same_on_all("sample", list(batch))]

        return self._run(op)
