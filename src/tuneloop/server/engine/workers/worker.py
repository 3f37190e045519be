"""One worker of a group: a `TorchBackend` on one device, a rank of a torch.distributed group.

`WorkerRuntime.handle` runs one `Call` and returns its reply; `process_main` is the loop of a
local worker process (calls from a pipe), `ray_placement.WorkerActor` the same behind Ray.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tuneloop.server.engine.isolation import bisect_failures
from tuneloop.server.engine.operations import (
    DeleteAdapter,
    LoadState,
    SingleOperation,
    run_operation,
)
from tuneloop.server.engine.types import (
    AdamStep,
    AdapterSpec,
    EngineError,
    ForwardBackwardResult,
    ForwardBackwardWork,
    SampleResult,
    SampleWork,
)
from tuneloop.server.engine.workers.protocol import (
    Admit,
    Call,
    Failure,
    ItemError,
    receive,
    send,
)
from tuneloop.server.engine.workers.rank_session import RankSession

log = logging.getLogger(__name__)
# A collective waits this long for a peer before failing: a dead peer is normally seen at once
# (its sockets close), this only bounds a peer that hangs.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class WorkerSettings:
    """What every worker of a group builds its backend from."""

    models: tuple[str, ...]
    cache_dir: Path
    device: str | None = None  # None: cuda if the worker sees one, else cpu
    dtype: str | None = None  # "bfloat16" / "float32" / None (per model, measured)
    threads: int = 1  # torch intra-op threads (CPU workers share the machine's cores)
    gpus_per_host: int = 0  # local groups: rank r uses cuda:(r % gpus_per_host)
    compile_norms: bool | None = None  # TorchBackend's; None: where it pays (compiled.py)
    merged_sampling: bool | None = None  # TorchBackend's merge_lone_adapter
    decode_graphs: bool | None = None  # TorchBackend's; None: on a GPU
    kv_cache_tokens: int | None = None  # TorchBackend's sample_token_budget


def worker_device(settings: WorkerSettings, rank: int) -> str:
    if settings.device not in (None, "cuda"):
        return str(settings.device)
    if not torch.cuda.is_available():
        return "cpu"
    # Ray hides all but the actor's own GPUs (gpus_per_host 0 there): its first is its own.
    return f"cuda:{rank % settings.gpus_per_host}" if settings.gpus_per_host else "cuda:0"


def take_device(settings: WorkerSettings, rank: int) -> torch.device:
    """This rank's device, made current (a CPU rank gets its share of the threads)."""
    device = torch.device(worker_device(settings, rank))
    if device.type == "cpu":
        torch.set_num_threads(max(1, settings.threads))
    else:
        torch.cuda.set_device(device)
    return device


def settings_dtype(settings: WorkerSettings) -> torch.dtype | None:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, None: None}[settings.dtype]


