"""Builds the FastAPI application: state, routers, error mapping, engine loop life cycle."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from tuneloop.server.api import client, futures, rest, sampling, sessions, training
from tuneloop.server.api.errors import error_response, install
from tuneloop.server.api.state import ServerState
from tuneloop.server.config import ServerConfig
from tuneloop.server.engine.backend import Backend
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.loop import EngineLoop
from tuneloop.server.scheduler.queue import OperationQueue
from tuneloop.server.storage.keys import KeyStore
from tuneloop.server.storage.layout import Layout
from tuneloop.server.storage.registry import Registry


def build_backend(config: ServerConfig) -> Backend:
    if config.backend == "fake":
        from tuneloop.server.engine.fake import FakeBackend

        return FakeBackend()
    raise ValueError(f"unknown backend {config.backend!r} (available: fake)")


class BodyLimit:
    """Reject bodies over the limit with 413 before any handler buffers them."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
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
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Any, receive: Any, send: Any) -> None:
        response = error_response(413, f"request body exceeds {self.max_bytes} bytes", "body")
        await response(scope, receive, send)


def create_app(config: ServerConfig, backend: Backend | None = None) -> FastAPI:
    layout = Layout(config.data_dir)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    backend = backend if backend is not None else build_backend(config)
    registry = Registry(config.db_url or layout.database_url)
    queue = OperationQueue(max_sample_batch=config.max_sample_batch)
    future_table = FutureTable(grace_s=config.result_grace_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = EngineLoop(backend, queue, future_table)
        app.state.tuneloop = ServerState(
            config=config,
            layout=layout,
            registry=registry,
            keys=KeyStore(config.keys_file or layout.keys_file),
            futures=future_table,
            queue=queue,
            engine=engine,
            models={m.name: m for m in backend.models()},
        )
        engine.start()

        async def sweep() -> None:
            while True:
                await asyncio.sleep(30)
                future_table.sweep()

        sweeper = asyncio.get_running_loop().create_task(sweep())
        try:
            yield
        finally:
            sweeper.cancel()
            await engine.stop()
            registry.close()

    app = FastAPI(title="tuneloop", lifespan=lifespan)
    install(app)
    for module in (client, sessions, training, sampling, futures, rest):
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    return app
