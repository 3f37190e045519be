"""The audit log: security-relevant events of each tenant (key use, token issue, deletes,
publications, cross-tenant reads, copies, project changes, quota refusals), kept in the registry's
database and read back by `GET /api/v1/audit`."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Integer, String, select
from sqlalchemy.orm import Mapped, mapped_column

from tuneloop.server.storage.base import Base, UTCDateTime, utcnow
from tuneloop.server.storage.side_tables import SideStore

__all__ = ["EVENT_GROUPS", "AuditEventRow", "AuditLog"]

# `event_type` of the official SDK's get_audit_log -> the event-name prefixes it selects.
# Keys, tokens and quotas belong to the tenant (the SDK's "organization"); there are no teams.
EVENT_GROUPS: dict[str, tuple[str, ...]] = {
    "all": ("",),
    "checkpoints": ("checkpoint_",),
    "projects": ("project_",),
    "teams": ("team_",),
    "organizations": ("key_", "quota_"),
}


class AuditEventRow(Base):
    __tablename__ = "audit_events"
    # BigInteger on PostgreSQL, INTEGER on SQLite (where only that spelling auto-increments).
    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    # `<resource>_<action>`, as the official SDK's AuditLogEntry.event.
    event: Mapped[str] = mapped_column(String(64))
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class AuditLog(SideStore):
    TABLES = (AuditEventRow,)

    # A repeated event (the same key used, the same quota hit) is written once per this many
    # seconds: a client retrying a 429 every second must not write a row per retry.
    REPEAT_S = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last: dict[tuple[str, ...], float] = {}

    def record(self, tenant: str, event: str, **details: Any) -> None:
        with self._db() as db, db.begin():
            db.add(AuditEventRow(tenant=tenant, event=event, details=details, at=utcnow()))

    def record_once(
        self,
        key: tuple[str, ...],
        tenant: str,
        event: str,
        *,
        window_s: float | None = None,
        **details: Any,
    ) -> bool:
        """`record`, unless the same `key` was recorded less than `window_s` (default
        REPEAT_S) ago in this process; whether it wrote."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < (window_s or self.REPEAT_S):
            return False
        if len(self._last) > 100_000:  # bounded: forget the oldest half
            for old in sorted(self._last, key=self._last.__getitem__)[:50_000]:
                del self._last[old]
        self._last[key] = now
        self.record(tenant, event, **details)
        return True

    def entries(
        self, tenant: str, since: datetime, until: datetime, group: str = "all"
    ) -> list[AuditEventRow]:
        """The tenant's events in [since, until) whose names start as `group` selects, oldest
        first."""
        prefixes = EVENT_GROUPS[group]
        query = (
            select(AuditEventRow)
            .where(AuditEventRow.tenant == tenant, AuditEventRow.at >= since)
            .where(AuditEventRow.at < until)
            .order_by(AuditEventRow.at, AuditEventRow.id)
        )
        with self._db() as db:
            rows = list(db.scalars(query))
        return [r for r in rows if any(r.event.startswith(p) for p in prefixes)]
