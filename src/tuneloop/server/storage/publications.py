"""Published checkpoints: readable by every tenant of the server by their tinker path (to sample
from, or to start a training run from), while only the owner may change or delete them."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import String, select
from sqlalchemy.orm import Mapped, mapped_column

from tuneloop.server.storage.base import Base, UTCDateTime, utcnow
from tuneloop.server.storage.registry import CheckpointRow
from tuneloop.server.storage.side_tables import SideStore

__all__ = ["PublicationRow", "Publications"]


class PublicationRow(Base):
    __tablename__ = "published_checkpoints"
    tinker_path: Mapped[str] = mapped_column(String(512), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    published_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Publications(SideStore):
    TABLES = (PublicationRow,)

    def publish(self, row: CheckpointRow) -> bool:
        """Publish the owner's checkpoint; False if it already is."""
        if self.is_public(row):
            return False
        with self._db() as db, db.begin():
            db.merge(PublicationRow(tinker_path=row.tinker_path, tenant=row.tenant))
        return True

    def unpublish(self, row: CheckpointRow) -> bool:
        """False if it was not published."""
        public = self.is_public(row)
        with self._db() as db, db.begin():
            found = db.get(PublicationRow, row.tinker_path)
            if found is not None:
                db.delete(found)
        return public

    def is_public(self, row: CheckpointRow) -> bool:
        """Published, and since the files at its path were written: a checkpoint deleted and
        saved again at the same path (or overwritten) is private until published again."""
        with self._db() as db:
            found = db.get(PublicationRow, row.tinker_path)
        return (
            found is not None
            and found.tenant == row.tenant
            and found.published_at >= row.created_at
        )

    def public_paths(self, rows: list[CheckpointRow]) -> set[str]:
        if not rows:
            return set()
        paths = [r.tinker_path for r in rows]
        with self._db() as db:
            found = {
                p.tinker_path: p
                for p in db.scalars(
                    select(PublicationRow).where(PublicationRow.tinker_path.in_(paths))
                )
            }
        return {
            r.tinker_path
            for r in rows
            if r.tinker_path in found
            and found[r.tinker_path].tenant == r.tenant
            and found[r.tinker_path].published_at >= r.created_at
        }
