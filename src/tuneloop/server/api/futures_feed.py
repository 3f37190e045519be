"""The batch completion feed of sampling sessions (`retrieve_futures`) and clone numbering
(`join_sampling_session`).

With `sample_use_retrieve_futures` on, the official SDK keeps one long poll per (sampling
session, clone) instead of one per sample: the server answers it with the requests of that
target that completed since the client's cursor, then the SDK fetches each payload once with
`retrieve_future`. With up to 2,000 samples in flight that is one held connection instead of
2,000.

Cursors are integers that only grow: they start at the server's boot time in microseconds, so a
client's cursor from an earlier run of the server is below every cursor of this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tuneloop.server.scheduler.futures import FutureTable, Outcome

__all__ = ["CLONE_STRIDE", "MAX_EVENTS", "MAX_EVENT_AGE_S", "CompletionFeeds"]

# The official SDK numbers a clone's sample requests from 1e9 * clone id (spec 1.4).
CLONE_STRIDE = 1_000_000_000
# At most this many completions per answer: a bounded response body, the rest on the next poll.
MAX_COMPLETIONS = 4096
# Unacknowledged completions are kept this long (the future table keeps an undelivered result
# an hour too), and at most this many per feed: clients that never poll the feed (our SDK, the
# official one with the flag off) must not grow it without end.
MAX_EVENT_AGE_S = 3600.0
MAX_EVENTS = 100_000


@dataclass
class _Feed:
    # (cursor, completion, monotonic time), in cursor order.
    events: deque[tuple[int, dict[str, Any], float]] = field(default_factory=deque)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class CompletionFeeds:
    """Per (sampler id, clone id): the completions not yet acknowledged, in cursor order."""

    def __init__(self, futures: FutureTable) -> None:
        self._futures = futures
        self._watched: dict[str, tuple[str, int]] = {}  # request_id -> (sampler_id, clone)
        self._feeds: dict[tuple[str, int], _Feed] = {}
        self._cursor = time.time_ns() // 1000
        futures.listeners.append(self._resolved)

    def watch(self, request_id: str, sampler_id: str, clone: int) -> None:
        """Report `request_id` on its target's feed once it completes."""
        self._watched[request_id] = (sampler_id, clone)
        self._feeds.setdefault((sampler_id, clone), _Feed())

    def _resolved(self, request_id: str, outcome: Outcome) -> None:
        target = self._watched.pop(request_id, None)
        feed = self._feeds.get(target) if target is not None else None
        if feed is None:
            return
        self._cursor += 1
        completion: dict[str, Any] = {"state": "failed" if outcome.failed else "finished"}
        completion["request_id"] = request_id
        if not outcome.failed:
            # Counts as the metadata step: the SDK reserves this much before fetching.
            completion["response_payload_uncompressed_size"] = len(outcome.body)
        now = time.monotonic()
        events = feed.events
        while events and (len(events) >= MAX_EVENTS or now - events[0][2] > MAX_EVENT_AGE_S):
            events.popleft()
        events.append((self._cursor, completion, now))
        feed.changed.set()

    async def poll(
        self, sampler_id: str, clone: int, prev_cursor: int, hold_s: float
    ) -> tuple[list[dict[str, Any]], int]:
        """Completions after `prev_cursor` (those at or before it are dropped, the client has
        seen them), waiting up to `hold_s` for the first; and the cursor to send next."""
        feed = self._feeds.setdefault((sampler_id, clone), _Feed())
        while feed.events and feed.events[0][0] <= prev_cursor:
            feed.events.popleft()
        if not feed.events and hold_s > 0:
            feed.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(feed.changed.wait(), hold_s)
        page = list(itertools.islice(feed.events, MAX_COMPLETIONS))
        cursor = page[-1][0] if page else prev_cursor
        return [completion for _, completion, _ in page], cursor

    def forget_samplers(self, sampler_ids: set[str]) -> None:
        """A released session's samplers: their feeds and watches go."""
        for key in [k for k in self._feeds if k[0] in sampler_ids]:
            feed = self._feeds.pop(key)
            feed.changed.set()  # a poll held on it answers now
        for request_id in [r for r, t in self._watched.items() if t[0] in sampler_ids]:
            del self._watched[request_id]

    def __len__(self) -> int:
        return sum(len(f.events) for f in self._feeds.values())
