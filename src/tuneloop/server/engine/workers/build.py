"""Building a worker group from the server's settings (the app calls `worker_group`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from tuneloop.server.engine.workers.group import WorkerGroupBackend
from tuneloop.server.engine.workers.placement import LocalPlacement, Placement
from tuneloop.server.engine.workers.worker import WorkerRuntime, WorkerSettings

log = logging.getLogger(__name__)
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
    rank_memory: int | None = None,
    compile_norms: bool | None = None,
    merged_sampling: bool | None = None,
    decode_graphs: bool | None = None,
    kv_cache_tokens: int | None = None,
) -> WorkerGroupBackend:
    """A local group of `workers` processes (one per GPU, else sharing the CPU cores), or
    with `ray_address` one Ray actor per worker. `shard_weights="fsdp"`: the base weights are
    sharded across the workers (sharded_group.py), after checking that they fit in each
    rank's memory (`rank_memory` bytes; None: the device's, or this host's shared by its
    ranks)."""
    if shard_weights not in SHARD_MODES:
        raise ValueError(f"--shard-weights must be one of {', '.join(SHARD_MODES)}")
    group_class: type[WorkerGroupBackend] = WorkerGroupBackend
    runtime_class: type[WorkerRuntime] = WorkerRuntime
    if shard_weights == "fsdp":
        from tuneloop.server.engine.workers.sharded_group import ShardedGroupBackend
        from tuneloop.server.engine.workers.sharded_runtime import ShardedWorkerRuntime

        group_class, runtime_class = ShardedGroupBackend, ShardedWorkerRuntime
        dtype = _sharded_dtype(models, device, dtype)
        _check_sharded_fit(models, workers, cache_dir, device, dtype, ray_address, rank_memory)
    if ray_address is not None:
        from tuneloop.server.engine.workers.ray_placement import RayPlacement, import_ray

        import_ray()  # a clear error now, not in the first restart
        ray_settings = WorkerSettings(
            models,
            cache_dir,
            device,
            dtype,
            threads=max(1, int(ray_cpus)),
            compile_norms=compile_norms,
            merged_sampling=merged_sampling,
            decode_graphs=decode_graphs,
            kv_cache_tokens=kv_cache_tokens,
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
        compile_norms=compile_norms,
        merged_sampling=merged_sampling,
        decode_graphs=decode_graphs,
        kv_cache_tokens=kv_cache_tokens,
    )
    return group_class(
        lambda: LocalPlacement(settings, workers, runtime_class), state_dir=state_dir
    )


def _target(device: str | None) -> Any:
    import torch

    cuda = device in (None, "cuda") and torch.cuda.is_available()
    return torch.device("cuda:0" if cuda else (device or "cpu"))


def _sharded_dtype(models: tuple[str, ...], device: str | None, dtype: str | None) -> str:
    """The one dtype every rank loads: a shard's all-gather needs the same dtype everywhere,
    and the per-device default is a timed probe (dtypes.py) that two busy processes could
    answer differently. Decided here once, the first model's default unless one was asked."""
    if dtype is not None:
        return dtype
    import torch

    from tuneloop.server.engine.models import default_dtype

    return "bfloat16" if default_dtype(models[0], _target(device)) == torch.bfloat16 else "float32"


def _check_sharded_fit(
    models: tuple[str, ...],
    workers: int,
    cache_dir: Path,
    device: str | None,
    dtype: str,
    ray_address: str | None,
    rank_memory: int | None,
) -> None:
    """Refuse (ValueError, with the numbers) a sharded group whose ranks cannot hold the models;
    log the per-rank plan of one that can."""
    import torch

    from tuneloop.server.engine.memory import CPU_MIN_KV_TOKENS
    from tuneloop.server.engine.models import MAX_SPEC_CONTEXT
    from tuneloop.server.engine.parallel.plan import (
        check_fits,
        meta_model,
        plan_model,
        rank_capacity,
    )

    target = _target(device)
    cuda = target.type == "cuda"
    # A KV pool takes a share of what is free: reserve one full-context sequence on a GPU,
    # the smallest pool a CPU gets.
    kv_tokens = MAX_SPEC_CONTEXT if cuda else CPU_MIN_KV_TOKENS
    named = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    plans = [
        plan_model(
            name,
            meta_model(name, cache_dir),
            workers,
            named[dtype],
            kv_tokens,
        )
        for name in models
    ]
    if rank_memory is None and ray_address is None:  # Ray ranks are elsewhere: not checked
        rank_memory = rank_capacity(target, 1 if cuda else workers)
    log.warning("sharded worker group plan:\n%s", check_fits(plans, rank_memory))