def join_group(device: torch.device, init_method: str, rank: int, size: int) -> None:
    """Join the group's torch.distributed process group (NCCL on GPUs, gloo on CPUs)."""
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def _cpu(value: Any) -> Any:
    """Tensors (nested in dicts/lists) moved to host memory, for the pipe and the snapshot."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cpu(v) for v in value)
    return value


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings, rank: int, size: int, init_method: str) -> None:
        from tuneloop.server.engine.torch_backend import TorchBackend

        self.rank, self.size = rank, size
        self.device = take_device(settings, rank)
        self.backend = TorchBackend(
            settings.models,
            cache_dir=settings.cache_dir,
            device=str(self.device),
            dtype=settings_dtype(settings),
            compile_norms=settings.compile_norms,
            merge_lone_adapter=settings.merged_sampling,
            decode_graphs=settings.decode_graphs,
            sample_token_budget=settings.kv_cache_tokens,
        )
        join_group(self.device, init_method, rank, size)
        # Gradients of each adapter as they were before the last forward_backward call, to
        # take a request's share back when it failed on another rank (see group.py).
        self._before: dict[str, list[torch.Tensor | None]] = {}

    def handle(self, call: Call) -> Any:
        try:
            return getattr(self, "do_" + call.method)(*call.args)
        except EngineError as exc:
            return Failure(ItemError.of(exc))
        except Exception as exc:
            return Failure(
                ItemError(f"{type(exc).__name__}: {exc}", "server"), traceback.format_exc()
            )

    def close(self) -> None:
        self.backend.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- calls (the group names them without the do_ prefix) --------------------------------

    def do_hello(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "device": str(self.device), "models": self.backend.models()}

    def do_operation(self, op: SingleOperation) -> Any:
        """An operation the same on every rank (optim_step, which all-reduces, has its own)."""
        if isinstance(op, DeleteAdapter | LoadState):  # its gradients are gone
            self._before.pop(op.adapter_id, None)
        return run_operation(self.backend, op)

    def do_restore_adapter(
        self, spec: AdapterSpec, factors: dict[str, torch.Tensor], optimizer: dict[str, Any]
    ) -> None:
        self.backend.delete_adapter(spec.adapter_id)
        self.backend.create_adapter(spec)
        self.backend.restore_adapter(spec.adapter_id, factors, optimizer)

    def do_adapter_state(self, adapter_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
        return _cpu(self.backend.adapter_state(adapter_id))

    def do_forward_backward(
        self, works: Sequence[ForwardBackwardWork]
    ) -> list[ForwardBackwardResult | ItemError]:
        self._before = {}
        for adapter_id in {w.adapter_id for w in works if not w.forward_only}:
            try:
                params = self.backend.adapter_parameters(adapter_id)
            except EngineError:
                continue  # the request fails on its own below
            self._before[adapter_id] = [None if p.grad is None else p.grad.clone() for p in params]
        results = self.backend.forward_backward(works) if works else []
        return [ItemError.of(r) if isinstance(r, EngineError) else r for r in results]

    def do_revert_gradients(self) -> None:
        """Gradients back to before the last forward_backward call (the group runs that batch
        again without the requests that failed on some rank)."""
        for adapter_id, grads in self._before.items():
            for param, grad in zip(self.backend.adapter_parameters(adapter_id), grads, strict=True):
                param.grad = grad
        self._before = {}

    def do_optim_step(
        self, adapter_id: str, step: AdamStep, return_state: bool
    ) -> tuple[dict[str, float], Any]:
        """All-reduce (sum) the adapter's accumulated gradients, then the same AdamW step on
        every rank: the adapters stay identical without sending weights."""
        params = self.backend.adapter_parameters(adapter_id)
        self._before.pop(adapter_id, None)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for param, grad in zip(params, grads, strict=True):
            param.grad = flat[offset : offset + grad.numel()].view_as(grad).clone()
            offset += grad.numel()
        metrics = self.backend.optim_step(adapter_id, step)
        return metrics, (self.do_adapter_state(adapter_id) if return_state else None)

    def do_restore_sampler(
        self,
        sampler_id: str,
        base_model: str,
        spec: AdapterSpec | None,
        factors: dict[str, torch.Tensor] | None,
    ) -> None:
        if spec is None or factors is None:
            self.backend.create_sampler(sampler_id, base_model)
        else:
            self.backend.add_frozen_sampler(sampler_id, spec, factors)

    def do_sampler_state(self, sampler_id: str) -> Any:
        """The spec and factors of a sampler with an adapter (None: the base model alone)."""
        return _cpu(self.backend.sampler_state(sampler_id))

    def do_sample(self, works: Sequence[SampleWork]) -> list[SampleResult | ItemError]:
        # A decode batch that raises is run again in halves: only a request failing alone fails.
        results = bisect_failures(self.backend.sample, list(works), "sample") if works else []
        return [ItemError.of(r) if isinstance(r, EngineError) else r for r in results]

    # A local worker's pipe (process_main sets it): a continuous sampling session speaks on it
    # between the call and its reply. Ray actors have none (their group samples whole batches).
    conn: Connection | None = None

    def do_sample_continuous(self, first: Admit) -> None:
        """Continuous batching on this rank until the group sends `Stop` (rank_session.py)."""
        if self.conn is None:
            raise EngineError("continuous sampling needs a worker process's pipe")
        RankSession(self.backend, self.conn).serve(first)


def process_main(
    conn: Connection,
    settings: WorkerSettings,
    rank: int,
    size: int,
    init_method: str,
    runtime_class: type[WorkerRuntime] = WorkerRuntime,
) -> None:
    """A local worker process: build, say hello, then answer calls until the pipe closes."""
    try:
        runtime = runtime_class(settings, rank, size, init_method)
    except BaseException as exc:
        failure = ItemError(f"worker {rank} failed to start: {exc}", "server")
        send(conn, Failure(failure, traceback.format_exc()))
        raise
    runtime.conn = conn
    send(conn, runtime.handle(Call("hello")))
    try:
        while True:
            try:
                call = receive(conn)
            except EOFError:  # the server process died: nothing left to answer or to flush
                os._exit(0)
            if call is None:
                break
            send(conn, runtime.handle(call))
    finally:
        runtime.close()
