"""Engine operations: the closed union of frozen values the control plane hands to the engine.

The API turns each request into one of these once (after validating it) and the engine runs it
with `run_operation`, one `match` over the union, so nothing above the engine holds a closure
over the backend. Being values, operations can be logged, shipped to worker ranks, run again on
a restarted worker, and compared by the scheduler: each declares the adapters and samplers it
reads and writes (`Footprint`), so an operation waits only behind work that touches what it
touches.

`ForwardBackwardWork` and `SampleWork` (engine/types.py) are members of the union as they are:
they batch, while every other operation runs alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, assert_never, runtime_checkable

from tuneloop.server.engine.backend import Backend
from tuneloop.server.engine.types import (
    AdamStep,
    AdapterSpec,
    EngineError,
    ForwardBackwardWork,
    SampleWork,
)

__all__ = [
    "CreateAdapter",
    "CreateSampler",
    "DeleteAdapter",
    "DeleteSampler",
    "EngineOperation",
    "Footprint",
    "LoadAdapter",
    "LoadState",
    "OptimStep",
    "RunsOperations",
    "SaveSamplerWeights",
    "SaveState",
    "SingleOperation",
    "footprint",
    "run_operation",
]


@dataclass(frozen=True)
class Footprint:
    """What an operation reads and writes: adapter ids and sampler ids."""

    reads: frozenset[str] = frozenset()
    writes: frozenset[str] = frozenset()

    def conflicts(self, other: Footprint) -> bool:
        """Whether the two must run in order: one writes what the other reads or writes."""
        return bool(
            self.writes & (other.reads | other.writes) or other.writes & (self.reads | self.writes)
        )


def _of(reads: tuple[str, ...] = (), writes: tuple[str, ...] = ()) -> Footprint:
    return Footprint(frozenset(reads), frozenset(writes))


@dataclass(frozen=True)
class CreateAdapter:
    spec: AdapterSpec

    @property
    def footprint(self) -> Footprint:
        return _of(writes=(self.spec.adapter_id,))


@dataclass(frozen=True)
class LoadAdapter:
    """A new adapter with a checkpoint's weights (load_weights into a new model): created,
    then loaded; a load that fails leaves no adapter behind."""

    spec: AdapterSpec
    directory: Path
    optimizer: bool
    path: str  # the checkpoint's tinker:// path, for the error message

    @property
    def footprint(self) -> Footprint:
        return _of(writes=(self.spec.adapter_id,))


@dataclass(frozen=True)
class DeleteAdapter:
    adapter_id: str

    @property
    def footprint(self) -> Footprint:
        return _of(writes=(self.adapter_id,))


@dataclass(frozen=True)
class OptimStep:
    adapter_id: str
    step: AdamStep

    @property
    def footprint(self) -> Footprint:
        return _of(writes=(self.adapter_id,))


@dataclass(frozen=True)
class SaveState:
    """Adapter weights and, with `optimizer`, its optimizer state, into `directory`."""

    adapter_id: str
    directory: Path
    optimizer: bool
    overwrite: bool
    target: str  # the checkpoint's tinker:// path, for the error message

    @property
    def footprint(self) -> Footprint:
        return _of(reads=(self.adapter_id,))


@dataclass(frozen=True)
class LoadState:
    """A checkpoint's weights (and optimizer state) into an existing adapter."""

    adapter_id: str
    directory: Path
    optimizer: bool
    path: str  # the checkpoint's tinker:// path, for the error message

    @property
    def footprint(self) -> Footprint:
        return _of(writes=(self.adapter_id,))


@dataclass(frozen=True)
class SaveSamplerWeights:
    adapter_id: str
    directory: Path

    @property
    def footprint(self) -> Footprint:
        return _of(reads=(self.adapter_id,))


