"""`tuneloop serve --log-format json --metrics-token T`, a real server process: its stderr is JSON
lines (one access line per request, the key never among them) and /metrics wants the token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tuneloop._local_server import create_key, stop

pytestmark = pytest.mark.integration

TOKEN = "scrape-token-for-the-test"


def test_json_logs_and_the_scrape_token(tmp_path: Path) -> None:
    key = create_key(tmp_path, "alice")
    stderr = (tmp_path / "stderr.log").open("w")
    command = [sys.executable, "-m", "tuneloop", "serve", "--backend", "fake", "--port", "0"]
    command += ["--data-dir", str(tmp_path), "--log-format", "json", "--parent-pid"]
    command += [str(os.getpid())]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TUNELOOP_METRICS_TOKEN": TOKEN},
    )
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and not line.startswith("tuneloop serving at "):
            line = process.stdout.readline()
            assert line or process.poll() is None, "the server exited"
        url = line.split(" at ", 1)[1].strip()
        with httpx.Client(base_url=url, timeout=30) as http:
            created = http.post(
                "/api/v1/create_session",
                json={"tags": [], "sdk_version": "test"},
                headers={"x-api-key": key, "cookie": "session=not-for-logs-123"},
            )
            assert created.status_code == 200, created.text
            assert http.get("/metrics").status_code == 401
            scraped = http.get("/metrics", headers={"authorization": f"Bearer {TOKEN}"})
            assert scraped.status_code == 200
            names = {f.name for f in text_string_to_metric_families(scraped.text)}
            assert {"tuneloop_http_requests", "tuneloop_engine_busy_seconds"} <= names
    finally:
        assert stop(process) == 0
        stderr.close()
    written = (tmp_path / "stderr.log").read_text()
    records = [json.loads(line) for line in written.splitlines() if line.strip()]
    access = [r for r in records if r["logger"] == "tuneloop.access"]
    routes = [(r["route"], r["status"], r["tenant"]) for r in access]
    assert ("/api/v1/create_session", 200, "alice") in routes
    assert ("/metrics", 401, None) in routes
    assert all(r["request_id"] and r["latency_s"] >= 0 for r in access)
    for secret in (key, "not-for-logs-123", TOKEN):
        assert secret not in written
