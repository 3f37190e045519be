"""The future table: results of long operations, long-polled through retrieve_future.

Lives on the server's event loop thread only (asyncio.Event is not thread-safe).

The table dies with the process. Request ids carry the id of the process that issued them
(`req-<boot id>-<random>`), so a poll for an id of an earlier run of the server (killed or
restarted with the request in flight) is told apart from an id that never existed: its result is
lost for good and the client must submit the request again.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

# req-<8 hex: boot id>-<24 hex>, and the plain req-<24 hex> of versions before boot ids.
_REQUEST_ID = re.compile(r"^req-(?:([0-9a-f]{8})-)?[0-9a-f]{24}$")


@dataclass(frozen=True)
class Outcome:
    """A finished operation, already serialized for the wire."""

    body: bytes
    media_type: str  # application/json or application/x-protobuf
    failed: bool = False

    @classmethod
    def json(cls, payload: Any, *, failed: bool = False) -> Outcome:
        """A JSON outcome. JSON has no NaN or infinity (Python would write the non-JSON literals
        `NaN` / `Infinity`, which strict clients refuse): a non-finite float becomes null,
        "no finite value". The engine keeps results finite; this makes it a guarantee."""
        body = json.dumps(finite_json(payload), allow_nan=False)
        return cls(body.encode(), "application/json", failed)


def finite_json(value: Any) -> Any:
    """`value` (dicts, lists, tuples, scalars) with every non-finite float replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


@dataclass
class _Entry:
    tenant: str
    kind: str
    created_at: float
    event: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    first_delivered_at: float | None = None


class FutureTable:
    def __init__(
        self, grace_s: float = 300.0, max_age_s: float = 3600.0, boot_id: str | None = None
    ) -> None:
        # This run of the server: a random id per process start (8 hex digits, so two runs of
        # one data dir share it with odds of 1 in 4e9), and the wall-clock time it started.
        self.boot_id = boot_id if boot_id is not None else secrets.token_hex(4)
        if not re.fullmatch(r"[0-9a-f]{8}", self.boot_id):
            raise ValueError(f"boot_id must be 8 lowercase hex digits, got {self.boot_id!r}")
        self.started_at = datetime.now(UTC)
        # Results stay `grace_s` after first delivery: the SDK may re-fetch after a transport
        # error and sends no acknowledgement. Undelivered results go after `max_age_s`.
        self._grace_s = grace_s
        self._max_age_s = max_age_s
        self._entries: dict[str, _Entry] = {}
        # Per tenant: unresolved futures (in-flight quota), and a moving average of the seconds
        # from submission to result (the 429's retry-after estimate).
        self._pending: dict[str, int] = {}
        self._latency_s: dict[str, float] = {}
        # Called with (request_id, outcome) as each future resolves (completion feeds, traces).
        self.listeners: list[Callable[[str, Outcome], None]] = []

    def create(self, tenant: str, kind: str) -> str:
        request_id = f"req-{self.boot_id}-{secrets.token_hex(12)}"
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
        for listener in self.listeners:
            listener(request_id, outcome)

    def forget(self, request_id: str, tenant: str) -> None:
        """Drop a delivered result the client acknowledged having (retrieve_futures)."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.tenant == tenant and entry.outcome is not None:
            del self._entries[request_id]

    def pending(self, tenant: str) -> int:
        """How many of the tenant's futures have no result yet."""
        return self._pending.get(tenant, 0)

    def in_flight(self) -> dict[str, int]:
        """Per tenant seen since start, how many futures have no result yet (for metrics)."""
        return dict(self._pending)

    def typical_latency_s(self, tenant: str) -> float | None:
        """Recent seconds from submission to result of the tenant's requests; None before any."""
        return self._latency_s.get(tenant)

    def issued_earlier(self, request_id: str) -> bool:
        """Whether `request_id` has the shape of one an earlier run of the server issued."""
        match = _REQUEST_ID.match(request_id)
        return match is not None and match[1] != self.boot_id

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
