"""What a restarted worker group is restored from, kept in the server process.

Every adapter's factors and optimizer state as of its last optim_step (or creation, load),
in host memory; the forward_backward requests applied since then, to replay (gradients
accumulate across calls until optim_step, and a dead worker takes its share with it); the
samplers' specs and factors. Every `disk_every` steps an adapter's snapshot is also written to
disk in the checkpoint layout, so an operator can recover it even if the server process dies.
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine import checkpoints
from tuneloop.server.engine.types import AdapterSpec, ForwardBackwardWork

log = logging.getLogger(__name__)
DISK_EVERY_STEPS = 10


@dataclass
class AdapterRecord:
    spec: AdapterSpec
    factors: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    steps: int = 0
    disk: Path | None = None  # the latest state on disk: a disk snapshot or a save_state


@dataclass(frozen=True)
class SamplerRecord:
    base_model: str
    spec: AdapterSpec | None = None  # None: the base model alone
    factors: dict[str, torch.Tensor] | None = None


@dataclass
class Snapshots:
    directory: Path | None = None
    disk_every: int = DISK_EVERY_STEPS
    adapters: dict[str, AdapterRecord] = field(default_factory=dict)
    samplers: dict[str, SamplerRecord] = field(default_factory=dict)
    # forward_backward batches (only requests that succeeded and trained) since the snapshot of
    # each adapter they name, in the order they ran
    pending: list[list[ForwardBackwardWork]] = field(default_factory=list)

    def set_adapter(
        self, spec: AdapterSpec, factors: dict[str, torch.Tensor], optimizer: dict[str, Any]
    ) -> None:
        """A created or loaded adapter: its state now; gradients start from zero."""
        self.drop_pending(spec.adapter_id)
        steps = int(optimizer.get("tuneloop_steps", 0))
        self.adapters[spec.adapter_id] = AdapterRecord(spec, factors, optimizer, steps)

    def stepped(
        self, adapter_id: str, factors: dict[str, torch.Tensor], optimizer: dict[str, Any]
    ) -> None:
        """An optim_step applied: the new state, and its gradients are spent."""
        record = self.adapters[adapter_id]
        record.factors, record.optimizer = factors, optimizer
        record.steps += 1
        self.drop_pending(adapter_id)
        if (
            self.directory is not None
            and self.disk_every > 0
            and record.steps % self.disk_every == 0
        ):
            target = self.directory / _safe(adapter_id)
            checkpoints.write_adapter(target, record.spec, factors, optimizer, record.steps)
            record.disk = target

    def saved(self, adapter_id: str, directory: Path) -> None:
        if adapter_id in self.adapters:
            self.adapters[adapter_id].disk = directory

    def trained(self, works: list[ForwardBackwardWork]) -> None:
        if works:
            self.pending.append(works)

    def drop_pending(self, adapter_id: str) -> None:
        """Gradients of the adapter are gone (stepped, loaded over, cleared, deleted)."""
        batches = [[w for w in batch if w.adapter_id != adapter_id] for batch in self.pending]
        self.pending = [batch for batch in batches if batch]

    def remove_adapter(self, adapter_id: str) -> None:
        self.drop_pending(adapter_id)
        record = self.adapters.pop(adapter_id, None)
        if self.directory is not None and record is not None:
            shutil.rmtree(self.directory / _safe(adapter_id), ignore_errors=True)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)
