"""HTTP transport: headers, retries with backoff, and the mapping of error statuses to exceptions.

Every coroutine here runs on the SDK's background event loop (see `_futures.ClientHolder`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shlex
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from tuneloop.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    status_error,
)

__all__ = [
    "VERSION",
    "HttpTransport",
    "env_api_key",
    "env_base_url",
    "env_cache_dir",
    "env_home",
    "env_serve_args",
    "error_from_response",
    "retry_delay",
]

VERSION = "0.1.0"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"

logger = logging.getLogger("tuneloop")

# 408 (server-side timeout), 409 (lock contention), 429 (rate limit) and 5xx are transient.
RETRYABLE_STATUSES = frozenset({408, 409, 429})
# Backoff 0.5 s * 2^n, capped at 10 s, jittered by +-25 %, so a fleet does not retry in step.
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 10.0
# A server's retry-after is honoured only when sane; anything longer falls back to our backoff.
RETRY_AFTER_MAX_S = 60.0
# A submission keeps retrying transient failures for this long before giving up.
DEFAULT_RETRY_BUDGET_S = 300.0
DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0, pool=None)


def is_retryable_status(status_code: int) -> bool:
    return status_code in RETRYABLE_STATUSES or status_code >= 500


def retry_after_s(response: httpx.Response | None) -> float | None:
    """The server's requested wait, from retry-after-ms or retry-after (seconds), if 0 < v <= 60."""
    if response is None:
        return None
    for header, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        raw = response.headers.get(header)
        if raw is None:
            continue
        try:
            value = float(raw) * scale
        except ValueError:
            continue  # an HTTP date; rare enough to use our own backoff instead
        if 0 < value <= RETRY_AFTER_MAX_S:
            return value
    return None


def retry_delay(attempt: int, response: httpx.Response | None = None) -> float:
    """Seconds to wait before retry number `attempt` (0-based)."""
    requested = retry_after_s(response)
    if requested is not None:
        return requested
    delay = min(BACKOFF_BASE_S * 2**attempt, BACKOFF_CAP_S)
    return delay * random.uniform(0.75, 1.0)


def _decode_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text


def error_from_response(response: httpx.Response) -> APIStatusError:
    """Map an error response to its exception, surfacing the server's `detail` and `field`."""
    body = _decode_body(response)
    request = response.request
    where = f"{request.method} {request.url.path}"
    detail: Any = None
    field = None
    if isinstance(body, dict):
        detail = body.get("detail") or body.get("error") or body.get("message")
        field = body.get("field")
    elif isinstance(body, str) and body.strip():
        detail = body.strip()[:500]
    if detail is None:
        detail = response.reason_phrase or "error"
    elif not isinstance(detail, str):
        detail = json.dumps(detail)  # e.g. a list of validation errors
    message = f"{response.status_code} from {where}: {detail}"
    if field:
        message += f" (field: {field})"
    return status_error(message, response.status_code, body)


class HttpTransport:
    """An `httpx.AsyncClient` with the SDK's headers, retries and error mapping.

    `transport` lets tests inject an `httpx.MockTransport`; production uses httpx's default.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        connections: int = 64,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        headers = {
            "Accept": JSON,
            "User-Agent": f"tuneloop/{VERSION}",
        }
        if api_key:
            headers["X-API-Key"] = api_key
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=DEFAULT_TIMEOUT,
            transport=transport,
            limits=limits,
            follow_redirects=False,
        )
        # Requests wait here rather than in httpcore's pool, whose bookkeeping is quadratic in
        # the number of queued requests (1,000 queued futures cost ~20 ms of CPU each).
        self._slots = asyncio.Semaphore(connections)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def send_once(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        content: bytes | None = None,
        content_type: str = JSON,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> httpx.Response:
        """One attempt; transport failures become APIConnectionError / APITimeoutError."""
        all_headers: dict[str, str] = dict(headers or {})
        body: bytes | None = content
        if json_body is not None:
            body = json.dumps(json_body, separators=(",", ":")).encode()
        if body is not None:
            all_headers["Content-Type"] = content_type
        if method != "GET":
            all_headers["X-Idempotency-Key"] = idempotency_key or f"tuneloop-{uuid.uuid4()}"
        request_timeout: httpx.Timeout | None = None
        if timeout_s is not None:
            # Waiting for a free pooled connection is not a server failure: no pool timeout.
            request_timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0), pool=None)
        try:
            async with self._slots:
                return await self._client.request(
                    method,
                    path,
                    content=body,
                    params=params,
                    headers=all_headers,
                    timeout=request_timeout if request_timeout is not None else DEFAULT_TIMEOUT,
                )
        except httpx.TimeoutException as exc:
            raise APITimeoutError(f"{method} {path} timed out: {exc!r}") from exc
        except httpx.TransportError as exc:
            raise APIConnectionError(
                f"{method} {path} failed to reach {self.base_url}: {exc!r}"
            ) from exc

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        content: bytes | None = None,
        content_type: str = JSON,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        retry_budget_s: float = DEFAULT_RETRY_BUDGET_S,
    ) -> httpx.Response:
        """Send with retries on connection errors, 408, 409, 429 and 5xx; raise on other errors.

        All attempts share one X-Idempotency-Key. `retry_budget_s=0` means a single attempt.
        """
        idempotency_key = f"tuneloop-{uuid.uuid4()}"
        started = time.monotonic()
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                response = await self.send_once(
                    method,
                    path,
                    json_body=json_body,
                    content=content,
                    content_type=content_type,
                    params=params,
                    headers=headers,
                    timeout_s=timeout_s,
                    idempotency_key=idempotency_key,
                )
            except APIConnectionError as exc:
                error: Exception = exc
            else:
                if response.status_code < 400:
                    return response
                error = error_from_response(response)
                should_retry = response.headers.get("x-should-retry")
                retryable = is_retryable_status(response.status_code)
                if should_retry is not None:
                    retryable = should_retry.lower() == "true"
                if not retryable:
                    raise error
            delay = retry_delay(attempt, response)
            if time.monotonic() - started + delay > retry_budget_s:
                raise error
            logger.info("%s %s: %s; retrying in %.2f s", method, path, error, delay)
            await asyncio.sleep(delay)
            attempt += 1


# ---- environment (the only place the SDK reads it) -------------------------------------------


def env_base_url() -> str | None:
    return os.environ.get("TUNELOOP_BASE_URL") or None


def env_api_key() -> str | None:
    return os.environ.get("TUNELOOP_API_KEY") or None


def env_home() -> Path:
    """Where a locally started server keeps its data: $TUNELOOP_HOME, else ~/.tuneloop."""
    override = os.environ.get("TUNELOOP_HOME")
    return Path(override).expanduser() if override else Path.home() / ".tuneloop"


def env_serve_args() -> list[str]:
    """Extra `tuneloop serve` arguments for a locally started server ($TUNELOOP_SERVE_ARGS)."""
    return shlex.split(os.environ.get("TUNELOOP_SERVE_ARGS", ""))


def env_cache_dir() -> Path:
    """The SDK's cache root: $TUNELOOP_CACHE_DIR, else ~/.cache/tuneloop."""
    override = os.environ.get("TUNELOOP_CACHE_DIR")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "tuneloop"
