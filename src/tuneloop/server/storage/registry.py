"""The metadata registry: sessions, training runs, checkpoints, samplers, usage, each with its
tenant.

SQLite through SQLAlchemy by default (a Postgres URL works the same). Every lookup the API makes
takes the caller's tenant, so a row of another tenant is simply not found; the few methods that
span tenants are for the operator's command line and say so.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Integer,
    String,
    create_engine,
    event,
    func,
    select,
    update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Times are stored and returned as aware UTC; SQLite would otherwise drop the zone."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    pass


class SessionRow(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_heartbeat: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    sdk_version: Mapped[str] = mapped_column(String(32), default="")


class TrainingRunRow(Base):
    __tablename__ = "training_runs"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    base_model: Mapped[str] = mapped_column(String(256))
    lora_rank: Mapped[int] = mapped_column(Integer)
    lora_seed: Mapped[int] = mapped_column(Integer)
    train_mlp: Mapped[bool] = mapped_column(Boolean)
    train_attn: Mapped[bool] = mapped_column(Boolean)
    train_unembed: Mapped[bool] = mapped_column(Boolean)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_request_time: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    tinker_path: Mapped[str] = mapped_column(String(512), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    training_run_id: Mapped[str] = mapped_column(String(128), index=True)
    checkpoint_id: Mapped[str] = mapped_column(String(256))
    checkpoint_type: Mapped[str] = mapped_column(String(16))
    directory: Mapped[str] = mapped_column(String(1024))
    size_bytes: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class SamplerRow(Base):
    __tablename__ = "samplers"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    base_model: Mapped[str] = mapped_column(String(256))
    model_path: Mapped[str | None] = mapped_column(String(512), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class UsageRow(Base):
    """Tokens and requests metered for one (tenant, session, model, kind); counts accumulate."""

    __tablename__ = "usage"
    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # A training run id or a sampler id.
    model_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    # "train", "forward", "sample_prompt" or "sample_generated" (see api/metering.py).
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


@dataclass(frozen=True)
class UsageCount:
    """Counts to add to one usage row."""

    tenant: str
    session_id: str
    model_id: str
    kind: str
    tokens: int
    requests: int


@dataclass(frozen=True)
class UsageTotal:
    """The sum over a tenant's usage rows of one kind (optionally of one session)."""

    tenant: str
    kind: str
    tokens: int
    requests: int


def engine_url(url: str) -> str:
    """The SQLAlchemy URL for a database URL: PostgreSQL ones that name no driver get psycopg 3
    (SQLAlchemy's own default is psycopg2, which is not installed)."""
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url.removeprefix(scheme)
    return url


