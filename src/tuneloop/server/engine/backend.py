"""The `Backend` protocol: the one seam between the control plane and whatever runs the model.

Every method is called from a single engine thread, so implementations need no locking. Batch
methods return one result or `EngineError` per item: one bad request fails only its own future.
A batch call that raises instead must have changed nothing (no gradient accumulated): the
engine loop then runs its halves again apart (`isolation.bisect_failures`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from tuneloop.server.engine.types import (
    AdamStep,
    AdapterSpec,
    EngineError,
    ForwardBackwardResult,
    ForwardBackwardWork,
    ModelSpec,
    SampleResult,
    SampleWork,
)


class Backend(Protocol):
    def models(self) -> Sequence[ModelSpec]:
        """The base models this backend keeps resident."""
        ...

    def create_adapter(self, spec: AdapterSpec) -> None: ...

    def delete_adapter(self, adapter_id: str) -> None: ...

    def forward_backward(
        self, batch: Sequence[ForwardBackwardWork]
    ) -> list[ForwardBackwardResult | EngineError]:
        """Run every item (several adapters may share the batch); accumulate gradients."""
        ...

    def optim_step(self, adapter_id: str, step: AdamStep) -> dict[str, float]:
        """Apply and clear the accumulated gradients of one adapter."""
        ...

    def save_state(self, adapter_id: str, directory: Path, *, optimizer: bool) -> int:
        """Write adapter weights (and optimizer state) atomically; return bytes written."""
        ...

    def load_state(self, adapter_id: str, directory: Path, *, optimizer: bool) -> None: ...

    def save_sampler_weights(self, adapter_id: str, directory: Path) -> int:
        """Write the adapter weights a sampler needs (no optimizer state); return bytes."""
        ...

    def create_sampler(
        self,
        sampler_id: str,
        base_model: str,
        *,
        adapter_id: str | None = None,
        weights_dir: Path | None = None,
    ) -> None:
        """A frozen sampler: a snapshot of a live adapter, weights from disk, or the base."""
        ...

    def delete_sampler(self, sampler_id: str) -> None: ...

    def sample(self, batch: Sequence[SampleWork]) -> list[SampleResult | EngineError]: ...

    def close(self) -> None: ...


@runtime_checkable
class ContinuousSampling(Protocol):
    """A backend whose sampling batch takes in new requests while it decodes."""

    def sample_continuous(
        self,
        batch: Sequence[SampleWork],
        admit: Callable[[], Sequence[SampleWork]],
        deliver: Callable[[SampleWork, SampleResult | EngineError], None],
        cancelled: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        """Sample `batch` and whatever `admit()` returns between decode steps; `deliver` every
        request's result (or error) exactly once, as soon as it is known.

        Requests of the sampler ids `cancelled()` names (checked once per step) leave the batch
        and are answered with an error: their session is gone, so they stop costing compute.

        A backend whose class sets `trains_between_decode_steps = True` may be called, from
        inside `admit()`, for training work that touches nothing the batch reads (an
        optim_step, a forward_backward of another adapter); without it, such work waits for
        the batch to end.
        """
        ...


@dataclass(frozen=True)
class KVCacheUse:
    """What the sampler's KV cache holds now (read by the metrics, from another thread)."""

    tokens: int  # cache tokens held by running decode batches: rows x cache length
    token_budget: int  # the most one decode run may hold
    bytes: int  # memory of the held tokens: keys and values, every layer, at the model's dtype
    # What admission reads (scheduler/admission.py), of the pool decoding now; 0: no pool.
    block_size: int = 0
    total_blocks: int = 0
    free_blocks: int = 0  # neither referenced nor promised to an admitted request
    running: int = 0  # rows decoding or prefilling
    waiting: int = 0  # requests handed to the engine that wait for blocks


@runtime_checkable
class ReportsKVCache(Protocol):
    """A backend that can tell its KV-cache use; a plain read, safe while a batch runs."""

    def kv_cache_use(self) -> KVCacheUse: ...