@dataclass(frozen=True)
class CreateSampler:
    """A frozen sampler: a snapshot of a live adapter, weights from disk, or the base model."""

    sampler_id: str
    base_model: str
    adapter_id: str | None = None
    weights_dir: Path | None = None

    @property
    def footprint(self) -> Footprint:
        reads = (self.adapter_id,) if self.adapter_id is not None else ()
        return _of(reads=reads, writes=(self.sampler_id,))


@dataclass(frozen=True)
class DeleteSampler:
    sampler_id: str

    @property
    def footprint(self) -> Footprint:
        return _of(writes=(self.sampler_id,))


# Operations that run alone (one engine call each); the batched ones are below.
SingleOperation = (
    CreateAdapter
    | LoadAdapter
    | DeleteAdapter
    | OptimStep
    | SaveState
    | LoadState
    | SaveSamplerWeights
    | CreateSampler
    | DeleteSampler
)
EngineOperation = SingleOperation | ForwardBackwardWork | SampleWork


def footprint(op: EngineOperation) -> Footprint:
    """The adapters and samplers `op` reads and writes."""
    match op:
        case ForwardBackwardWork():
            # forward_only reads the adapter; a backward pass accumulates into its gradients.
            ids = (op.adapter_id,)
            return _of(reads=ids) if op.forward_only else _of(writes=ids)
        case SampleWork():
            return _of(reads=(op.sampler_id,))
        case _:
            return op.footprint


@runtime_checkable
class RunsOperations(Protocol):
    """A backend that takes operations as values (a worker group ships them to its ranks and
    runs the one in flight again after a restart) instead of through its methods."""

    def run_operation(self, op: SingleOperation) -> Any: ...


def run_operation(backend: Backend, op: EngineOperation) -> Any:
    """Run one operation on `backend` (on the engine thread); its result, or EngineError."""
    if isinstance(backend, RunsOperations) and not isinstance(op, ForwardBackwardWork | SampleWork):
        return backend.run_operation(op)
    match op:
        case CreateAdapter(spec=spec):
            backend.create_adapter(spec)
            return None
        case LoadAdapter(spec=spec):
            backend.create_adapter(spec)
            try:
                _load(backend, spec.adapter_id, op.directory, op.optimizer, op.path)
            except Exception:
                backend.delete_adapter(spec.adapter_id)
                raise
            return None
        case DeleteAdapter(adapter_id=adapter_id):
            backend.delete_adapter(adapter_id)
            return None
        case OptimStep(adapter_id=adapter_id, step=step):
            return backend.optim_step(adapter_id, step)
        case SaveState():
            if not op.overwrite and op.directory.exists():
                raise EngineError(
                    f"checkpoint {op.target} already exists (pass overwrite=True)", "user"
                )
            return backend.save_state(op.adapter_id, op.directory, optimizer=op.optimizer)
        case LoadState():
            _load(backend, op.adapter_id, op.directory, op.optimizer, op.path)
            return None
        case SaveSamplerWeights(adapter_id=adapter_id, directory=directory):
            return backend.save_sampler_weights(adapter_id, directory)
        case CreateSampler():
            backend.create_sampler(
                op.sampler_id, op.base_model, adapter_id=op.adapter_id, weights_dir=op.weights_dir
            )
            return None
        case DeleteSampler(sampler_id=sampler_id):
            backend.delete_sampler(sampler_id)
            return None
        case ForwardBackwardWork():
            return _alone(backend.forward_backward([op])[0])
        case SampleWork():
            return _alone(backend.sample([op])[0])
        case _:
            assert_never(op)


def _alone(result: Any) -> Any:
    if isinstance(result, EngineError):
        raise result
    return result


def _load(backend: Backend, adapter_id: str, directory: Path, optimizer: bool, path: str) -> None:
    """Load a checkpoint's files; files deleted since the request was accepted (a DELETE racing
    it, an expiry) are the caller's error, said as such, not a server failure."""
    try:
        backend.load_state(adapter_id, directory, optimizer=optimizer)
    except OSError as exc:
        raise EngineError(
            f"checkpoint {path!r} was deleted, or its files are gone, before it loaded: {exc}",
            "user",
        ) from None
