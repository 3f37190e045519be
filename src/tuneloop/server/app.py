"""Builds the FastAPI application: state, routers, error mapping, engine loop life cycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

from fastapi import FastAPI

from tuneloop.server.api import (
    admin,
    client,
    console,
    custom_losses,
    downloads,
    futures,
    oai,
    projects,
    publish,
    rest,
    sampling,
    session_search,
    sessions,
    training,
)
from tuneloop.server.api.deps import OFF_LOOP_BYTES, off_loop
from tuneloop.server.api.errors import error_response_for, install
from tuneloop.server.api.large_body import collector_paused
from tuneloop.server.api.metering import Meter, record_completed, usage_of
from tuneloop.server.api.metrics import Metrics
from tuneloop.server.api.metrics import router as metrics_router
from tuneloop.server.api.observe import RequestObserver
from tuneloop.server.api.packages import run_package_gc
from tuneloop.server.api.quotas import Quotas
from tuneloop.server.api.state import ServerState
from tuneloop.server.config import ServerConfig
from tuneloop.server.engine.backend import Backend
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.loop import EngineLoop, engine_thread
from tuneloop.server.scheduler.queue import OperationQueue
from tuneloop.server.storage.keys import KeyStore
from tuneloop.server.storage.layout import Layout
from tuneloop.server.storage.limits import LimitStore
from tuneloop.server.storage.registry import Registry
from tuneloop.server.storage.run_metrics import RunMetricsStore

log = logging.getLogger(__name__)


def _in_workers(config: ServerConfig) -> bool:
    """Whether the torch backend is a group of worker processes (this process only routes)."""
    return config.workers > 1 or config.ray_address is not None


def build_backend(config: ServerConfig) -> Backend:
    if config.backend == "fake":
        from tuneloop.server.engine.fake import FakeBackend

        return FakeBackend()
    if config.backend == "torch":
        # Imported here: the control plane and its tests need no torch.
        import torch

        from tuneloop.server.engine.models import DEFAULT_MODEL
        from tuneloop.server.engine.torch_backend import TorchBackend

        if _in_workers(config):
            # A group of worker processes (one per device) behind the same protocol.
            from tuneloop.server.engine.workers.build import worker_group

            return worker_group(
                config.models or (DEFAULT_MODEL,),
                workers=config.workers,
                cache_dir=config.cache_dir,
                device=config.device,
                dtype=config.dtype,
                ray_address=config.ray_address,
                ray_cpus=config.ray_cpus_per_worker,
                ray_gpus=config.ray_gpus_per_worker,
                state_dir=config.data_dir / "workers",
                shard_weights=config.shard_weights,
                compile_norms=config.compile_norms,
                merged_sampling=config.merged_sampling,
                decode_graphs=config.decode_graphs,
                kv_cache_tokens=config.kv_cache_tokens,
            )
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, None: None}[config.dtype]
        return TorchBackend(
            config.models or (DEFAULT_MODEL,),
            cache_dir=config.cache_dir,
            device=config.device,
            dtype=dtype,
            compile_norms=config.compile_norms,
            merge_lone_adapter=config.merged_sampling,
            decode_graphs=config.decode_graphs,
            sample_token_budget=config.kv_cache_tokens,
        )
    raise ValueError(f"unknown backend {config.backend!r} (available: torch, fake)")


# Training routes whose oversize bodies the handler must see: a rejected training request
# still consumes its seq_id, which the handler reads from the start of the body.
DEFERRED_413_PATHS = frozenset(
    f"/api/v1/{name}"
    for name in (
        "forward_backward",
        "optim_step",
        "save_weights",
        "save_weights_for_sampler",
        "save_weights_external",
        "load_weights",
    )
)
_PREFIX_BYTES = 4096


class BodyLimit:
    """Reject bodies over the limit with 413 before any handler buffers them.

    On training routes the handler answers the 413 instead, given only the body's first bytes
    and `request.state.body_too_large`, so that it can consume the request's seq_id.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        deferred = scope["path"] in DEFERRED_413_PATHS
        # A declared oversize body is refused unread, except on training routes, where only its
        # first bytes are read (enough for model_id and seq_id).
        too_large = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        if too_large and not deferred:
            await self._reject(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_bytes or (too_large and size >= _PREFIX_BYTES):
                too_large = True
                break
        if not too_large:
            # Joining a large body copies it: on a worker thread (bytes.join drops the GIL).
            body = await off_loop(size, b"".join, chunks)
            # A large training body's decoding runs without garbage collections, which would
            # hold every other request (see large_body.py); those handlers return once queued.
            large = deferred and size >= OFF_LOOP_BYTES
            with collector_paused() if large else contextlib.nullcontext():
                await self.app(scope, _replay(body, receive), send)
        elif deferred:
            scope.setdefault("state", {})["body_too_large"] = True
            head = b""  # only the first bytes: not a copy of up to the whole limit
            for chunk in chunks:
                head += chunk[: _PREFIX_BYTES - len(head)]
                if len(head) >= _PREFIX_BYTES:
                    break
            await self.app(scope, _replay(head, receive), send)
        else:
            await self._reject(scope, receive, send)

    async def _reject(self, scope: Any, receive: Any, send: Any) -> None:
        detail = f"request body exceeds {self.max_bytes} bytes"
        response = error_response_for(scope["path"], 413, detail, "body")
        await response(scope, receive, send)


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def create_app(config: ServerConfig, backend: Backend | None = None) -> FastAPI:
    layout = Layout(config.data_dir)
    layout.prepare()
    # A model this process runs is built on the thread that will run it (see engine_thread); a
    # worker group's processes build and run theirs on one thread of their own, and the group is
    # built here, where Ray can install its signal handlers. A later start of the same app
    # (tests) gets a fresh thread.
    threads = [engine_thread()]
    if backend is None and _in_workers(config):
        backend = build_backend(config)
    elif backend is None:
        try:
            backend = threads[0].submit(build_backend, config).result()
        except BaseException:
            threads[0].shutdown()
            raise
    registry = Registry(config.db_url or layout.database_url)
    queue = OperationQueue(max_sample_batch=config.max_sample_batch)
    future_table = FutureTable(grace_s=config.result_grace_s)
    metrics = Metrics()  # per app: tests build many apps in one process
    metrics.watch_database(registry.engine)
    # Per-step training curves and recent throughput, for the console (api/console/curves.py).
    curves = console.RunCurves(RunMetricsStore(registry.engine), registry, future_table)

    def completed(meter: Meter, op: Any, result: Any) -> None:
        record_completed(meter, future_table, op, result)
        metrics.count_completed(future_table.tenant(op.request_id), usage_of(op, result))
        curves.record(op, result)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        meter = Meter()
        engine = EngineLoop(
            backend,
            queue,
            future_table,
            config.batch_gather_s,
            on_success=lambda op, result: completed(meter, op, result),
            executor=threads.pop() if threads else engine_thread(),
        )
        app.state.tuneloop = ServerState(
            config=config,
            layout=layout,
            registry=registry,
            keys=KeyStore(config.keys_file or layout.keys_file),
            futures=future_table,
            queue=queue,
            engine=engine,
            models={m.name: m for m in backend.models()},
            quotas=Quotas(config, LimitStore(config.limits_path), registry, future_table),
            meter=meter,
        )
        engine.start()
        state: ServerState = app.state.tuneloop
        metrics.attach(state)

        async def sweep() -> None:
            while True:
                await asyncio.sleep(30)
                future_table.sweep()

        async def expire() -> None:
            # From the registry's timestamps: sessions left silent before a restart expire too.
            while True:
                try:
                    await state.expire_idle_sessions()
                except Exception:  # a database hiccup must not end expiry for good
                    log.exception("expiring idle sessions failed")
                await asyncio.sleep(config.expiry_check_s)

        sweeper = asyncio.get_running_loop().create_task(sweep())
        flusher = asyncio.get_running_loop().create_task(meter.run_flusher(registry))
        package_gc = asyncio.get_running_loop().create_task(run_package_gc(registry))
        expirer = asyncio.get_running_loop().create_task(expire())
        revoker = asyncio.get_running_loop().create_task(state.revocations.run())
        try:
            yield
        finally:
            revoker.cancel()
            sweeper.cancel()
            flusher.cancel()
            package_gc.cancel()
            expirer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await expirer  # not mid-release when the engine stops
            # Nor a release a request started on finding its session expired.
            await asyncio.gather(*state.releases, return_exceptions=True)
            await engine.stop()
            await state.close_db_threads()
            await asyncio.to_thread(state.decoder.close)  # the decoding process, if started
            curves.close()
            meter.flush(registry)  # the engine is stopped: these are the last counts
            registry.close()

    app = FastAPI(title="tuneloop", lifespan=lifespan)
    app.state.run_curves = curves
    install(app)
    routers: tuple[ModuleType, ...]
    if config.openai_only:  # a deployment: the OpenAI-compatible routes (and their readiness)
        routers = (oai, console)
    else:
        routers = (client, sessions, training, sampling, futures, rest, downloads, oai, console)
        # publish before rest: rest's DELETE .../checkpoints/{id:path} also matches .../publish.
        routers = (publish, *routers, custom_losses, projects, session_search, admin)
    for module in routers:
        app.include_router(module.router)
    if config.jwt and not config.openai_only:
        app.include_router(client.token_router)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.state.metrics = metrics
    app.include_router(metrics_router)
    # Outermost: requests refused by the body limit are counted and logged too.
    access_log = config.log_format == "json"
    app.add_middleware(RequestObserver, metrics=metrics, routes=app, access_log=access_log)
    return app
