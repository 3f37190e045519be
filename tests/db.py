"""Registry databases for tests: a SQLite file, or a schema of its own on the PostgreSQL server.

Every PostgreSQL test gets a fresh schema `t_<random>` (its connections set `search_path` to it)
that is dropped afterwards, so tests may run in parallel and leave nothing behind.

The server is the one every project machine runs (127.0.0.1:5432, database `test`, user
`postgres`, trust auth); TUNELOOP_TEST_POSTGRES_URL names another. Where it cannot be reached,
the PostgreSQL variants fail under CI (CI=true) and are skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest

POSTGRES_URL = os.environ.get(
    "TUNELOOP_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
DATABASES = ["sqlite", "postgres"]


def _unreachable(reason: str) -> None:
    message = f"PostgreSQL at {POSTGRES_URL} is not reachable: {reason}"
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(message)
    pytest.skip(message)


@contextlib.contextmanager
def postgres_schema() -> Iterator[str]:
    """A fresh schema; yields a URL whose connections use it. Dropped, with its tables, after."""
    schema = f"t_{secrets.token_hex(6)}"
    try:
        admin = psycopg.connect(POSTGRES_URL, connect_timeout=5, autocommit=True)
    except psycopg.OperationalError as exc:
        _unreachable(str(exc).strip())
    with admin:
        admin.execute(f"CREATE SCHEMA {schema}")
    separator = "&" if "?" in POSTGRES_URL else "?"
    try:
        yield f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}"
    finally:
        with psycopg.connect(POSTGRES_URL, connect_timeout=5, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def schema_of(url: str) -> str:
    return url.rsplit("search_path%3D", 1)[1]


@contextlib.contextmanager
def database(kind: str, directory: Path) -> Iterator[str]:
    """A registry URL of `kind` ("sqlite" or "postgres") that lives for the block."""
    if kind == "sqlite":
        yield f"sqlite:///{directory / 'registry.sqlite3'}"
    else:
        with postgres_schema() as url:
            yield url


@pytest.fixture(params=DATABASES)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A registry database URL, once per kind of database."""
    with database(request.param, tmp_path) as url:
        yield url
