"""Clone counters of sampling sessions: join_sampling_session hands each unpickled copy of a
sampling client a number no other client of that session has (the original is 0)."""

from __future__ import annotations

from sqlalchemy import BigInteger, String, select, update
from sqlalchemy.orm import Mapped, mapped_column

from tuneloop.server.storage.base import Base
from tuneloop.server.storage.side_tables import SideStore
from tuneloop.server.storage.upsert import insert_missing

__all__ = ["CloneCounterRow", "CloneCounters"]


class CloneCounterRow(Base):
    __tablename__ = "sampler_clone_counters"
    sampler_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    last_counter: Mapped[int] = mapped_column(BigInteger, default=0)


class CloneCounters(SideStore):
    TABLES = (CloneCounterRow,)

    def next(self, sampler_id: str) -> int:
        """1, 2, 3, ... per sampler; an in-place increment, so concurrent joins never share one
        (and a restarted server continues the count)."""
        with self._db() as db, db.begin():
            insert_missing(db, CloneCounterRow, sampler_id=sampler_id)
            key = CloneCounterRow.sampler_id == sampler_id
            db.execute(
                update(CloneCounterRow)
                .where(key)
                .values(last_counter=CloneCounterRow.last_counter + 1)
            )
            value = db.scalar(select(CloneCounterRow.last_counter).where(key))
        return int(value or 0)
