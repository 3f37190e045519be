"""The future table: results of long operations, long-polled through retrieve_future.

Lives on the server's event loop thread only (asyncio.Event is not thread-safe).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Outcome:
    """A finished operation, already serialized for the wire."""

    body: bytes
    media_type: str  # application/json or application/x-protobuf
    failed: bool = False


@dataclass
class _Entry:
    tenant: str
    kind: str
    created_at: float
    event: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    first_delivered_at: float | None = None


class FutureTable:
    def __init__(self, grace_s: float = 300.0, max_age_s: float = 3600.0) -> None:
        # Results stay `grace_s` after first delivery: the SDK may re-fetch after a transport
        # error and sends no acknowledgement. Undelivered results go after `max_age_s`.
        self._grace_s = grace_s
        self._max_age_s = max_age_s
        self._entries: dict[str, _Entry] = {}
        # Per tenant: unresolved futures (in-flight quota), and a moving average of the seconds
        # from submission to result (the 429's retry-after estimate).
        self._pending: dict[str, int] = {}
        self._latency_s: dict[str, float] = {}

    def create(self, tenant: str, kind: str) -> str:
        request_id = f"req-{secrets.token_hex(12)}"
        self._entries[request_id] = _Entry(tenant, kind, time.monotonic())
        self._pending[tenant] = self._pending.get(tenant, 0) + 1
        return request_id

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        entry = self._entries.get(request_id)
        if entry is None or entry.outcome is not None:
            return
        entry.outcome = outcome
        entry.event.set()
        self._pending[entry.tenant] -= 1
        took = time.monotonic() - entry.created_at
        previous = self._latency_s.get(entry.tenant)
        # Weight 0.2: about the last five results, so the estimate follows a changing load.
        self._latency_s[entry.tenant] = took if previous is None else 0.8 * previous + 0.2 * took

    def pending(self, tenant: str) -> int:
        """How many of the tenant's futures have no result yet."""
        return self._pending.get(tenant, 0)

    def typical_latency_s(self, tenant: str) -> float | None:
        """Recent seconds from submission to result of the tenant's requests; None before any."""
        return self._latency_s.get(tenant)

    def tenant(self, request_id: str) -> str | None:
        """Who submitted the request (for metering completed work)."""
        entry = self._entries.get(request_id)
        return entry.tenant if entry is not None else None

    def kind(self, request_id: str, tenant: str) -> str | None:
        entry = self._entries.get(request_id)
        return entry.kind if entry is not None and entry.tenant == tenant else None

    async def wait(self, request_id: str, tenant: str, hold_s: float) -> Outcome | None:
        """The outcome, or None if not ready within `hold_s`. KeyError if unknown to `tenant`."""
        entry = self._entries.get(request_id)
        if entry is None or entry.tenant != tenant:
            raise KeyError(request_id)
        if entry.outcome is None:
            try:
                await asyncio.wait_for(entry.event.wait(), hold_s)
            except TimeoutError:
                return None
        if entry.first_delivered_at is None:
            entry.first_delivered_at = time.monotonic()
        return entry.outcome

    def sweep(self) -> int:
        now = time.monotonic()
        stale = [
            rid
            for rid, e in self._entries.items()
            if (e.first_delivered_at is not None and now - e.first_delivered_at > self._grace_s)
            or (e.outcome is not None and now - e.created_at > self._max_age_s)
        ]
        for rid in stale:
            del self._entries[rid]
        return len(stale)

    def __len__(self) -> int:
        return len(self._entries)
