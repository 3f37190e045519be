"""The finish steps of training operations: what a successful create, load or save stores in
the registry (a run's row, a checkpoint package's row) and how its answer reads. They run on
the event loop after the engine, their writes on the registry's writer thread."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from tuneloop.server.api.errors import bad_request
from tuneloop.server.api.state import ServerState
from tuneloop.server.api.taken_ids import insert_new
from tuneloop.server.engine.types import AdapterSpec
from tuneloop.server.scheduler.futures import Outcome
from tuneloop.server.storage.layout import TinkerPath, valid_name
from tuneloop.server.storage.registry import (
    PACKAGE_KINDS,
    CheckpointRow,
    TrainingRunRow,
    lora_targets,
    utcnow,
)

__all__ = ["checkpoint_target", "checkpoint_writer", "json_outcome", "register_run", "run_row"]


def json_outcome(payload: dict[str, Any]) -> Outcome:
    return Outcome.json(payload)  # never a NaN / Infinity literal


async def register_run(
    state: ServerState,
    tenant: str,
    adapter: AdapterSpec,
    session_id: str,
    user_metadata: dict[str, Any] | None,
    origin: CheckpointRow | None = None,
) -> Outcome | None:
    return await insert_new(state, run_row(tenant, adapter, session_id, user_metadata, origin))


def run_row(
    tenant: str,
    adapter: AdapterSpec,
    session_id: str,
    user_metadata: dict[str, Any] | None,
    origin: CheckpointRow | None,
) -> TrainingRunRow:
    return TrainingRunRow(
        id=adapter.adapter_id,
        tenant=tenant,
        session_id=session_id,
        base_model=adapter.base_model,
        lora_rank=adapter.rank,
        lora_seed=adapter.seed,
        train_mlp=adapter.train_mlp,
        train_attn=adapter.train_attn,
        train_unembed=adapter.train_unembed,
        train_experts=adapter.train_experts,
        user_metadata=user_metadata,
        # A run made from a package continues its step count, and the package is the
        # parent of what the run saves.
        training_step=(origin.training_step or 0) if origin is not None else 0,
        parent_path=origin.tinker_path if origin is not None else None,
    )


def checkpoint_target(
    state: ServerState, tenant: str, model_id: str, segment: str, name: str | None
) -> tuple[TinkerPath, Path]:
    if name is None or not valid_name(name):
        raise bad_request(
            "path: a name of letters, digits, '.', '_' or '-' (no '/'), at most 128", "path"
        )
    target = TinkerPath(model_id, segment, name)
    return target, state.layout.checkpoint_dir(tenant, target)


def checkpoint_writer(
    state: ServerState,
    tenant: str,
    target: TinkerPath,
    directory: Path,
    kind: str,
    ttl_seconds: int | None,
    user_metadata: dict[str, str] | None,
) -> Any:
    """The finish step of a save: register the files as the next version of package
    `target.name`, with the run's model, LoRA config, origin and step as of this save."""

    async def finish(size: int) -> Outcome:
        await state.db_write(register, size)
        return json_outcome({"path": str(target), "type": "save_weights"})

    def register(size: int) -> None:  # on the writer thread
        now = utcnow()
        run = state.registry.training_run(target.training_run_id, tenant)
        state.registry.register_package(
            CheckpointRow(
                tinker_path=str(target),
                tenant=tenant,
                training_run_id=target.training_run_id,
                checkpoint_id=target.checkpoint_id,
                checkpoint_type=kind,
                directory=str(directory),
                size_bytes=size,
                created_at=now,
                user_metadata=user_metadata,
                expires_at=now + timedelta(seconds=ttl_seconds) if ttl_seconds else None,
                name=target.name,
                kind=PACKAGE_KINDS[kind],
                base_model=run.base_model if run else None,
                lora_rank=run.lora_rank if run else None,
                lora_targets=lora_targets(run) if run else None,
                parent_path=run.parent_path if run else None,
                training_step=run.training_step if run else None,
            )
        )

    return finish
