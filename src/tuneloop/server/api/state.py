"""Everything a request handler needs, built once by the app and reached through `get_state`."""

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
from datetime import timedelta
from typing import Any, TypeVar

from fastapi import Request

from tuneloop.server.api.auth_tokens import TokenIssuer
from tuneloop.server.api.custom_loss_store import CustomLossStore
from tuneloop.server.api.errors import ApiError, not_found
from tuneloop.server.api.futures_feed import CompletionFeeds
from tuneloop.server.api.metering import Meter
from tuneloop.server.api.quotas import Quotas
from tuneloop.server.api.restarts import LOAD, require_held
from tuneloop.server.api.revocation import Revocations
from tuneloop.server.api.stability import StabilityRecords
from tuneloop.server.api.submission import TrainingSubmission, submit_training
from tuneloop.server.api.traces import TraceRecorder
from tuneloop.server.config import ServerConfig
from tuneloop.server.engine.operations import DeleteAdapter, DeleteSampler
from tuneloop.server.engine.types import ModelSpec
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.loop import EngineLoop, failure
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
    utcnow,
)

log = logging.getLogger(__name__)
EXPIRED = "expired"  # the finish reason of a session that went silent past the TTL
# Heartbeats and requests naming a session are its activity, written to its last_heartbeat
# at most this often (or every quarter TTL, if shorter): not one database write per request.
ACTIVITY_WRITE_S = 5.0
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

    async def live_session(self, session_id: str, tenant: str) -> SessionRow:
        """The caller's unfinished, unexpired session; any request naming it is activity.

        404 if it is not the caller's, 410 if it finished or expired. A session found silent
        past the TTL expires here and now, before the periodic sweep would get to it.
        """
        row, expired = await self.db(self._session_activity, session_id, tenant)
        return self._live(session_id, row, expired)

    def _session_activity(self, session_id: str, tenant: str) -> tuple[SessionRow | None, bool]:
        """On a database thread: the session's row after recording this request as its
        activity, and whether it expired just now (its release is then the caller's)."""
        row = self.registry.session(session_id, tenant)
        if row is None or row.finished_at is not None:
            return row, False
        idle_s = (utcnow() - row.last_heartbeat).total_seconds()
        ttl = self.config.session_ttl_s
        if ttl and idle_s > ttl:
            expired = self.registry.finish_session(session_id, EXPIRED)
            return self.registry.session(session_id, tenant) or row, expired
        if idle_s > min(ACTIVITY_WRITE_S, ttl / 4 if ttl else ACTIVITY_WRITE_S):
            self.registry.touch_session(session_id)
        return row, False

    def _live(self, session_id: str, row: SessionRow | None, expired: bool) -> SessionRow:
        """On the event loop: `_session_activity`'s answer as a row, a release or an error."""
        if expired:
            self._release_expired(session_id)
        if row is None:
            raise not_found(f"session {session_id!r}", "session_id")
        if row.finished_at is not None:
            if row.finish_reason == EXPIRED:
                raise ApiError(
                    410,
                    f"session {session_id!r} expired: no heartbeat or request for more than "
                    f"{self.config.session_ttl_s:g} s; its models and samplers were freed "
                    "(saved checkpoints remain): start a new session",
                    "session_id",
                )
            raise ApiError(410, f"session {session_id!r} is finished", "session_id")
        return row

    async def live_training_run(self, model_id: str, tenant: str) -> TrainingRunRow:
        run, session = await self.db(self._run_activity, model_id, tenant)
        if run is None:
            raise not_found(f"model {model_id!r}", "model_id")
        self._live(run.session_id, *session)
        require_held(
            run.created_at, self.futures.started_at, f"model {model_id!r}", "model_id", LOAD
        )
        return run

    def _run_activity(
        self, model_id: str, tenant: str
    ) -> tuple[TrainingRunRow | None, tuple[SessionRow | None, bool]]:
        """On a database thread: the run, and its session's `_session_activity` (one hop)."""
        run = self.registry.training_run(model_id, tenant)
        if run is None:
            return None, (None, False)
        return run, self._session_activity(run.session_id, tenant)

    def sampler_activity(
        self, sampler_id: str, tenant: str
    ) -> tuple[SamplerRow | None, tuple[SessionRow | None, bool]]:
        """On a database thread: the sampler, and its session's `_session_activity` (one hop:
        sample requests are the most frequent); `check_live` then judges the session."""
        sampler = self.registry.sampler(sampler_id, tenant)
        if sampler is None:
            return None, (None, False)
        return sampler, self._session_activity(sampler.session_id, tenant)

    def check_live(self, session_id: str, session: tuple[SessionRow | None, bool]) -> SessionRow:
        """On the event loop: the session of `sampler_activity`, or its 404/410."""
        return self._live(session_id, *session)

    async def checkpoint(
        self, tenant: str, path: str, field_name: str
    ) -> tuple[TinkerPath, CheckpointRow]:
        """The caller's checkpoint at a tinker:// path; 400 if malformed, 404 if not theirs."""
        try:
            parsed = TinkerPath.parse(path)
        except ValueError as exc:
            raise ApiError(400, f"{field_name}: {exc}", field_name) from None
        row = await self.db(self.registry.checkpoint, str(parsed), tenant)
        if row is None:
            raise not_found(f"checkpoint {path!r}", field_name)
        return parsed, row

    async def readable_checkpoint(
        self, tenant: str, path: str, field_name: str
    ) -> tuple[TinkerPath, CheckpointRow, TrainingRunRow]:
        """A checkpoint the caller may read: its own, or one another tenant published; with
        the training run that saved it. For reads only: writes go through `checkpoint`."""
        try:
            parsed = TinkerPath.parse(path)
        except ValueError as exc:
            raise ApiError(400, f"{field_name}: {exc}", field_name) from None
        row, run = await self.db(self._readable, parsed, tenant, path, field_name)
        return parsed, row, run

    def _readable(
        self, parsed: TinkerPath, tenant: str, path: str, field_name: str
    ) -> tuple[CheckpointRow, TrainingRunRow]:
        """On a database thread: `readable_checkpoint`'s rows (its audit record included)."""
        row = self.registry.checkpoint(str(parsed), tenant)
        if row is None:
            found = self.registry.checkpoint_any_tenant(str(parsed))
            if found is None or not self.publications.is_public(found):
                raise not_found(f"checkpoint {path!r}", field_name)
            row = found
            self.audit.record_once(
                ("read", row.tinker_path, tenant),
                row.tenant,
                "checkpoint_read",
                tinker_path=row.tinker_path,
                reader=tenant,
            )
        run = self.registry.training_run(row.training_run_id, row.tenant)
        if run is None:
            raise not_found(f"training run of {path!r}", field_name)
        return row, run

    def _release_expired(self, session_id: str) -> None:
        """Free a session a request just found expired, in the background."""
        log.info("session %s expired after %g s without activity", session_id, self.ttl_s)
        task = asyncio.get_running_loop().create_task(self.release_session(session_id))
        self.releases.add(task)
        task.add_done_callback(self.releases.discard)

    @property
    def ttl_s(self) -> float:
        return self.config.session_ttl_s

    async def expire_idle_sessions(self) -> list[str]:
        """Expire every session silent for longer than the TTL (all tenants); their ids."""
        if not self.ttl_s:
            return []
        silent_since = utcnow() - timedelta(seconds=self.ttl_s)
        expired = []
        for session_id in await self.db(self.registry.stale_sessions, silent_since):
            if await self.db(self.registry.finish_session, session_id, EXPIRED):
                log.info("session %s expired after %g s without activity", session_id, self.ttl_s)
                await self.release_session(session_id)
                expired.append(session_id)
        return expired

    async def release_session(self, session_id: str) -> None:
        """Free a finished session's adapters and samplers; its checkpoints stay.

        Work still queued for them fails with a clear error instead of running.
        """
        runs, samplers = await self.db(self.registry.session_children, session_id)
        row = await self.db(self.registry.session_any_tenant, session_id)
        if row is not None and row.finish_reason == EXPIRED:
            why = (
                f"session {session_id} expired (no heartbeat or request for more than "
                f"{self.ttl_s:g} s), so its pending work was cancelled"
            )
        else:
            why = f"session {session_id} is finished"
        gone = failure(why, "user")
        for run in runs:
            for op in self.queue.forget_model(run):
                self.futures.resolve(op.request_id, gone)
            await self.engine.perform(DeleteAdapter(run))
        released = set(samplers)
        for op in self.queue.drop_samples(
            lambda op: getattr(op.work, "sampler_id", None) not in released
        ):
            self.futures.resolve(op.request_id, gone)
        # Requests already past the queue (a gathering or running decode batch) stop too.
        self.engine.cancel_samplers(released)
        self.feeds.forget_samplers(released)
        for sampler_id in samplers:
            await self.engine.perform(DeleteSampler(sampler_id))
        # Their sample-retry records go too: the map would otherwise grow with every request.
        for key in [k for k in self.sample_submissions if k[0] in released]:
            del self.sample_submissions[key]
        try:  # the session's usage is final now: write it, so readers see it at once
            await self.meter.flush_async(self.registry)
        except Exception:  # the periodic flush retries; finishing must not fail for this
            log.exception("writing usage counts failed")

    async def skip_rejected(self, tenant: str, model_id: str, seq_id: int, digest: str) -> None:
        """A rejected training request still consumes its seq_id (the SDKs never reuse one).

        `digest`: the rejected body's fingerprint."""
        if seq_id >= 1 and await self.db(self.registry.training_run, model_id, tenant) is not None:
            self.queue.skip(model_id, seq_id, digest)
            self.engine.notify()

    def submit_training(self, submission: TrainingSubmission) -> dict[str, Any]:
        """Queue one operation of a model's ordered stream (api/submission.py)."""
        return submit_training(self, submission)


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tuneloop
    return state
