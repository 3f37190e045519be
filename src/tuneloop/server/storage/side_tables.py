"""Tables kept beside the registry's own (projects, publications, audit, clone counters): each
store creates its tables on first use, on the registry's database, so the registry module need
not know them."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from tuneloop.server.storage.base import Base

__all__ = ["SideStore"]


class SideStore:
    """A store of `TABLES` (row classes) on a registry's engine."""

    TABLES: tuple[type[Base], ...] = ()

    def __init__(self, engine: Engine) -> None:
        tables: list[Any] = [row.__table__ for row in self.TABLES]
        Base.metadata.create_all(engine, tables=tables)  # checkfirst: a no-op once made
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    def _db(self) -> Session:
        return self._sessions()
