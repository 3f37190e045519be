"""The metadata registry: sessions, training runs, checkpoints (model packages), samplers, usage,
each with its tenant.

SQLite through SQLAlchemy by default (a Postgres URL works the same). Every lookup the API makes
takes the caller's tenant, so a row of another tenant is simply not found; the few methods that
span tenants are for the operator's command line and say so.
"""

from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Integer,
    String,
    create_engine,
    event,
    func,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from tuneloop.server.storage.base import Base, UTCDateTime, utcnow
from tuneloop.server.storage.layout import PRIVATE_FILE_MODE, TinkerPath
from tuneloop.server.storage.migrations import upgrade
from tuneloop.server.storage.upsert import insert_missing
from tuneloop.server.storage.usage_store import UsageCount, UsageFilter, UsageStore, UsageSum

# Re-exported: the API and the command line import these from here.
__all__ = [
    "MERGED_KIND",
    "PACKAGE_KINDS",
    "Base",
    "CheckpointRow",
    "PackageNameRow",
    "Registry",
    "RowExistsError",
    "SamplerRow",
    "SessionRow",
    "TrainingRunRow",
    "UsageCount",
    "UsageFilter",
    "UsageSum",
    "engine_url",
    "lora_targets",
    "merged_package",
    "utcnow",
]


class RowExistsError(Exception):
    """An insert of a row whose key is taken (an id re-used)."""


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
    display_name: Mapped[str | None] = mapped_column(String(256), nullable=True)


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
    train_experts: Mapped[bool | None] = mapped_column(Boolean, nullable=True)  # None: as mlp
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_request_time: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Optimizer steps the weights have had: 0 at creation, the package's step after a load,
    # +1 per completed optim_step. Saved into every package of the run.
    training_step: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The package (tinker path) the run was last loaded from, if any: the parent of its packages.
    parent_path: Mapped[str | None] = mapped_column(String(512), nullable=True)


# Package kinds, by checkpoint type: what a package holds. An external checkpoint the server
# writes (save_weights_external) is the adapter alone in the PEFT layout; the other kind of
# external package, base + adapter merged into one model, is registered only by
# `tuneloop checkpoints export --merged` (merged_package).
PACKAGE_KINDS = {"training": "training-state", "sampler": "sampler", "external": "adapter"}
MERGED_KIND = "merged"


class CheckpointRow(Base):
    """A saved checkpoint, registered as a versioned model package.

    `name` is the checkpoint name the user gave (the last part of the tinker path); `version`
    counts 1, 2, ... over every package the tenant registered under that name, whatever its run
    or kind, and is never reused (see PackageNameRow). Package columns are NULL only on rows an
    older version wrote and the migration could not fill (training_step, unknown then).
    """

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
    name: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    kind: Mapped[str | None] = mapped_column(String(32), nullable=True)
    base_model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    lora_rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Trained parts, of "attn", "mlp", "unembed".
    lora_targets: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    parent_path: Mapped[str | None] = mapped_column(String(512), nullable=True)
    training_step: Mapped[int | None] = mapped_column(Integer, nullable=True)


class PackageNameRow(Base):
    """The last version given out per (tenant, package name): versions are never reused, also
    after the newest package of a name is deleted or expires."""

    __tablename__ = "package_names"
    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    last_version: Mapped[int] = mapped_column(Integer, default=0)


def lora_targets(run: TrainingRunRow) -> list[str]:
    flags = (("attn", run.train_attn), ("mlp", run.train_mlp), ("unembed", run.train_unembed))
    return [name for name, on in flags if on]


def merged_package(source: CheckpointRow, target: TinkerPath, directory: Path) -> CheckpointRow:
    """The row of a merged export of `source` (base model + adapter as one plain model) kept
    in `directory`, to be registered at tinker path `target`."""
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    return CheckpointRow(
        tinker_path=str(target),
        tenant=source.tenant,
        training_run_id=source.training_run_id,
        checkpoint_id=target.checkpoint_id,
        checkpoint_type="external",
        directory=str(directory),
        size_bytes=size,
        created_at=utcnow(),
        name=target.name,
        kind=MERGED_KIND,
        base_model=source.base_model,
        lora_rank=source.lora_rank,
        lora_targets=source.lora_targets,
        parent_path=source.tinker_path,
        training_step=source.training_step,
    )


