"""Read side of metering for billing views: the hourly usage rows of a tenant in a window, and
the checkpoints it saved in one (each row read as is, not summed as usage_store does)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select

from tuneloop.server.storage.registry import CheckpointRow, SamplerRow, TrainingRunRow
from tuneloop.server.storage.side_tables import SideStore
from tuneloop.server.storage.usage_store import UsageRow

__all__ = ["BillingReader"]


class BillingReader(SideStore):
    def usage_rows(self, tenant: str, since_hour: int, until_hour: int) -> list[UsageRow]:
        query = (
            select(UsageRow)
            .where(UsageRow.tenant == tenant, UsageRow.hour >= since_hour)
            .where(UsageRow.hour < until_hour)
            .order_by(UsageRow.hour, UsageRow.session_id, UsageRow.model_id, UsageRow.operation)
        )
        with self._db() as db:
            return list(db.scalars(query))

    def checkpoints_saved(
        self, tenant: str, since: datetime, until: datetime
    ) -> list[tuple[CheckpointRow, str]]:
        """The tenant's checkpoints (still registered) created in [since, until), each with the
        session of the run that saved it."""
        query = (
            select(CheckpointRow, TrainingRunRow.session_id)
            .join(TrainingRunRow, TrainingRunRow.id == CheckpointRow.training_run_id)
            .where(CheckpointRow.tenant == tenant, CheckpointRow.created_at >= since)
            .where(CheckpointRow.created_at < until)
        )
        with self._db() as db:
            return [(row, str(session)) for row, session in db.execute(query).all()]

    def base_models(self, model_ids: set[str]) -> dict[str, str]:
        """Training run or sampler id -> its base model."""
        if not model_ids:
            return {}
        ids = list(model_ids)
        with self._db() as db:
            runs = db.execute(
                select(TrainingRunRow.id, TrainingRunRow.base_model).where(
                    TrainingRunRow.id.in_(ids)
                )
            ).all()
            samplers = db.execute(
                select(SamplerRow.id, SamplerRow.base_model).where(SamplerRow.id.in_(ids))
            ).all()
        return {str(i): str(m) for i, m in [*runs, *samplers]}
