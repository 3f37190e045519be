"""Building a worker group from the server's settings (the app calls `worker_group`)."""

from __future__ import annotations

import os
from pathlib import Path

from tuneloop.server.engine.workers.group import WorkerGroupBackend
from tuneloop.server.engine.workers.placement import LocalPlacement, Placement
from tuneloop.server.engine.workers.worker import WorkerRuntime, WorkerSettings

# --shard-weights: "none" (every worker a full replica) or "fsdp" (weights sharded, FSDP2).
SHARD_MODES = ("none", "fsdp")


def worker_group(
    models: tuple[str, ...],
    *,
    workers: int,
    cache_dir: Path,
    device: str | None = None,
    dtype: str | None = None,
    ray_address: str | None = None,
    ray_cpus: float = 1.0,
    ray_gpus: float = 0.0,
    state_dir: Path | None = None,
    shard_weights: str = "none",
) -> WorkerGroupBackend:
    """A local group of `workers` processes (one per GPU, else sharing the CPU cores), or
    with `ray_address` one Ray actor per worker. `shard_weights="fsdp"`: the base weights are
    sharded across the workers (sharded_group.py), after checking that they fit."""
    if shard_weights not in SHARD_MODES:
        raise ValueError(f"--shard-weights must be one of {', '.join(SHARD_MODES)}")
    group_class: type[WorkerGroupBackend] = WorkerGroupBackend
    runtime_class: type[WorkerRuntime] = WorkerRuntime
    if shard_weights == "fsdp":
        from tuneloop.server.engine.workers.sharded_group import ShardedGroupBackend
        from tuneloop.server.engine.workers.sharded_runtime import ShardedWorkerRuntime

        group_class, runtime_class = ShardedGroupBackend, ShardedWorkerRuntime
    if ray_address is not None:
        from tuneloop.server.engine.workers.ray_placement import RayPlacement, import_ray

        import_ray()  # a clear error now, not in the first restart
        ray_settings = WorkerSettings(
            models, cache_dir, device, dtype, threads=max(1, int(ray_cpus))
        )

        def make() -> Placement:
            return RayPlacement(
                ray_settings,
                workers,
                ray_address,
                num_cpus=ray_cpus,
                num_gpus=ray_gpus,
                runtime_class=runtime_class,
            )

        return group_class(make, state_dir=state_dir)
    import torch

    gpus = torch.cuda.device_count() if device in (None, "cuda") else 0
    if gpus and workers > gpus:  # NCCL refuses two ranks on one device
        raise ValueError(f"--workers {workers} needs {workers} GPUs; this machine has {gpus}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    settings = WorkerSettings(
        models,
        cache_dir,
        device,
        dtype,
        threads=max(1, (cores or 1) // workers),
        gpus_per_host=gpus,
    )
    return group_class(
        lambda: LocalPlacement(settings, workers, runtime_class), state_dir=state_dir
    )
