"""Projects: named groups of a tenant's sessions and training runs (each tenant has its own
project names). A session belongs to the project it was created in or later assigned to; a
training run to its session's project, unless assigned one of its own (the copies that
copy_weights makes). Everything else is in the tenant's `default` project.

Also the record of weight copies, so a retried copy_weights (same idempotency key) answers the
first copy instead of making a second.
"""

from __future__ import annotations

import re
import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import String, and_, func, select
from sqlalchemy.orm import Mapped, aliased, mapped_column

from tuneloop.server.storage.base import Base, UTCDateTime, utcnow
from tuneloop.server.storage.registry import CheckpointRow, SessionRow, TrainingRunRow
from tuneloop.server.storage.side_tables import SideStore
from tuneloop.server.storage.upsert import insert_missing

__all__ = [
    "DEFAULT_PROJECT",
    "ProjectAssignmentRow",
    "Projects",
    "WeightCopyRow",
    "valid_project_id",
]

DEFAULT_PROJECT = "default"
_PROJECT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def valid_project_id(project_id: str) -> bool:
    return bool(_PROJECT_ID.match(project_id))


class ProjectAssignmentRow(Base):
    __tablename__ = "project_assignments"
    # A session id or a training run id (run ids are `<session id>:train:<n>`: never equal).
    object_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # "session" or "run"
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    project_id: Mapped[str] = mapped_column(String(64), index=True)
    assigned_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class WeightCopyRow(Base):
    __tablename__ = "weight_copies"
    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    idempotency_key: Mapped[str] = mapped_column(String(128), primary_key=True)
    source_path: Mapped[str] = mapped_column(String(512))
    # A random token of the request that created the row: tells it from later retries.
    claim: Mapped[str] = mapped_column(String(32), default="")
    # Empty while the copy is being made; the copy's tinker path once made.
    tinker_path: Mapped[str] = mapped_column(String(512), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Projects(SideStore):
    TABLES = (ProjectAssignmentRow, WeightCopyRow)

    def assign(self, tenant: str, kind: str, object_id: str, project_id: str) -> None:
        with self._db() as db, db.begin():
            db.merge(
                ProjectAssignmentRow(
                    object_id=object_id,
                    kind=kind,
                    tenant=tenant,
                    project_id=project_id,
                    assigned_at=utcnow(),
                )
            )

    def _assigned(self, object_id: str) -> str | None:
        with self._db() as db:
            row = db.get(ProjectAssignmentRow, object_id)
        return row.project_id if row is not None else None

    def of_session(self, session_id: str) -> str:
        return self._assigned(session_id) or DEFAULT_PROJECT

    def of_run(self, run: TrainingRunRow) -> str:
        return self._assigned(run.id) or self.of_session(run.session_id)

    def projects_of_sessions(self, session_ids: list[str]) -> dict[str, str]:
        with self._db() as db:
            rows = db.scalars(
                select(ProjectAssignmentRow).where(ProjectAssignmentRow.object_id.in_(session_ids))
            )
            found = {r.object_id: r.project_id for r in rows}
        return {s: found.get(s, DEFAULT_PROJECT) for s in session_ids}

    def _run_project(self) -> tuple[Any, Any]:
        """A select of training runs joined to their effective project (a column)."""
        own = aliased(ProjectAssignmentRow)
        session = aliased(ProjectAssignmentRow)
        project = func.coalesce(own.project_id, session.project_id, DEFAULT_PROJECT)
        joined = (
            select(TrainingRunRow)
            .outerjoin(own, own.object_id == TrainingRunRow.id)
            .outerjoin(session, session.object_id == TrainingRunRow.session_id)
        )
        return joined, project

    def runs_in(
        self, tenant: str, project_id: str, limit: int, offset: int
    ) -> tuple[list[TrainingRunRow], int]:
        joined, project = self._run_project()
        where = and_(TrainingRunRow.tenant == tenant, project == project_id)
        with self._db() as db:
            total = db.scalar(select(func.count()).select_from(joined.where(where).subquery()))
            rows = list(
                db.scalars(
                    joined.where(where)
                    .order_by(TrainingRunRow.created_at.desc())
                    .limit(limit)
                    .offset(offset)
                )
            )
        return rows, int(total or 0)

    def checkpoint_storage(self, tenant: str, project_id: str | None) -> dict[str, tuple[int, int]]:
        """project -> (checkpoint count, bytes) of the tenant's checkpoints, or one project's."""
        own = aliased(ProjectAssignmentRow)
        session = aliased(ProjectAssignmentRow)
        project = func.coalesce(own.project_id, session.project_id, DEFAULT_PROJECT)
        query = (
            select(project, func.count(), func.coalesce(func.sum(CheckpointRow.size_bytes), 0))
            .select_from(CheckpointRow)
            .join(TrainingRunRow, TrainingRunRow.id == CheckpointRow.training_run_id)
            .outerjoin(own, own.object_id == TrainingRunRow.id)
            .outerjoin(session, session.object_id == TrainingRunRow.session_id)
            .where(CheckpointRow.tenant == tenant)
            .group_by(project)
        )
        if project_id is not None:
            query = query.where(project == project_id)
        with self._db() as db:
            return {str(p): (int(n), int(b)) for p, n, b in db.execute(query).all()}

    def sessions(self, tenant: str, project_ids: list[str] | None) -> list[tuple[SessionRow, str]]:
        """The tenant's sessions with their projects (all, or those in `project_ids`), newest
        first."""
        assigned = aliased(ProjectAssignmentRow)
        project = func.coalesce(assigned.project_id, DEFAULT_PROJECT)
        query = (
            select(SessionRow, project)
            .outerjoin(assigned, assigned.object_id == SessionRow.id)
            .where(SessionRow.tenant == tenant)
            .order_by(SessionRow.created_at.desc(), SessionRow.id.desc())
        )
        if project_ids is not None:
            query = query.where(project.in_(project_ids))
        with self._db() as db:
            return [(row, str(p)) for row, p in db.execute(query).all()]

    # ---- copies -----------------------------------------------------------------------------

    def claim_copy(self, tenant: str, key: str, source_path: str) -> tuple[WeightCopyRow, bool]:
        """The copy record of (tenant, key), and whether this call created it (then make the
        copy); an earlier record has the copy's path, or an empty one while it is being made."""
        token = secrets.token_hex(16)
        with self._db() as db, db.begin():
            insert_missing(
                db,
                WeightCopyRow,
                tenant=tenant,
                idempotency_key=key,
                source_path=source_path,
                claim=token,
            )
            row = db.get(WeightCopyRow, (tenant, key))
            assert row is not None
            return row, row.claim == token

    def finish_copy(self, tenant: str, key: str, tinker_path: str) -> None:
        with self._db() as db, db.begin():
            row = db.get(WeightCopyRow, (tenant, key))
            if row is not None:
                row.tinker_path = tinker_path

    def drop_copy(self, tenant: str, key: str) -> None:
        """A copy that failed: a retry with the same key may try again."""
        with self._db() as db, db.begin():
            row = db.get(WeightCopyRow, (tenant, key))
            if row is not None and not row.tinker_path:
                db.delete(row)

    def checkpoints_by_session(
        self, tenant: str, session_ids: list[str]
    ) -> dict[str, tuple[int, int]]:
        """session -> (checkpoint count, bytes) of the checkpoints its training runs saved."""
        if not session_ids:
            return {}
        query = (
            select(
                TrainingRunRow.session_id,
                func.count(),
                func.coalesce(func.sum(CheckpointRow.size_bytes), 0),
            )
            .select_from(CheckpointRow)
            .join(TrainingRunRow, TrainingRunRow.id == CheckpointRow.training_run_id)
            .where(CheckpointRow.tenant == tenant, TrainingRunRow.session_id.in_(session_ids))
            .group_by(TrainingRunRow.session_id)
        )
        with self._db() as db:
            return {str(s): (int(n), int(b)) for s, n, b in db.execute(query).all()}
