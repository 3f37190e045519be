"""Revoking a key ends its work at once: queued work is dropped, running sampling stops.

`tuneloop keys revoke` only rewrites the keys file; the server notices within `CHECK_S`. Every
request authenticated with a key is tracked under that key (its hash) from submission, so a
revocation finds it: queued operations leave the queue unrun, sampling past the queue (a
gathering or decoding batch) stops at its next step, and their futures fail with a 401 answer.
Long-polls and OpenAI requests check their key again while they wait (`key_still_valid`), so
they end with 401 too, within a second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar

from tuneloop.server.scheduler.futures import FutureTable
from tuneloop.server.scheduler.loop import EngineLoop, failure
from tuneloop.server.scheduler.queue import OperationQueue
from tuneloop.server.storage.keys import KeyStore

log = logging.getLogger(__name__)

# How often the keys file is looked at (one stat; re-read only when it changed). A revoked
# key's work stops within this plus one decode step.
CHECK_S = 0.25
# How often requests whose results are gone are forgotten: the tracking holds what the future
# table holds (results stay there minutes after delivery), walked this rarely.
PRUNE_S = 30.0
# The failure category of work whose key was revoked; answered 401 wherever it surfaces.
REVOKED = "unauthorized"
REVOKED_MESSAGE = "the API key of this request was revoked"

# The hash of the key that authenticated the request being handled (set by `authenticate`).
# A context variable, because futures are created deep in the handlers, which take the tenant
# and not the key.
CALLER_KEY: ContextVar[str | None] = ContextVar("tuneloop_caller_key", default=None)


class Revocations:
    def __init__(
        self, keys: KeyStore, futures: FutureTable, queue: OperationQueue, engine: EngineLoop
    ) -> None:
        self.keys = keys
        self.futures = futures
        self.queue = queue
        self.engine = engine
        # key hash -> request id -> the cancel key that stops it past the queue (sampling)
        self._by_key: dict[str, dict[str, str | None]] = {}

    def track(self, request_id: str, cancel_key: str | None = None) -> None:
        """Record that the current request's key submitted `request_id`."""
        digest = CALLER_KEY.get()
        if digest is not None:
            self._by_key.setdefault(digest, {})[request_id] = cancel_key

    def key_still_valid(self, digest: str | None) -> bool:
        return digest is None or self.keys.tenant_of_hash(digest) is not None

    def check(self) -> int:
        """End the work of every tracked key no longer valid; how many requests ended.

        One look-up per key (the keys file is re-read only when it changed); the requests of a
        key are walked only when it was revoked, and by `prune`.
        """
        ended = 0
        for digest in [d for d in self._by_key if not self.key_still_valid(d)]:
            ended += self._end(self._by_key.pop(digest))
        return ended

    def prune(self) -> None:
        """Forget requests whose results left the future table (they need no ending)."""
        for digest in list(self._by_key):
            requests = self._by_key[digest]
            for request_id in [r for r in requests if self.futures.tenant(r) is None]:
                del requests[request_id]
            if not requests:
                del self._by_key[digest]

    def _end(self, requests: dict[str, str | None]) -> int:
        revoked = failure(REVOKED_MESSAGE, REVOKED)
        for op in self.queue.drop_requests(set(requests)):
            log.info("dropped %s: its API key was revoked", op.request_id)
        cancel_keys = {key for key in requests.values() if key is not None}
        if cancel_keys:
            self.engine.cancel_samplers(cancel_keys)
        for request_id in requests:  # a no-op for those already answered
            self.futures.resolve(request_id, revoked)
        self.engine.notify()  # the queue changed: later operations may be ready now
        return len(requests)

    async def run(self) -> None:
        last_prune = time.monotonic()
        while True:
            try:
                self.check()
                if time.monotonic() - last_prune > PRUNE_S:
                    self.prune()
                    last_prune = time.monotonic()
            except Exception:  # a bad keys file must not end revocation for good
                log.exception("checking for revoked keys failed")
            await asyncio.sleep(CHECK_S)


__all__ = ["CALLER_KEY", "CHECK_S", "REVOKED", "REVOKED_MESSAGE", "Revocations"]
