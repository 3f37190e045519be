"""The metadata registry: sessions, training runs, checkpoints, samplers, each with its tenant.

SQLite through SQLAlchemy by default (a Postgres URL works the same). Every lookup takes the
caller's tenant, so a row of another tenant is simply not found.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, Boolean, DateTime, Integer, String, create_engine, event, func, select
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


class Registry:
    def __init__(self, url: str) -> None:
        self.engine = create_engine(url)
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

    # ---- samplers ---------------------------------------------------------------------------

    def sampler(self, sampler_id: str, tenant: str) -> SamplerRow | None:
        return self._get(SamplerRow, sampler_id, tenant)