class SamplerRow(Base):
    __tablename__ = "samplers"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    base_model: Mapped[str] = mapped_column(String(256))
    model_path: Mapped[str | None] = mapped_column(String(512), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


def engine_url(url: str) -> str:
    """The SQLAlchemy URL for a database URL: PostgreSQL ones that name no driver get psycopg 3
    (SQLAlchemy's own default is psycopg2, which is not installed)."""
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url.removeprefix(scheme)
    return url


def _private_sqlite_files(database: Path) -> None:
    """The database file and its WAL companions readable by the server's user only (SQLite
    gives the companions the database file's mode when it creates them)."""
    for path in (
        database,
        database.with_name(database.name + "-wal"),
        database.with_name(database.name + "-shm"),
    ):
        if path.exists():
            path.chmod(PRIVATE_FILE_MODE)


class Registry(UsageStore):
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
        upgrade(self.engine, Base.metadata)
        if url.startswith("sqlite") and self.engine.url.database not in (None, "", ":memory:"):
            _private_sqlite_files(Path(str(self.engine.url.database)))
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    def _db(self) -> Session:
        return self._sessions()

    # ---- generic ----------------------------------------------------------------------------

    def add(self, row: Base) -> None:
        """Insert a new row. A row with its key already there is never overwritten: that is
        RowExistsError, and nothing changes (changes to a row are the explicit updates below)."""
        try:
            with self._db() as db, db.begin():
                db.add(row)
        except IntegrityError as exc:
            key = getattr(row, "id", None) or getattr(row, "tinker_path", None)
            table = getattr(row, "__tablename__", type(row).__name__)
            raise RowExistsError(f"{table} row {key!r} already exists") from exc

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

    def advance_training_step(self, run_id: str) -> None:
        """One more optimizer step applied (an in-place increment: no lost update)."""
        with self._db() as db, db.begin():
            db.execute(
                update(TrainingRunRow)
                .where(TrainingRunRow.id == run_id)
                .values(training_step=TrainingRunRow.training_step + 1)
            )

    def set_training_origin(self, run_id: str, parent_path: str, training_step: int) -> None:
        """The run's weights now come from package `parent_path`, at its training step."""
        with self._db() as db, db.begin():
            db.execute(
                update(TrainingRunRow)
                .where(TrainingRunRow.id == run_id)
                .values(parent_path=parent_path, training_step=training_step)
            )

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

    def register_package(self, row: CheckpointRow) -> CheckpointRow:
        """Store a checkpoint row under the next version of its (tenant, name).

        A row at the same tinker path (an overwrite) is replaced: its files were overwritten,
        so the old version is gone and the new one gets a new number.
        """
        assert row.name is not None
        with self._db() as db, db.begin():
            key = (PackageNameRow.tenant == row.tenant) & (PackageNameRow.name == row.name)
            # Created at version 0 unless it exists, then incremented in place, so concurrent
            # registrations of one name get distinct versions (upsert.py).
            insert_missing(db, PackageNameRow, tenant=row.tenant, name=row.name)
            db.execute(
                update(PackageNameRow)
                .where(key)
                .values(last_version=PackageNameRow.last_version + 1)
            )
            row.version = db.scalar(select(PackageNameRow.last_version).where(key))
            db.merge(row)
        return row

    def set_checkpoint_expiry(
        self, tinker_path: str, tenant: str, expires_at: datetime | None
    ) -> CheckpointRow | None:
        """Set (or with None, clear) when a package expires; None if the tenant has no such."""
        with self._db() as db, db.begin():
            row = db.get(CheckpointRow, tinker_path)
            if row is None or row.tenant != tenant:
                return None
            row.expires_at = expires_at
            return row

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

    def expired_checkpoints(self, now: datetime) -> list[CheckpointRow]:
        """Packages of every tenant whose expiry is at or before `now` (operator, GC)."""
        query = select(CheckpointRow).where(
            CheckpointRow.expires_at.is_not(None), CheckpointRow.expires_at <= now
        )
        with self._db() as db:
            return list(db.scalars(query.order_by(CheckpointRow.expires_at)))

    def collect_expired(self, now: datetime | None = None) -> list[CheckpointRow]:
        """Remove every package expired at `now` (default: the current time), row then files.

        A row whose expiry was extended or cleared since the listing is kept: each delete
        checks the expiry again inside its own transaction.
        """
        now = now or utcnow()
        removed: list[CheckpointRow] = []
        for candidate in self.expired_checkpoints(now):
            with self._db() as db, db.begin():
                row = db.get(CheckpointRow, candidate.tinker_path)
                if row is None or row.expires_at is None or row.expires_at > now:
                    continue
                db.delete(row)
            shutil.rmtree(Path(row.directory), ignore_errors=True)
            removed.append(row)
        return removed

    # ---- samplers ---------------------------------------------------------------------------

    def sampler(self, sampler_id: str, tenant: str) -> SamplerRow | None:
        return self._get(SamplerRow, sampler_id, tenant)

    # ---- operator views (command line only: they span tenants when tenant is None) ----------

    def session_any_tenant(self, session_id: str) -> SessionRow | None:
        with self._db() as db:
            return db.get(SessionRow, session_id)

    def all_training_runs(self, tenant: str | None = None) -> list[TrainingRunRow]:
        query = select(TrainingRunRow).order_by(TrainingRunRow.created_at.desc())
        if tenant is not None:
            query = query.where(TrainingRunRow.tenant == tenant)
        with self._db() as db:
            return list(db.scalars(query))

    def usage_owner(self, model_id: str) -> str | None:
        """The tenant of a training run or sampler id, whoever it is."""
        with self._db() as db:
            row = db.get(TrainingRunRow, model_id) or db.get(SamplerRow, model_id)
            return row.tenant if row is not None else None

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