class Registry:
    def __init__(self, url: str) -> None:
        url = engine_url(url)
        # A pooled PostgreSQL connection may have died with a database restart: test each one
        # as it is taken from the pool (one round trip) rather than fail the request that gets it.
        self.engine = create_engine(url, pool_pre_ping=not url.startswith("sqlite"))
        if url.startswith("sqlite"):
            # WAL lets readers proceed while the engine loop's writes commit.
            @event.listens_for(self.engine, "connect")
            def _pragmas(conn: Any, _record: Any) -> None:
                cursor = conn.cursor()
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute("PRAGMA synchronous=NORMAL")
                cursor.close()

        Base.metadata.create_all(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    def _db(self) -> Session:
        return self._sessions()

    # ---- generic ----------------------------------------------------------------------------

    def add(self, row: Base) -> None:
        with self._db() as db, db.begin():
            db.merge(row)

    def _get(self, model: type[Any], key: str, tenant: str) -> Any:
        with self._db() as db:
            row = db.get(model, key)
        if row is None or row.tenant != tenant:
            return None
        return row

    # ---- sessions ---------------------------------------------------------------------------

    def session(self, session_id: str, tenant: str) -> SessionRow | None:
        return self._get(SessionRow, session_id, tenant)

    def touch_session(self, session_id: str) -> None:
        with self._db() as db, db.begin():
            row = db.get(SessionRow, session_id)
            if row is not None:
                row.last_heartbeat = utcnow()

    def finish_session(self, session_id: str, reason: str) -> bool:
        """Mark finished; False if it already was (first finish wins)."""
        with self._db() as db, db.begin():
            row = db.get(SessionRow, session_id)
            if row is None or row.finished_at is not None:
                return False
            row.finished_at = utcnow()
            row.finish_reason = reason
            return True

    def list_sessions(self, tenant: str, limit: int, offset: int) -> list[str]:
        with self._db() as db:
            query = (
                select(SessionRow.id)
                .where(SessionRow.tenant == tenant)
                .order_by(SessionRow.created_at.desc())
                .limit(limit)
                .offset(offset)
            )
            return list(db.scalars(query))

    def count_live_sessions(self, tenant: str, active_since: datetime | None) -> int:
        """The tenant's unfinished sessions, less those silent since before `active_since`."""
        where = [SessionRow.tenant == tenant, SessionRow.finished_at.is_(None)]
        if active_since is not None:
            where.append(SessionRow.last_heartbeat >= active_since)
        with self._db() as db:
            return int(db.scalar(select(func.count()).select_from(SessionRow).where(*where)) or 0)

    def oldest_live_activity(self, tenant: str) -> datetime | None:
        """The earliest last_heartbeat among the tenant's unfinished sessions."""
        where = (SessionRow.tenant == tenant) & SessionRow.finished_at.is_(None)
        with self._db() as db:
            value: datetime | None = db.scalar(
                select(func.min(SessionRow.last_heartbeat)).where(where)
            )
        return value

    def stale_sessions(self, silent_since: datetime) -> list[str]:
        """Unfinished sessions of every tenant with no activity since `silent_since` (expiry)."""
        where = SessionRow.finished_at.is_(None) & (SessionRow.last_heartbeat < silent_since)
        with self._db() as db:
            return list(db.scalars(select(SessionRow.id).where(where)))

    # ---- training runs ----------------------------------------------------------------------

    def training_run(self, run_id: str, tenant: str) -> TrainingRunRow | None:
        return self._get(TrainingRunRow, run_id, tenant)

    def touch_training_run(self, run_id: str) -> None:
        with self._db() as db, db.begin():
            row = db.get(TrainingRunRow, run_id)
            if row is not None:
                row.last_request_time = utcnow()

    def list_training_runs(
        self, tenant: str, limit: int, offset: int
    ) -> tuple[list[TrainingRunRow], int]:
        with self._db() as db:
            where = TrainingRunRow.tenant == tenant
            total = db.scalar(select(func.count()).select_from(TrainingRunRow).where(where))
            rows = list(
                db.scalars(
                    select(TrainingRunRow)
                    .where(where)
                    .order_by(TrainingRunRow.created_at.desc())
                    .limit(limit)
                    .offset(offset)
                )
            )
        return rows, int(total or 0)

    def session_children(self, session_id: str) -> tuple[list[str], list[str]]:
        with self._db() as db:
            runs = db.scalars(
                select(TrainingRunRow.id).where(TrainingRunRow.session_id == session_id)
            )
            samplers = db.scalars(select(SamplerRow.id).where(SamplerRow.session_id == session_id))
            return list(runs), list(samplers)

    # ---- checkpoints ------------------------------------------------------------------------

    def checkpoint(self, tinker_path: str, tenant: str) -> CheckpointRow | None:
        return self._get(CheckpointRow, tinker_path, tenant)

    def list_checkpoints(
        self,
        tenant: str,
        *,
        training_run_id: str | None = None,
        limit: int = 1000,
        offset: int = 0,
    ) -> tuple[list[CheckpointRow], int]:
        with self._db() as db:
            where = [CheckpointRow.tenant == tenant]
            if training_run_id is not None:
                where.append(CheckpointRow.training_run_id == training_run_id)
            total = db.scalar(select(func.count()).select_from(CheckpointRow).where(*where))
            rows = list(
                db.scalars(
                    select(CheckpointRow)
                    .where(*where)
                    .order_by(CheckpointRow.created_at.desc())
                    .limit(limit)
                    .offset(offset)
                )
            )
        return rows, int(total or 0)

    def delete_checkpoint(self, tinker_path: str, tenant: str) -> CheckpointRow | None:
        with self._db() as db, db.begin():
            row = db.get(CheckpointRow, tinker_path)
            if row is None or row.tenant != tenant:
                return None
            db.delete(row)
            return row

    def remove_checkpoint(self, tinker_path: str, tenant: str) -> CheckpointRow | None:
        """Delete the row, then its files; None if the tenant has no such checkpoint.

        The one way a checkpoint goes (REST delete and `tuneloop checkpoints delete`): the row
        first, so a crash in between leaves orphaned files and never a row without files.
        """
        row = self.delete_checkpoint(tinker_path, tenant)
        if row is not None:
            shutil.rmtree(Path(row.directory), ignore_errors=True)
        return row

    # ---- samplers ---------------------------------------------------------------------------

    def sampler(self, sampler_id: str, tenant: str) -> SamplerRow | None:
        return self._get(SamplerRow, sampler_id, tenant)

    # ---- usage ------------------------------------------------------------------------------

    def add_usage(self, counts: Iterable[UsageCount]) -> None:
        """Add counts to their rows (created on first use), all in one transaction."""
        with self._db() as db, db.begin():
            for c in counts:
                key = (
                    (UsageRow.tenant == c.tenant)
                    & (UsageRow.session_id == c.session_id)
                    & (UsageRow.model_id == c.model_id)
                    & (UsageRow.kind == c.kind)
                )
                # An in-place increment, so the sum is right even if another writer got there
                # first; the insert only happens for a key never seen before.
                changed = db.execute(
                    update(UsageRow)
                    .where(key)
                    .values(
                        tokens=UsageRow.tokens + c.tokens,
                        requests=UsageRow.requests + c.requests,
                        updated_at=utcnow(),
                    )
                )
                if getattr(changed, "rowcount", 0) == 0:
                    db.add(
                        UsageRow(
                            tenant=c.tenant,
                            session_id=c.session_id,
                            model_id=c.model_id,
                            kind=c.kind,
                            tokens=c.tokens,
                            requests=c.requests,
                            updated_at=utcnow(),
                        )
                    )
                    db.flush()

    def usage(self, tenant: str, session_id: str | None = None) -> list[UsageTotal]:
        """The tenant's totals per kind, over all its sessions or over one."""
        return self.usage_totals(tenant, session_id)

    # ---- operator views (command line only: they span tenants when tenant is None) ----------

    def usage_totals(
        self, tenant: str | None = None, session_id: str | None = None
    ) -> list[UsageTotal]:
        """Totals per (tenant, kind), ordered by tenant then kind."""
        query = select(
            UsageRow.tenant,
            UsageRow.kind,
            func.sum(UsageRow.tokens),
            func.sum(UsageRow.requests),
        ).group_by(UsageRow.tenant, UsageRow.kind)
        if tenant is not None:
            query = query.where(UsageRow.tenant == tenant)
        if session_id is not None:
            query = query.where(UsageRow.session_id == session_id)
        with self._db() as db:
            rows = db.execute(query.order_by(UsageRow.tenant, UsageRow.kind)).all()
        return [UsageTotal(t, k, int(tok or 0), int(req or 0)) for t, k, tok, req in rows]

    def session_any_tenant(self, session_id: str) -> SessionRow | None:
        with self._db() as db:
            return db.get(SessionRow, session_id)

    def all_training_runs(self, tenant: str | None = None) -> list[TrainingRunRow]:
        query = select(TrainingRunRow).order_by(TrainingRunRow.created_at.desc())
        if tenant is not None:
            query = query.where(TrainingRunRow.tenant == tenant)
        with self._db() as db:
            return list(db.scalars(query))

    def training_run_any_tenant(self, run_id: str) -> TrainingRunRow | None:
        with self._db() as db:
            return db.get(TrainingRunRow, run_id)

    def all_checkpoints(
        self, tenant: str | None = None, training_run_id: str | None = None
    ) -> list[CheckpointRow]:
        query = select(CheckpointRow).order_by(CheckpointRow.created_at.desc())
        if tenant is not None:
            query = query.where(CheckpointRow.tenant == tenant)
        if training_run_id is not None:
            query = query.where(CheckpointRow.training_run_id == training_run_id)
        with self._db() as db:
            return list(db.scalars(query))

    def checkpoint_any_tenant(self, tinker_path: str) -> CheckpointRow | None:
        with self._db() as db:
            return db.get(CheckpointRow, tinker_path)
