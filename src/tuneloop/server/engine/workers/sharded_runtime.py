"""One rank of a sharded worker group: a `TorchBackend` whose base weights are FSDP2 shards.

Every rank runs every call on the same data (see sharded_group.py): each forward all-gathers the
layer it runs from every rank, so the ranks must run the same forwards in the same order, and
running the same batch is what keeps them in lockstep through training micro-batches,
continuous-batching decode steps and the halving of a failing batch alike (a sampling session
takes in joining requests only as the group decides for every rank: sharded_session.py). The
work is not divided (the point of the mode is memory: each rank holds 1/N of the base weights);
the results are bit-identical to one process's, because the all-gathered weights are the same
bits and the computation is the same.

Loading: each rank loads the full checkpoint into host memory and then keeps its shard. Ranks
load one after another (a barrier between), so a host holding several ranks needs the host
memory of one full model at a time, not one per rank. On a GPU, fully_shard moves each group's
weights to the rank's device as it shards them, so the device never holds the whole model.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tuneloop.server.engine.memory import (
    kv_bytes_per_token,
    kv_cache_tokens,
    training_token_budget,
)
from tuneloop.server.engine.parallel.fsdp import ShardedWeights, shard_model
from tuneloop.server.engine.types import AdamStep, EngineError
from tuneloop.server.engine.workers.protocol import Admit
from tuneloop.server.engine.workers.sharded_session import LockstepRankSession
from tuneloop.server.engine.workers.worker import (
    WorkerRuntime,
    WorkerSettings,
    join_group,
    settings_dtype,
    take_device,
)

__all__ = ["ShardedWorkerRuntime", "live_tensor_bytes", "rank_memory"]


def _bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.untyped_storage().nbytes())


def rank_memory(model: nn.Module) -> dict[str, int]:
    """Bytes this rank holds for one model, measured from its tensors' storages: base weights
    (a shard each, or whole when replicated), adapter factors with their gradients, and
    AdamW's two moments per trainable factor."""
    weights = adapters = optimizer = 0
    for name, param in model.named_parameters():
        if ".lora_" in name:
            adapters += _bytes(param) + _bytes(param.grad)
            if param.requires_grad:
                optimizer += 2 * param.numel() * param.element_size()
        else:
            weights += _bytes(param)
    return {"weights": weights, "adapters": adapters, "optimizer": optimizer}


def live_tensor_bytes() -> int:
    """Bytes of every storage a live tensor of this process holds (each storage once): the
    check that no reference keeps a whole weight alive beside its shard."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _release_freed_heap() -> None:
    """Return the whole weights' freed host memory to the OS: glibc keeps large freed heaps
    mapped, so the process's resident set would still show every rank the full model."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class ShardedWorkerRuntime(WorkerRuntime):
    """`WorkerRuntime` over sharded weights; the group sends it every call with the same data."""

    def __init__(self, settings: WorkerSettings, rank: int, size: int, init_method: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from tuneloop.server.engine.models import default_dtype
        from tuneloop.server.engine.torch_backend import TorchBackend

        self.rank, self.size = rank, size
        self.device = take_device(settings, rank)
        join_group(self.device, init_method, rank, size)
        mesh = init_device_mesh(self.device.type, (size,))
        dtype = settings_dtype(settings)
        if dtype is None and self.device.type == "cuda":  # the target device's, not the host's
            dtype = default_dtype(settings.models[0], self.device)
        self.sharded: dict[str, ShardedWeights] = {}
        for turn in range(size):  # one full model in host memory at a time (module docstring)
            if turn == rank:
                # No merged or fused weights: such a copy would be whole on every rank.
                self.backend = TorchBackend(
                    settings.models,
                    cache_dir=settings.cache_dir,
                    device="cpu",
                    dtype=dtype,
                    merge_lone_adapter=False,
                    fuse_lone_key=False,
                    compile_norms=False,  # FSDP2 hands the norms DTensor weights
                    decode_graphs=False,  # the forward gathers the shards (collectives)
                    sample_token_budget=settings.kv_cache_tokens,
                )
                for name, model in self.backend.resident_models().items():
                    self.sharded[name] = shard_model(model, mesh)
                gc.collect()
                _release_freed_heap()
            dist.barrier()
        if self.device.type != "cpu":
            self.backend.device = self.device
            self.backend.token_budget = min(
                training_token_budget(m.config, next(m.parameters()).dtype, self.device)
                for m in self.backend.resident_models().values()
            )
        self._before: dict[str, list[torch.Tensor | None]] = {}

    def do_hello(self) -> dict[str, Any]:
        hello = super().do_hello()
        hello["memory"] = self.do_memory()
        return hello

    def do_memory(self) -> dict[str, Any]:
        """Per model, what this rank holds (bytes): weights, adapters, optimizer, KV cache."""
        pools = self.backend.kv_usage()
        out: dict[str, Any] = {"pid": os.getpid(), "rank": self.rank, "models": {}}
        for name, model in self.backend.resident_models().items():
            memory = rank_memory(model)
            param = next(model.parameters())
            # The pool is made at a model's first sampling request; until then, what it will take
            pool = pools.get(name)
            tokens = (
                pool.blocks_total * pool.block_size
                if pool
                else kv_cache_tokens(
                    model.config, param.dtype, param.device, self.backend.sample_token_budget
                )
            )
            memory["kv_cache"] = tokens * kv_bytes_per_token(model.config, param.dtype)
            memory["weights_total"] = self.sharded[name].total_bytes
            memory["weights_replicated"] = self.sharded[name].replicated_bytes
            out["models"][name] = memory
        return out

    def do_live_tensor_bytes(self) -> int:
        return live_tensor_bytes()

    def do_optim_step(
        self, adapter_id: str, step: AdamStep, return_state: bool
    ) -> tuple[dict[str, float], Any]:
        """Every rank ran the same batches, so its gradients are already the group's: the same
        AdamW step everywhere, no all-reduce."""
        self._before.pop(adapter_id, None)
        metrics = self.backend.optim_step(adapter_id, step)
        return metrics, (self.do_adapter_state(adapter_id) if return_state else None)

    def do_sample_continuous(self, first: Admit) -> None:
        """A sampling session in lockstep with the other ranks (sharded_session.py): the same
        admissions and cancellations at the same decode steps, decided by the group."""
        if self.conn is None:
            raise EngineError("continuous sampling needs a worker process's pipe")
        LockstepRankSession(self.backend, self.conn, leader=self.rank == 0).serve(first)
