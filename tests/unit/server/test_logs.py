"""Structured logs: one JSON access line per request with --log-format json (request id, tenant,
route template, status, latency), none by default, and never an API key or a cookie."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.server.harness import serve
from tuneloop.server.api.access_log import (
    ACCESS_LOGGER,
    configure_logging,
    json_formatter,
)

COOKIE = "console_session=cookie-value-not-for-logs-42"


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """What the tuneloop loggers write, formatted as `serve --log-format json` formats it."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(json_formatter())
    logger = logging.getLogger("tuneloop")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield out
    logger.removeHandler(handler)
    logger.setLevel(level)


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


async def test_json_access_lines(tmp_path: Path, captured: io.StringIO) -> None:
    async with serve(tmp_path, log_format="json") as api:
        created = await api.http.post(
            "/api/v1/create_session",
            json={"tags": [], "sdk_version": "test"},
            headers={**api.headers(), "cookie": COOKIE},
        )
        session = created.json()["session_id"]
        missing = await api.get("training_runs/no-such-run?secret=query-value-99")
        given = await api.http.get(
            "/api/v1/healthz", headers={"x-request-id": "caller-id.7", "cookie": COOKIE}
        )
    access = [r for r in lines(captured) if r["logger"] == ACCESS_LOGGER]
    by_id = {r["request_id"]: r for r in access}
    first = by_id[created.headers["x-request-id"]]
    assert first["method"] == "POST"
    assert first["route"] == "/api/v1/create_session"
    assert first["status"] == 200
    assert first["tenant"] == "alice"
    assert isinstance(first["latency_s"], float)
    assert first["latency_s"] > 0
    assert first["level"] == "INFO"
    assert "time" in first
    second = by_id[missing.headers["x-request-id"]]
    assert second["route"] == "/api/v1/training_runs/{run_id}"
    assert second["path"] == "/api/v1/training_runs/no-such-run"  # no query string
    assert second["status"] == 404
    third = by_id["caller-id.7"]  # a caller's own request id is kept
    assert given.headers["x-request-id"] == "caller-id.7"
    assert third["tenant"] is None  # no key sent
    text = captured.getvalue()
    assert session  # ids may be logged; secrets never:
    for secret in (api.key, "cookie-value-not-for-logs-42", "query-value-99"):
        assert secret not in text


async def test_no_access_lines_by_default(tmp_path: Path, captured: io.StringIO) -> None:
    async with serve(tmp_path) as api:
        response = await api.session()
        assert response
    assert not [r for r in lines(captured) if r["logger"] == ACCESS_LOGGER]


async def test_a_request_id_that_is_not_one_is_replaced(
    tmp_path: Path, captured: io.StringIO
) -> None:
    async with serve(tmp_path, log_format="json") as api:
        response = await api.http.get(
            "/api/v1/healthz", headers={"x-request-id": 'evil" id\twith spaces' + "x" * 80}
        )
    rid = response.headers["x-request-id"]
    assert " " not in rid
    assert [r["request_id"] for r in lines(captured) if r["logger"] == ACCESS_LOGGER] == [rid]


def test_a_key_quoted_in_any_message_is_masked(captured: io.StringIO) -> None:
    key = "tml-" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8S9t0u1v"
    log = logging.getLogger("tuneloop.server.test")
    log.warning("refused key %s", key)
    log.warning("refused", extra={"api_key": key})
    try:
        raise ValueError(f"bad {key}")
    except ValueError:
        log.exception("failed")
    text = captured.getvalue()
    assert key not in text
    assert text.count("tml-<redacted>") == 3  # the message, the field, the exception
    assert [r["message"] for r in lines(captured)][:2] == ["refused key tml-<redacted>", "refused"]


def test_configure_logging_rejects_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="text, json"):
        configure_logging("xml")


def test_the_log_format_and_scrape_token_come_from_flags_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tuneloop.server.config import ServerConfig

    assert ServerConfig.from_env(data_dir=tmp_path).log_format == "text"
    assert ServerConfig.from_env(data_dir=tmp_path).metrics_token is None
    monkeypatch.setenv("TUNELOOP_LOG_FORMAT", "json")
    monkeypatch.setenv("TUNELOOP_METRICS_TOKEN", "from-env")
    config = ServerConfig.from_env(data_dir=tmp_path)
    assert (config.log_format, config.metrics_token) == ("json", "from-env")
    flags = ServerConfig.from_env(data_dir=tmp_path, log_format="text", metrics_token="flag")
    assert (flags.log_format, flags.metrics_token) == ("text", "flag")
    monkeypatch.setenv("TUNELOOP_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="log_format must be text or json"):
        ServerConfig.from_env(data_dir=tmp_path)
