"""Everything a request handler needs, built once by the app and reached through `get_state`."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

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
from tuneloop.server.api.traces import TraceRecorder
from tuneloop.server.config import ServerConfig
from tuneloop.server.engine.types import ModelSpec
from tuneloop.server.scheduler.futures import FutureTable, Outcome
from tuneloop.server.scheduler.loop import EngineLoop, failure
from tuneloop.server.scheduler.queue import Operation, OperationQueue, OpKind, SeqConflictError
from tuneloop.server.storage.audit import AuditLog
from tuneloop.server.storage.clones import CloneCounters
from tuneloop.server.storage.keys import KeyStore
from tuneloop.server.storage.layout import Layout, TinkerPath
from tuneloop.server.storage.projects import Projects
from tuneloop.server.storage.publications import Publications
from tuneloop.server.storage.registry import (
    CheckpointRow,
    Registry,
    SessionRow,
    TrainingRunRow,
    utcnow,
)

log = logging.getLogger(__name__)
EXPIRED = "expired"  # the finish reason of a session that went silent past the TTL
# Heartbeats and requests naming a session are its activity, written to its last_heartbeat
# at most this often (or every quarter TTL, if shorter): not one database write per request.
ACTIVITY_WRITE_S = 5.0


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

    def live_session(self, session_id: str, tenant: str) -> SessionRow:
        """The caller's unfinished, unexpired session; any request naming it is activity.

        404 if it is not the caller's, 410 if it finished or expired. A session found silent
        past the TTL expires here and now, before the periodic sweep would get to it.
        """
        row = self.registry.session(session_id, tenant)
        if row is None:
            raise not_found(f"session {session_id!r}", "session_id")
        if row.finished_at is None:
            idle_s = (utcnow() - row.last_heartbeat).total_seconds()
            ttl = self.config.session_ttl_s
            if ttl and idle_s > ttl:
                self.expire_now(session_id)
                row = self.registry.session(session_id, tenant) or row
            elif idle_s > min(ACTIVITY_WRITE_S, ttl / 4 if ttl else ACTIVITY_WRITE_S):
                self.registry.touch_session(session_id)
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

    def live_training_run(self, model_id: str, tenant: str) -> TrainingRunRow:
        run = self.registry.training_run(model_id, tenant)
        if run is None:
            raise not_found(f"model {model_id!r}", "model_id")
        self.live_session(run.session_id, tenant)
        require_held(
            run.created_at, self.futures.started_at, f"model {model_id!r}", "model_id", LOAD
        )
        return run

    def checkpoint(
        self, tenant: str, path: str, field_name: str
    ) -> tuple[TinkerPath, CheckpointRow]:
        """The caller's checkpoint at a tinker:// path; 400 if malformed, 404 if not theirs."""
        try:
            parsed = TinkerPath.parse(path)
        except ValueError as exc:
            raise ApiError(400, f"{field_name}: {exc}", field_name) from None
        row = self.registry.checkpoint(str(parsed), tenant)
        if row is None:
            raise not_found(f"checkpoint {path!r}", field_name)
        return parsed, row

    def readable_checkpoint(
        self, tenant: str, path: str, field_name: str
    ) -> tuple[TinkerPath, CheckpointRow, TrainingRunRow]:
        """A checkpoint the caller may read: its own, or one another tenant published; with
        the training run that saved it. For reads only: writes go through `checkpoint`."""
        try:
            parsed = TinkerPath.parse(path)
        except ValueError as exc:
            raise ApiError(400, f"{field_name}: {exc}", field_name) from None
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
        return parsed, row, run

    def expire_now(self, session_id: str) -> None:
        """Mark a silent session expired and free it in the background (first finish wins)."""
        if self.registry.finish_session(session_id, EXPIRED):
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
        for session_id in self.registry.stale_sessions(silent_since):
            if self.registry.finish_session(session_id, EXPIRED):
                log.info("session %s expired after %g s without activity", session_id, self.ttl_s)
                await self.release_session(session_id)
                expired.append(session_id)
        return expired

    async def release_session(self, session_id: str) -> None:
        """Free a finished session's adapters and samplers; its checkpoints stay.

        Work still queued for them fails with a clear error instead of running.
        """
        runs, samplers = self.registry.session_children(session_id)
        row = self.registry.session_any_tenant(session_id)
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
            await self.engine.call(self.engine.backend.delete_adapter, run)
        released = set(samplers)
        for op in self.queue.drop_samples(lambda op: op.work.sampler_id not in released):
            self.futures.resolve(op.request_id, gone)
        # Requests already past the queue (a gathering or running decode batch) stop too.
        self.engine.cancel_samplers(released)
        self.feeds.forget_samplers(released)
        for sampler_id in samplers:
            await self.engine.call(self.engine.backend.delete_sampler, sampler_id)
        # Their sample-retry records go too: the map would otherwise grow with every request.
        for key in [k for k in self.sample_submissions if k[0] in released]:
            del self.sample_submissions[key]
        try:  # the session's usage is final now: write it, so readers see it at once
            await self.meter.flush_async(self.registry)
        except Exception:  # the periodic flush retries; finishing must not fail for this
            log.exception("writing usage counts failed")

    def skip_rejected(self, tenant: str, model_id: str, seq_id: int, digest: str) -> None:
        """A rejected training request still consumes its seq_id (the SDKs never reuse one).

        `digest`: the rejected body's fingerprint."""
        if seq_id >= 1 and self.registry.training_run(model_id, tenant) is not None:
            self.queue.skip(model_id, seq_id, digest)
            self.engine.notify()

    def submit_training(
        self,
        tenant: str,
        model_id: str,
        seq_id: int,
        kind: OpKind,
        work: Any,
        finish: Callable[[Any], Outcome],
        body: bytes,
        request_type: str,
        digest: str | None = None,
    ) -> dict[str, Any]:
        """Queue one operation of a model's ordered stream; retries map to the first request.

        `digest`: the body's fingerprint, if the caller computed it (off the event loop)."""
        digest = digest if digest is not None else fingerprint(body)
        try:
            existing = self.queue.existing(model_id, seq_id, digest)
        except SeqConflictError as exc:
            raise ApiError(409, str(exc), "seq_id") from None
        if existing is not None:
            return {"request_id": existing, "model_id": model_id}
        # A request that later, accepted requests of its model wait for is let in even at the
        # limit: refusing it would leave them waiting, holding the very slots it waits for.
        # So the tenant exceeds the limit by at most the number of those waiting requests.
        if not self.queue.unblocks_waiting(model_id, seq_id):
            self.quotas.check_inflight(tenant)
        request_id = self.futures.create(tenant, request_type)
        self.revocations.track(request_id)
        self.traces.submitted(
            request_id, model_id.partition(":")[0], request_type, model_id, seq_id
        )
        self.queue.submit_training(
            Operation(request_id, kind, work, finish, model_id, seq_id, digest)
        )
        self.engine.notify(kind)
        self.registry.touch_training_run(model_id)
        return {"request_id": request_id, "model_id": model_id}


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tuneloop
    return state
