"""Metered usage in the registry: one row per (tenant, hour, session, model, operation), whose
counts accumulate; mixed into Registry."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import BigInteger, String, func, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from tuneloop.server.storage.base import Base, UTCDateTime, utcnow
from tuneloop.server.storage.upsert import insert_missing


class UsageRow(Base):
    """Tokens metered for one (tenant, hour, session, model, operation); counts accumulate.

    Hours are UTC epoch seconds of the hour's start: an integer key compares and groups the
    same way on every database, and a day or a range is a plain integer interval.
    """

    __tablename__ = "usage_hourly"
    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    hour: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # A training run id or a sampler id.
    model_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    # "forward_backward", "forward" or "sample" (see api/metering.py).
    operation: Mapped[str] = mapped_column(String(32), primary_key=True)
    prefill_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    sampled_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    trained_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


@dataclass(frozen=True)
class UsageCount:
    """Counts to add to one usage row."""

    tenant: str
    hour: int
    session_id: str
    model_id: str
    operation: str
    prefill_tokens: int = 0
    sampled_tokens: int = 0
    trained_tokens: int = 0
    requests: int = 0


@dataclass(frozen=True)
class UsageFilter:
    """Which usage rows to sum; hours are epoch seconds, `since` inclusive, `until` exclusive."""

    tenant: str | None = None
    session_id: str | None = None
    model_id: str | None = None
    since_hour: int | None = None
    until_hour: int | None = None


@dataclass(frozen=True)
class UsageSum:
    """The sum of usage rows of one (tenant, hour, operation)."""

    tenant: str
    hour: int
    operation: str
    prefill_tokens: int
    sampled_tokens: int
    trained_tokens: int
    requests: int


class UsageStore:
    """The usage methods of Registry."""

    def _db(self) -> Session:  # Registry's
        raise NotImplementedError

    def add_usage(self, counts: Iterable[UsageCount]) -> None:
        """Add counts to their rows (created on first use), all in one transaction."""
        with self._db() as db, db.begin():
            for c in counts:
                key = (
                    (UsageRow.tenant == c.tenant)
                    & (UsageRow.hour == c.hour)
                    & (UsageRow.session_id == c.session_id)
                    & (UsageRow.model_id == c.model_id)
                    & (UsageRow.operation == c.operation)
                )
                # The row first (empty, unless it exists), then an in-place increment: the sum
                # is right however many writers add to one row at once (upsert.py).
                insert_missing(
                    db,
                    UsageRow,
                    tenant=c.tenant,
                    hour=c.hour,
                    session_id=c.session_id,
                    model_id=c.model_id,
                    operation=c.operation,
                )
                db.execute(
                    update(UsageRow)
                    .where(key)
                    .values(
                        prefill_tokens=UsageRow.prefill_tokens + c.prefill_tokens,
                        sampled_tokens=UsageRow.sampled_tokens + c.sampled_tokens,
                        trained_tokens=UsageRow.trained_tokens + c.trained_tokens,
                        requests=UsageRow.requests + c.requests,
                        updated_at=utcnow(),
                    )
                )

    def usage_sums(self, where: UsageFilter) -> list[UsageSum]:
        """Sums per (tenant, hour, operation), ordered so; spans tenants when tenant is None
        (the operator's command line), the API always passes the caller's."""
        query = select(
            UsageRow.tenant,
            UsageRow.hour,
            UsageRow.operation,
            func.sum(UsageRow.prefill_tokens),
            func.sum(UsageRow.sampled_tokens),
            func.sum(UsageRow.trained_tokens),
            func.sum(UsageRow.requests),
        ).group_by(UsageRow.tenant, UsageRow.hour, UsageRow.operation)
        if where.tenant is not None:
            query = query.where(UsageRow.tenant == where.tenant)
        if where.session_id is not None:
            query = query.where(UsageRow.session_id == where.session_id)
        if where.model_id is not None:
            query = query.where(UsageRow.model_id == where.model_id)
        if where.since_hour is not None:
            query = query.where(UsageRow.hour >= where.since_hour)
        if where.until_hour is not None:
            query = query.where(UsageRow.hour < where.until_hour)
        order = (UsageRow.tenant, UsageRow.hour, UsageRow.operation)
        with self._db() as db:
            rows = db.execute(query.order_by(*order)).all()
        return [UsageSum(t, int(h), op, *(int(v or 0) for v in sums)) for t, h, op, *sums in rows]
