"""An in-process server (fake backend) over httpx.ASGITransport, one client per tenant.

Every test that uses the server runs twice: on a SQLite registry and on PostgreSQL (tests/db.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.db import db_url
from tests.unit.server.harness import Api
from tuneloop.server.app import create_app
from tuneloop.server.config import ServerConfig
from tuneloop.server.storage.keys import KeyStore

__all__ = ["api", "db_url", "other_tenant", "server"]


@pytest.fixture
async def server(tmp_path: Path, db_url: str) -> AsyncIterator[tuple[Any, KeyStore]]:
    config = ServerConfig(data_dir=tmp_path, db_url=db_url, long_poll_s=1.0, backend="fake")
    app = create_app(config)
    async with app.router.lifespan_context(app):
        yield app, KeyStore(tmp_path / "keys.json")


@contextlib.asynccontextmanager
async def _tenant(server: tuple[Any, KeyStore], name: str) -> AsyncIterator[Api]:
    """A client holding a fresh key of tenant `name`."""
    app, keys = server
    key, _ = keys.create(name)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tuneloop") as http:
        yield Api(http, key, keys)


@pytest.fixture
async def api(server: tuple[Any, KeyStore]) -> AsyncIterator[Api]:
    async with _tenant(server, "alice") as client:
        yield client


@pytest.fixture
async def other_tenant(server: tuple[Any, KeyStore]) -> AsyncIterator[Api]:
    async with _tenant(server, "bob") as client:
        yield client
