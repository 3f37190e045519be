"""Workers as Ray actors: one actor per worker with its own CPUs/GPUs, placed by Ray's
scheduler across the cluster; torch.distributed meets at the rank-0 actor's address.

Ray is imported only here and only when a group is placed on Ray: without it installed, the
single-process backend and local groups work as before.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

from tuneloop.server.engine.workers.placement import START_TIMEOUT_S, accept_hellos, free_port
from tuneloop.server.engine.workers.protocol import Call, WorkerDiedError
from tuneloop.server.engine.workers.worker import WorkerRuntime, WorkerSettings


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "--ray-address needs Ray: pip install 'tuneloop[ray]' (or leave it out to run the "
            "worker group on this machine)"
        ) from None
    return ray


class WorkerActor:
    """The actor class (made remote in `RayPlacement.start`, with the resources asked for)."""

    def __init__(self) -> None:
        self.runtime: WorkerRuntime | None = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it: the group's rendezvous, on rank 0."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def start(
        self,
        settings: WorkerSettings,
        rank: int,
        size: int,
        init_method: str,
        runtime_class: type[WorkerRuntime] = WorkerRuntime,
    ) -> bytes:
        self.runtime = runtime_class(settings, rank, size, init_method)
        return pickle.dumps(self.runtime.handle(Call("hello")))

    def handle(self, call: bytes) -> bytes:
        """Calls and replies travel pickled, as through a local worker's pipe: Ray's own
        serialization hands out read-only zero-copy arrays, which torch must not write to."""
        assert self.runtime is not None
        return pickle.dumps(self.runtime.handle(pickle.loads(call)))

    def pid(self) -> int:
        return os.getpid()


class RayPlacement:
    def __init__(
        self,
        settings: WorkerSettings,
        size: int,
        address: str,
        *,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        runtime_class: type[WorkerRuntime] = WorkerRuntime,
    ) -> None:
        self.runtime_class = runtime_class  # ShardedWorkerRuntime for a sharded group
        self.settings = settings
        self.size = size
        self.address = address
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self._actors: list[Any] = []
        self._pids: list[int] = []

    def start(self) -> list[Any]:
        ray = import_ray()
        if not ray.is_initialized():
            # "local": a private single-node Ray for this server (tests, trying it out)
            ray.init(address=None if self.address == "local" else self.address)
        actor = ray.remote(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0)(
            WorkerActor
        )
        self._actors = [actor.remote() for _ in range(self.size)]
        host, port = self._get({0: self._actors[0].address.remote()}, START_TIMEOUT_S, raw=True)[0]
        init_method = f"tcp://{host}:{port}"
        hellos = self._get(
            {
                rank: a.start.remote(
                    self.settings, rank, self.size, init_method, self.runtime_class
                )
                for rank, a in enumerate(self._actors)
            },
            START_TIMEOUT_S,
        )
        self._pids, ordered = accept_hellos(hellos, self.size)
        return ordered

    def call(self, calls: Mapping[int, Call]) -> dict[int, Any]:
        return self._get(
            {
                rank: self._actors[rank].handle.remote(pickle.dumps(call))
                for rank, call in calls.items()
            },
            None,
        )

    def _get(
        self, refs: Mapping[int, Any], timeout: float | None, raw: bool = False
    ) -> dict[int, Any]:
        """Every reply, raising WorkerDiedError as soon as one actor is gone (not only after the
        replies before it, which may wait on it in a collective)."""
        ray = import_ray()
        rank_of = {ref: rank for rank, ref in refs.items()}
        remaining = list(refs.values())
        replies: dict[int, Any] = {}
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=timeout)
            if not ready:
                raise WorkerDiedError(rank_of[remaining[0]], f"no answer within {timeout} s")
            rank = rank_of[ready[0]]
            try:
                reply = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                raise WorkerDiedError(rank, type(exc).__name__) from None
            replies[rank] = reply if raw else pickle.loads(reply)
        return replies

    def dead(self) -> list[int]:
        return []  # seen when a call waits on the actor (Ray reports its death to the caller)

    def pids(self) -> list[int]:
        return list(self._pids)

    def stop(self, graceful: bool = True) -> None:
        if not self._actors:
            return
        ray = import_ray()
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
