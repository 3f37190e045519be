"""Per-step training curves of each run, kept in the registry database beside the run.

One row per optimizer step: when it completed, the forward_backward metrics summed or averaged
over the step (`loss:sum`, ...), the optim_step's own metrics (`grad_norm`, ...), the tokens
trained and the seconds the step took. Only the last `keep` steps of a run are kept, so a run of
a million steps costs a bounded table; the console draws its curves from here, and they survive
restarts since they live in the same database as the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Engine, Float, Integer, String, delete, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from tuneloop.server.storage.base import Base, UTCDateTime, utcnow

__all__ = ["DEFAULT_KEEP", "RunMetricRow", "RunMetricsStore", "StepPoint"]

# Points kept per run: enough to draw a long run's whole shape at laptop resolution.
DEFAULT_KEEP = 2000


class RunMetricRow(Base):
    __tablename__ = "run_step_metrics"
    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    run_id: Mapped[str] = mapped_column(String(128), index=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    step: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    trained_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    step_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # {"loss:sum": ..., "grad_norm": ..., ...}: whatever the engine returned, finite values only.
    metrics: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)


@dataclass(frozen=True)
class StepPoint:
    """One step of a run's curve, as the console's data route sends it."""

    step: int
    at: datetime
    trained_tokens: int
    step_s: float | None
    metrics: dict[str, float]

    def as_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "at": self.at.timestamp(),
            "trained_tokens": self.trained_tokens,
            "step_s": self.step_s,
            "metrics": self.metrics,
        }


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    # JSON has no NaN or infinity; a diverged step is shown as a gap, not a broken document.
    return {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}


class RunMetricsStore:
    """The curve table on the registry's database engine (created on first use)."""

    def __init__(self, engine: Engine, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.keep = keep
        RunMetricRow.__table__.create(engine, checkfirst=True)  # type: ignore[attr-defined]
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    def _db(self) -> Session:
        return self._sessions()

    def record(
        self,
        run_id: str,
        tenant: str,
        step: int,
        *,
        trained_tokens: int,
        step_s: float | None,
        metrics: dict[str, float],
        at: datetime | None = None,
    ) -> None:
        """Add one step's point and drop the run's points older than the last `keep` steps."""
        with self._db() as db, db.begin():
            db.add(
                RunMetricRow(
                    run_id=run_id,
                    tenant=tenant,
                    step=step,
                    at=at or utcnow(),
                    trained_tokens=trained_tokens,
                    step_s=step_s,
                    metrics=_finite(metrics),
                )
            )
            db.flush()
            count = db.scalar(
                select(func.count()).select_from(RunMetricRow).where(RunMetricRow.run_id == run_id)
            )
            if count is not None and count > self.keep:
                oldest = select(RunMetricRow.id).where(RunMetricRow.run_id == run_id)
                cut = list(db.scalars(oldest.order_by(RunMetricRow.id).limit(count - self.keep)))
                db.execute(delete(RunMetricRow).where(RunMetricRow.id.in_(cut)))

    def points(self, run_id: str, tenant: str, after_id: int = 0) -> list[tuple[int, StepPoint]]:
        """The run's points (only if the run is `tenant`'s), oldest first, with their row ids;
        `after_id` returns only those added since (the console's live polling)."""
        query = (
            select(RunMetricRow)
            .where(
                RunMetricRow.run_id == run_id,
                RunMetricRow.tenant == tenant,
                RunMetricRow.id > after_id,
            )
            .order_by(RunMetricRow.id)
        )
        with self._db() as db:
            rows = list(db.scalars(query))
        return [
            (r.id, StepPoint(r.step, r.at, r.trained_tokens, r.step_s, dict(r.metrics or {})))
            for r in rows
        ]

    def last_step(self, run_id: str) -> int | None:
        with self._db() as db:
            value = db.scalar(
                select(func.max(RunMetricRow.step)).where(RunMetricRow.run_id == run_id)
            )
        return int(value) if value is not None else None
