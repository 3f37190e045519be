"""Create a row unless it exists, safely with other writers at the same moment.

"UPDATE, and INSERT when nothing was updated" loses a race on PostgreSQL: two servers sharing one
database both see no row, both insert, and one fails on the primary key. Creating the row first
with INSERT ... ON CONFLICT DO NOTHING (SQLite and PostgreSQL both have it) and then updating it
in place serialises the writers on the row instead.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session


def insert_missing(db: Session, model: type[Any], **key: Any) -> None:
    """Insert a `model` row with `key` (other columns at their defaults) if none has that key."""
    table = model.__table__
    dialect = db.get_bind().dialect.name
    if dialect == "postgresql":
        db.execute(postgresql.insert(table).values(**key).on_conflict_do_nothing())
    elif dialect == "sqlite":
        db.execute(sqlite.insert(table).values(**key).on_conflict_do_nothing())
    else:
        raise NotImplementedError(f"the registry supports SQLite and PostgreSQL, not {dialect}")
