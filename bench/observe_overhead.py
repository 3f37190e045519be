"""What the request observer (metrics, and the JSON access line) costs per request.

The same in-process app (fake backend) is called straight through ASGI, no sockets, so the
middleware's share is not hidden under network time, three ways in one run:
  1. without the observer (the obvious alternative: no metrics);
  2. as built: request counter and latency histogram by route template;
  3. with --log-format json: also one access line, formatted to JSON (into a discarded stream).
Routes: GET /api/v1/healthz (no key, the cheapest) and GET /api/v1/get_server_capabilities (an
authenticated one; the tenant is then logged). Requests that write the registry are left out:
SQLite's commit times vary far more than what is measured here.
Prints the microseconds per request (median of several rounds) and the ratios to 1.

    python bench/observe_overhead.py [--requests 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tuneloop.server.api.access_log import json_formatter
from tuneloop.server.api.observe import RequestObserver
from tuneloop.server.app import create_app
from tuneloop.server.config import ServerConfig
from tuneloop.server.storage.keys import KeyStore


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


async def call(app: Any, method: str, path: str, body: bytes, headers: list[Any]) -> int:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("t", 80),
    }  # fmt: skip
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


VARIANTS = ("none", "metrics", "json")
ROUTES = {
    "healthz": ("GET", "/api/v1/healthz", b""),
    "get_server_capabilities": ("GET", "/api/v1/get_server_capabilities", b""),
}


async def measure(route: str, requests: int, rounds: int) -> dict[str, float]:
    """Microseconds per request of each variant: the median of `rounds` rounds, the variants
    taking turns (in a rotating order) so that a noisy neighbour slows them alike."""
    method, path, body = ROUTES[route]
    per_request: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as folder:
        async with contextlib.AsyncExitStack() as stack:
            apps = {}
            for variant in VARIANTS:
                data = Path(folder) / variant
                config = ServerConfig(
                    data_dir=data,
                    backend="fake",
                    log_format="json" if variant == "json" else "text",
                )
                app = create_app(config)
                if variant == "none":
                    app.user_middleware = [
                        m for m in app.user_middleware if m.cls is not RequestObserver
                    ]
                await stack.enter_async_context(app.router.lifespan_context(app))
                key, _ = KeyStore(data / "keys.json").create("alice")
                headers = [(b"x-api-key", key.encode()), (b"content-type", b"application/json")]
                apps[variant] = (app, headers)
            order = list(VARIANTS)
            for _ in range(rounds):
                order = order[1:] + order[:1]  # each variant first in turn: no order effect
                for variant in order:
                    app, headers = apps[variant]
                    started = time.perf_counter()
                    for _ in range(requests):
                        assert await call(app, method, path, body, headers) == 200
                    per_request[variant].append((time.perf_counter() - started) / requests * 1e6)
    return {v: statistics.median(times) for v, times in per_request.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    # The JSON variant's access lines are formatted as `serve --log-format json` formats them,
    # into a stream nobody reads (the cost of writing to a terminal is not the server's).
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(json_formatter())
    logging.getLogger("tuneloop").addHandler(handler)
    logging.getLogger("tuneloop").setLevel(logging.INFO)
    results: dict[str, dict[str, float]] = {}
    for route, requests in (("healthz", args.requests), ("get_server_capabilities", args.requests)):
        results[route] = asyncio.run(measure(route, requests, args.rounds))
        handler.stream = io.StringIO()  # drop what was written
    print(f"CPU: {cpu_model()}")
    for route, r in results.items():
        print(
            f"{route:24s} no observer {r['none']:7.1f} us | metrics {r['metrics']:7.1f} us "
            f"({r['metrics'] / r['none']:.3f}x) | metrics + JSON access line {r['json']:7.1f} us "
            f"({r['json'] / r['none']:.3f}x)"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
