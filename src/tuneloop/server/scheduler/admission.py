"""`EngineScheduler`: the one place that decides what the engine runs next.

The queue (queue.py) holds what waits: each model's training operations in seq_id order and the
sampling requests, round-robin by tenant (fair_queue.py). The scheduler decides, at the two
points where the engine can take work:

- **between batches** (`next_batch`): training and sampling take turns so neither starves;
  training batches every model's leading forward_backward chunks into one pass, or runs each
  model's next single operation in one engine trip; sampling takes the tenants' requests in turn,
  as many as the KV cache has blocks for.
- **between two decode steps of a running sampling batch** (`between_steps`): training work that
  touches nothing the batch reads runs now (each model's next single operation, and the leading
  forward_backward chunks of the models whose next operation is one: a training step of adapter
  X need not wait for the sampling of snapshot S to drain); the requests that join the batch are
  taken in tenant turns up to the KV blocks still free, so when the cache is full the next
  tenant, not the oldest request, gets the blocks that free up. Training work that does touch
  what the batch reads (deleting the sampler it reads, for instance) keeps new requests out, so
  that the batch ends and that work gets its turn.

The KV figures are the backend's counters (`ReportsKVCache.kv_cache_use`, safe to read while a
step runs); the engine still checks each request against its block pool, so the scheduler's
estimate (the worst case, counting no prefix-cache hits) only keeps requests in the fair queue
that would otherwise wait inside the engine in arrival order. A backend without counters (a
worker group, whose ranks each hold a pool) gets the batch-size limit alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tuneloop.server.engine.backend import KVCacheUse
from tuneloop.server.engine.kv.block_manager import worst_case_blocks
from tuneloop.server.engine.operations import Footprint, footprint
from tuneloop.server.engine.types import SampleWork
from tuneloop.server.scheduler.queue import Batch, Operation, OperationQueue

__all__ = ["EngineScheduler", "Joining"]


@dataclass
class Joining:
    """What runs between two decode steps."""

    singles: list[Operation] = field(default_factory=list)  # each alone, in models' order
    training: list[Operation] = field(default_factory=list)  # forward_backward, one batch
    samples: list[Operation] = field(default_factory=list)  # join the decode batch


class EngineScheduler:
    def __init__(
        self,
        queue: OperationQueue,
        kv: Callable[[], KVCacheUse | None] = lambda: None,
        train_between_steps: bool = True,
    ) -> None:
        self.queue = queue
        self._kv = kv
        # Whether the backend can run training work between the decode steps of a sampling
        # batch (one process can; a worker group's ranks are inside their decode sessions).
        self.train_between_steps = train_between_steps
        self._turn = 0

    # ---- between batches ----------------------------------------------------------------------

    def next_batch(self) -> Batch | None:
        """Pick the next batch, taking turns between training and sampling so neither starves."""
        queue = self.queue
        candidates: list[Batch] = []
        single = [run[0] for run in queue.ready_runs() if run[0].kind != "forward_backward"]
        fwdbwd = queue.leading_forward_backward()
        if single:
            candidates.append(Batch("single", single))
        if fwdbwd:
            candidates.append(Batch("forward_backward", fwdbwd))
        if queue.queued_samples():
            candidates.append(Batch("sample", []))  # taken below, only if chosen
        if not candidates:
            return None
        self._turn += 1
        chosen = candidates[self._turn % len(candidates)]
        if chosen.kind == "sample":
            chosen.ops.extend(self._take_samples(queue.max_sample_batch, running=False))
        else:
            queue.take(chosen.ops)
        return chosen

    def gather_more(self, batch: Batch) -> None:
        """Add to `batch`, not yet started, what arrived while it waited for company."""
        if batch.kind == "sample":
            room = self.queue.max_sample_batch - len(batch.ops)
            batch.ops.extend(self._take_samples(room, running=False, taken=batch.ops))
        elif batch.kind == "forward_backward":
            skip: set[str | None] = {op.model_id for op in batch.ops}
            more = self.queue.leading_forward_backward(skip)
            self.queue.take(more)
            batch.ops.extend(more)

    # ---- between decode steps -----------------------------------------------------------------

    def between_steps(self, running: Footprint, passes_due: bool = True) -> Joining:
        """What runs between two decode steps of a sampling batch that reads `running`.

        `passes_due`: whether forward_backward passes may run now; the loop says no until the
        decode steps since the last pass have had as much time as it took, so that neither
        side starves the other (single operations are short and always run)."""
        queue = self.queue
        joining = Joining()
        if self.train_between_steps:
            # A model's operations all touch its own adapter, so its next one decides.
            clear = [run for run in queue.ready_runs() if not _conflicts(run[0], running)]
            joining.singles = [run[0] for run in clear if run[0].kind == "single"]
            if passes_due:
                held: set[str | None] = {run[0].model_id for run in queue.ready_runs()} - {
                    run[0].model_id for run in clear if run[0].kind == "forward_backward"
                }
                joining.training = queue.leading_forward_backward(held)
            queue.take(joining.singles + joining.training)
        if any(
            not self.train_between_steps or _conflicts(run[0], running)
            for run in queue.ready_runs()
        ):
            # Training work is ready that cannot run now: new requests wait, so that the
            # batch ends and it gets its turn.
            return joining
        joining.samples = self._take_samples(queue.max_sample_batch, running=True)
        return joining

    # ---- KV-cache room ------------------------------------------------------------------------

    def _take_samples(
        self, limit: int, *, running: bool, taken: list[Operation] | None = None
    ) -> list[Operation]:
        """Up to `limit` queued requests in tenant turns, as many as the KV cache has room for
        by their worst case. At least one when the engine holds nothing waiting (it answers a
        request that can never fit with an error, and runs one larger than what is free once
        the cache drains)."""
        use = self._kv()
        if use is None or use.block_size <= 0:
            return self.queue.take_samples(limit)
        if running and use.waiting:
            return []  # the engine already holds requests it has no blocks for
        room = use.free_blocks if running else use.total_blocks
        room -= sum(_blocks(op, use.block_size) for op in taken or ())
        out: list[Operation] = []
        while len(out) < limit:
            head = self.queue.peek_sample()
            if head is None:
                break
            need = _blocks(head, use.block_size)
            if need > room and (out or taken or (running and use.running)):
                break
            out.extend(self.queue.take_samples(1))
            room -= need
        return out


def _conflicts(op: Operation, running: Footprint) -> bool:
    return footprint(op.work).conflicts(running)


def _blocks(op: Operation, block_size: int) -> int:
    work = op.work
    if not isinstance(work, SampleWork):
        return 0
    return worst_case_blocks(len(work.prompt), work.num_samples, work.max_tokens, block_size)
