"""Per-tenant quotas: live sessions and requests in flight. Past one, a 429 the SDKs retry.

The 429 carries `retry-after` (whole seconds, for any client), `retry-after-ms` (which both
SDKs read first) and `x-should-retry: true`; its body names the limit and its value. A refused
request changes nothing on the server: no future, no session, and no seq_id consumed, since the
SDKs retry it with the same seq_id.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from tuneloop.server.api.errors import ApiError
from tuneloop.server.config import ServerConfig
from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.storage.limits import LimitStore
from tuneloop.server.storage.registry import Registry, utcnow

# Bounds of the advertised wait. At least 1 s: the official SDK retries some calls (model and
# session creation) only 10 times at the HTTP layer, so a shorter wait would exhaust them within
# a few seconds at the limit; and thousands of refused requests must not poll in a tight loop.
# At most 30 s, well inside the 60 s above which both SDKs ignore the header.
MIN_RETRY_S = 1.0
MAX_RETRY_S = 30.0
# A session frees when its owner finishes it, which the server cannot foresee: ask again this
# often (sooner if the least recently active session would expire before).
SESSION_RETRY_S = 5.0
# Before any request of the tenant has completed there is no measured latency to go on.
FIRST_RETRY_S = 1.0


@dataclass(frozen=True)
class Limits:
    """A tenant's effective limits (0: unlimited)."""

    max_sessions: int
    max_inflight: int


def quota_exceeded(limit: str, value: int, detail: str, retry_after_s: float) -> ApiError:
    wait = min(max(retry_after_s, MIN_RETRY_S), MAX_RETRY_S)
    headers = {
        "retry-after": str(math.ceil(wait)),
        "retry-after-ms": str(round(wait * 1000)),
        "x-should-retry": "true",
    }
    return ApiError(429, detail, limit, headers=headers, extra={"limit": limit, "value": value})


class Quotas:
    def __init__(
        self, config: ServerConfig, store: LimitStore, registry: Registry, futures: FutureTable
    ) -> None:
        self.config = config
        self.store = store
        self.registry = registry
        self.futures = futures
        # Per tenant: slots held beyond the futures' own count. An OpenAI request has one
        # future per prompt but counts prompts x n (see `hold`).
        self._held: dict[str, int] = {}
        # Told of each refusal as (tenant, limit name, limit): the audit log.
        self.on_refusal: Callable[[str, str, int], None] | None = None

    def _refused(self, tenant: str, name: str, limit: int) -> None:
        if self.on_refusal is not None:
            self.on_refusal(tenant, name, limit)

    def limits(self, tenant: str) -> Limits:
        """The server defaults, overridden by the tenant's entry in the limits file."""
        override = self.store.get(tenant)
        return Limits(
            max_sessions=(
                override.max_sessions
                if override.max_sessions is not None
                else self.config.max_sessions
            ),
            max_inflight=(
                override.max_inflight
                if override.max_inflight is not None
                else self.config.max_inflight
            ),
        )

    def check_sessions(self, tenant: str) -> None:
        """429 if the tenant already has its limit of live (unfinished, unexpired) sessions."""
        limit = self.limits(tenant).max_sessions
        if limit == 0:
            return
        ttl = self.config.session_ttl_s
        now = utcnow()
        live = self.registry.count_live_sessions(
            tenant, now - timedelta(seconds=ttl) if ttl else None
        )
        if live < limit:
            return
        wait = SESSION_RETRY_S
        oldest = self.registry.oldest_live_activity(tenant) if ttl else None
        if oldest is not None:
            wait = min(wait, (oldest + timedelta(seconds=ttl) - now).total_seconds())
        self._refused(tenant, "max_sessions", limit)
        raise quota_exceeded(
            "max_sessions",
            limit,
            f"tenant {tenant!r} has {live} live sessions and may have {limit} (max_sessions):"
            " finish one, or wait for an idle one to expire",
            wait,
        )

    def in_flight(self, tenant: str) -> int:
        """What counts against the tenant's max_inflight now."""
        return self.futures.pending(tenant) + self._held.get(tenant, 0)

    def hold(self, tenant: str, count: int) -> Callable[[], None]:
        """Count `count` more slots as in flight until the returned function is called."""
        if count <= 0:
            return lambda: None
        self._held[tenant] = self._held.get(tenant, 0) + count
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._held[tenant] -= count

        return release

    def check_inflight(self, tenant: str, count: int = 1) -> None:
        """429 if `count` more requests without a result would exceed the tenant's limit.

        An OpenAI request asks for one engine request per prompt and choice (`count`); one
        that could never fit, even with nothing else in flight, is a 400 naming the limit,
        since retrying it would never succeed.
        """
        limit = self.limits(tenant).max_inflight
        if limit == 0:
            return
        if count > limit:
            raise ApiError(
                400,
                f"the request asks for {count} generations (prompts x n) and tenant {tenant!r}"
                f" may have {limit} in flight (max_inflight): split it into smaller requests",
                "max_inflight",
                extra={"limit": "max_inflight", "value": limit},
            )
        pending = self.in_flight(tenant)
        if pending + count <= limit:
            return
        # A slot frees when the next of them completes. By Little's law, `pending` requests
        # that each take `typical` seconds complete one every typical / pending seconds; this
        # request waits for enough of them to make room for its `count`.
        typical = self.futures.typical_latency_s(tenant)
        needed = pending + count - limit
        self._refused(tenant, "max_inflight", limit)
        raise quota_exceeded(
            "max_inflight",
            limit,
            f"tenant {tenant!r} has {pending} requests in flight and may have {limit}"
            f" (max_inflight); this one needs {count}: retry once some have completed",
            typical * needed / max(pending, 1) if typical is not None else FIRST_RETRY_S,
        )
