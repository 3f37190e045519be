"""Where the workers run: `LocalPlacement` starts them as processes of this machine.

A placement starts N workers joined in one torch.distributed group, sends calls to some of them
and waits for the replies, raising `WorkerDiedError` as soon as a worker it waits on has ended (the
process sentinel becomes ready at once, a SIGKILL included). `ray_placement.RayPlacement` is the
same for Ray actors.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
from collections.abc import Mapping
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from tuneloop.server.engine.workers.protocol import Call, Failure, WorkerDiedError, receive, send
from tuneloop.server.engine.workers.worker import WorkerRuntime, WorkerSettings, process_main

# What a worker imports before it can load a model (seconds of a restart on a busy CPU), done
# once in the fork server so that each worker process starts with them loaded.
PRELOAD = [
    "tuneloop.server.engine.workers.worker",
    "tuneloop.server.engine.workers.sharded_runtime",
    "tuneloop.server.engine.torch_backend",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
]
# Loading a model and joining the process group: the tiny models take seconds, SmolLM2 on a
# busy CPU tens of seconds (the converted model is cached).
START_TIMEOUT_S = 600.0


class Placement(Protocol):
    size: int

    def start(self) -> list[Any]:
        """Start every worker; returns each one's hello (pid, device, models)."""
        ...

    def call(self, calls: Mapping[int, Call]) -> dict[int, Any]:
        """Send each rank its call and wait for every reply (raises WorkerDiedError)."""
        ...

    def dead(self) -> list[int]:
        """Ranks whose worker has ended."""
        ...

    def pids(self) -> list[int]: ...

    def stop(self, graceful: bool = True) -> None:
        """End every worker (graceful: let each finish its call and exit; else kill now)."""
        ...


def worker_context() -> Any:  # a ForkServerContext or SpawnContext (POSIX-only names)
    """How worker processes start: never a plain fork of the server process, which holds
    threads (event loop, engine), sockets and maybe CUDA. A fork server is a fresh process like
    a spawned one, started once, single-threaded, with PRELOAD imported; each worker forks from
    it and loads only its model, so a restart after a worker died takes a fraction of a second
    on the tiny model instead of ~9 s of imports (measured, 2 busy cores). Where the platform
    has no fork server, plain spawn."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)  # read when the fork server starts
        return context
    return multiprocessing.get_context("spawn")


def accept_hellos(hellos: Mapping[int, Any], size: int) -> tuple[list[int], list[Any]]:
    """The workers' start-up answers in rank order and their pids; a worker that could not
    start fails the group's start."""
    failed = [h for h in hellos.values() if isinstance(h, Failure)]
    if failed:
        raise WorkerDiedError(0, failed[0].error.message)
    ordered = [hellos[rank] for rank in range(size)]
    return [int(hello["pid"]) for hello in ordered], ordered


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LocalPlacement:
    """N processes on this machine (`worker_context`), rendezvous on 127.0.0.1 at a free
    port."""

    def __init__(
        self,
        settings: WorkerSettings,
        size: int,
        runtime_class: type[WorkerRuntime] = WorkerRuntime,
    ) -> None:
        self.settings = settings
        self.size = size
        self.runtime_class = runtime_class  # ShardedWorkerRuntime for a sharded group
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._pids: list[int] = []

    def start(self) -> list[Any]:
        context = worker_context()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        for rank in range(self.size):
            parent, child = context.Pipe()
            proc = context.Process(
                target=process_main,
                args=(child, self.settings, rank, self.size, init_method, self.runtime_class),
                name=f"tuneloop-worker-{rank}",
                daemon=True,  # never outlives the server process
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        hellos = self._wait(dict.fromkeys(range(self.size)), START_TIMEOUT_S)
        self._pids, ordered = accept_hellos(hellos, self.size)
        return ordered

    def call(self, calls: Mapping[int, Call]) -> dict[int, Any]:
        for rank, call in calls.items():
            try:
                send(self._conns[rank], call)
            except (OSError, ValueError) as exc:  # a closed pipe: the worker is gone
                raise WorkerDiedError(rank, str(exc)) from None
        return self._wait(calls, None)

    def _wait(self, ranks: Mapping[int, Any], timeout: float | None) -> dict[int, Any]:
        pending: dict[Any, int] = {self._conns[rank]: rank for rank in ranks}
        sentinels: dict[Any, int] = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        replies: dict[int, Any] = {}
        while pending:
            ready = wait([*pending, *sentinels], timeout)
            if not ready:
                raise WorkerDiedError(min(pending.values()), f"no answer within {timeout} s")
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        replies[rank] = receive(self._conns[rank])
                    except (EOFError, OSError):
                        raise WorkerDiedError(rank, "its pipe closed") from None
            for obj in ready:
                rank = sentinels.pop(obj, -1)
                if rank in pending.values():
                    self._procs[rank].join(timeout=1.0)  # for its exit code
                    raise WorkerDiedError(rank, f"exit code {self._procs[rank].exitcode}")
                # A worker this call does not wait on ended: the group's watchdog restarts it.
        return replies

    def dead(self) -> list[int]:
        return [rank for rank, proc in enumerate(self._procs) if not proc.is_alive()]

    def links(self) -> list[tuple[Connection, Any]]:
        """Each rank's pipe and process sentinel, for the asynchronous messages of a sampling
        session (workers/continuous.py); valid until stop()."""
        return [(conn, proc.sentinel) for conn, proc in zip(self._conns, self._procs, strict=True)]

    def pids(self) -> list[int]:
        return list(self._pids)

    def stop(self, graceful: bool = True) -> None:
        """Ask politely, then SIGKILL whoever is left (a survivor of a dead peer may be stuck
        in a collective). Not graceful: SIGKILL at once (a restart discards their state)."""
        if graceful:
            for conn in self._conns:
                with contextlib.suppress(OSError, ValueError):
                    send(conn, None)
            for proc in self._procs:
                proc.join(timeout=5.0)
        for proc in self._procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
