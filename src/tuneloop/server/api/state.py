"""Everything a request handler needs, built once by the app and reached through `get_state`.

`ServerState` holds the collaborators (registry, queue, engine loop, futures, quotas, meter,
...) and the database threads; the service steps are modules of their own, which its methods
name: `session_liveness` (is a session alive, recording activity), `session_release`
(freeing a finished or expired session), `checkpoint_lookup`, and `submission` (queueing a
model's ordered operations).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from tuneloop.server.api import checkpoint_lookup, session_liveness, session_release
from tuneloop.server.api import submission as submission_module
from tuneloop.server.api.auth_tokens import TokenIssuer
from tuneloop.server.api.custom_loss_store import CustomLossStore
from tuneloop.server.api.decode_pool import DecodePool
from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.futures_feed import CompletionFeeds
from tuneloop.server.api.metering import Meter
from tuneloop.server.api.quotas import Quotas
from tuneloop.server.api.revocation import Revocations
from tuneloop.server.api.session_release import EXPIRED
from tuneloop.server.api.stability import StabilityRecords
from tuneloop.server.api.submission import TrainingSubmission
from tuneloop.server.api.traces import TraceRecorder
from tuneloop.server.config import ServerConfig
from tuneloop.server.engine.types import ModelSpec
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.loop import EngineLoop
from tuneloop.server.scheduler.queue import OperationQueue
from tuneloop.server.storage.audit import AuditLog
from tuneloop.server.storage.clones import CloneCounters
from tuneloop.server.storage.keys import KeyStore
from tuneloop.server.storage.layout import Layout, TinkerPath
from tuneloop.server.storage.projects import Projects
from tuneloop.server.storage.publications import Publications
from tuneloop.server.storage.registry import (
    CheckpointRow,
    Registry,
    SamplerRow,
    SessionRow,
    TrainingRunRow,
)

log = logging.getLogger(__name__)
__all__ = ["EXPIRED", "ServerState", "fingerprint", "get_state"]
# Registry statements of request handlers run on these threads, never on the event loop: a
# PostgreSQL round trip (or a SQLite fsync) there would hold every other tenant's request.
# Fewer than the registry's pool (storage/registry.py POOL_SIZE), so none waits for a connection.
DB_THREADS = 8
T = TypeVar("T")


def fingerprint(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@dataclass
class ServerState:
    config: ServerConfig
    layout: Layout
    registry: Registry
    keys: KeyStore
    futures: FutureTable
    queue: OperationQueue
    engine: EngineLoop
    models: dict[str, ModelSpec]
    quotas: Quotas
    meter: Meter = field(default_factory=Meter)
    # (sampling_session_id, seq_id) -> (fingerprint, request_id, sample_sequence_ids)
    sample_submissions: dict[tuple[str, int], tuple[str, str, list[str]]] = field(
        default_factory=dict
    )
    # stable_reinforce: what sampling recorded per sequence_id (record_stability_info).
    stability: StabilityRecords = field(default_factory=StabilityRecords)
    custom_losses: CustomLossStore = field(default_factory=CustomLossStore)
    # Large forward_backward bodies are decoded in its process (api/decode_pool.py).
    decoder: DecodePool = field(default_factory=DecodePool)
    # Releases of sessions found expired by a request (held so they are not garbage collected).
    releases: set[asyncio.Task[None]] = field(default_factory=set)
    # Sampler ids being created (by create_sampling_session or a queued snapshot): a second
    # create of one is refused (409) instead of replacing the first's sampler.
    pending_samplers: set[str] = field(default_factory=set)
    revocations: Revocations = field(init=False)
    # Built from the above (api/futures_feed.py, api/traces.py and their storage modules).
    feeds: CompletionFeeds = field(init=False)
    traces: TraceRecorder = field(init=False)
    clones: CloneCounters = field(init=False)
    projects: Projects = field(init=False)
    publications: Publications = field(init=False)
    audit: AuditLog = field(init=False)
    token_issuer: TokenIssuer | None = field(init=False)  # with `serve --jwt`
    # See DB_THREADS. The writer is one thread, so what finish steps store lands in the order
    # the engine completed the work (a save after an optim_step sees the step counted).
    db_threads: ThreadPoolExecutor = field(init=False)
    db_writer: ThreadPoolExecutor = field(init=False)
    # Background registry writes (activity timestamps), held until done.
    db_pending: set[asyncio.Future[Any]] = field(default_factory=set)
    # When `audit_once` last handed each key's record to a database thread (monotonic).
    audit_handed: dict[tuple[str, ...], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.revocations = Revocations(self.keys, self.futures, self.queue, self.engine)
        self.feeds = CompletionFeeds(self.futures)
        self.traces = TraceRecorder(self.futures)
        engine = self.registry.engine
        self.clones = CloneCounters(engine)
        self.projects = Projects(engine)
        self.publications = Publications(engine)
        self.audit = AuditLog(engine)
        self.token_issuer = (
            TokenIssuer.for_data_dir(self.layout.data_dir, self.config.jwt_ttl_s)
            if self.config.jwt
            else None
        )
        self.quotas.on_refusal = self._quota_refused
        self.db_threads = ThreadPoolExecutor(DB_THREADS, thread_name_prefix="registry")
        self.db_writer = ThreadPoolExecutor(1, thread_name_prefix="registry-writer")

    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` (registry work) on a database thread; the event loop meanwhile serves
        other requests."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.db_threads, functools.partial(fn, *args))

    async def db_write(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the writer thread: finish steps store in the order they ran."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.db_writer, functools.partial(fn, *args))

    def db_later(self, fn: Callable[..., Any], *args: Any) -> None:
        """`fn(*args)` on a database thread, not awaited (bookkeeping nobody waits for)."""
        pending = asyncio.ensure_future(self.db(fn, *args))
        self.db_pending.add(pending)
        pending.add_done_callback(self._db_later_done)

    def _db_later_done(self, pending: asyncio.Future[Any]) -> None:
        self.db_pending.discard(pending)
        if not pending.cancelled() and pending.exception() is not None:
            log.error("a background registry write failed", exc_info=pending.exception())

    def audit_once(
        self, key: tuple[str, ...], tenant: str, event: str, window_s: float, **details: Any
    ) -> None:
        """`audit.record_once` on a database thread, handed over at most once per `window_s`
        per key (so a request that records nothing costs no thread hop)."""
        now = time.monotonic()
        if now - self.audit_handed.get(key, -math.inf) < window_s:
            return
        if len(self.audit_handed) > 100_000:  # bounded: the audit log's own check still holds
            self.audit_handed.clear()
        self.audit_handed[key] = now
        record = functools.partial(
            self.audit.record_once, key, tenant, event, window_s=window_s, **details
        )
        self.db_later(record)

    async def db_settled(self) -> None:
        """Wait for the background writes handed over so far (a reader of what they write)."""
        if self.db_pending:
            await asyncio.wait(list(self.db_pending))

    async def close_db_threads(self) -> None:
        """Let background writes finish, then stop the database threads (at shutdown)."""
        await self.db_settled()
        self.db_threads.shutdown(wait=True)
        self.db_writer.shutdown(wait=True)

    def _quota_refused(self, tenant: str, name: str, limit: int) -> None:
        self.audit.record_once(
            ("quota", tenant, name), tenant, "quota_refused", limit=name, value=limit
        )

    def model_spec(self, name: str, field_name: str = "base_model") -> ModelSpec:
        spec = self.models.get(name)
        if spec is None:
            served = ", ".join(sorted(self.models))
            raise ApiError(
                400, f"{field_name}: model {name!r} is not served here ({served})", field_name
            )
        return spec

    # The service steps live in modules of their own; these are the names handlers call.

    async def live_session(self, session_id: str, tenant: str) -> SessionRow:
        return await session_liveness.live_session(self, session_id, tenant)

    async def live_training_run(self, model_id: str, tenant: str) -> TrainingRunRow:
        return await session_liveness.live_training_run(self, model_id, tenant)

    def sampler_activity(
        self, sampler_id: str, tenant: str
    ) -> tuple[SamplerRow | None, tuple[SessionRow | None, bool]]:
        return session_liveness.sampler_activity(self, sampler_id, tenant)

    def check_live(self, session_id: str, session: tuple[SessionRow | None, bool]) -> SessionRow:
        return session_liveness.check_live(self, session_id, session)

    async def checkpoint(
        self, tenant: str, path: str, field_name: str
    ) -> tuple[TinkerPath, CheckpointRow]:
        return await checkpoint_lookup.checkpoint(self, tenant, path, field_name)

    async def readable_checkpoint(
        self, tenant: str, path: str, field_name: str
    ) -> tuple[TinkerPath, CheckpointRow, TrainingRunRow]:
        return await checkpoint_lookup.readable_checkpoint(self, tenant, path, field_name)

    async def expire_idle_sessions(self) -> list[str]:
        return await session_release.expire_idle_sessions(self)

    async def release_session(self, session_id: str) -> None:
        await session_release.release_session(self, session_id)

    async def skip_rejected(self, tenant: str, model_id: str, seq_id: int, digest: str) -> None:
        await submission_module.skip_rejected(self, tenant, model_id, seq_id, digest)

    def submit_training(self, submission: TrainingSubmission) -> dict[str, Any]:
        """Queue one operation of a model's ordered stream (api/submission.py)."""
        return submission_module.submit_training(self, submission)


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tuneloop
    return state
