"""A rank's side of a continuous sampling session (the group's side is continuous.py).

The rank runs its backend's own continuous batching (`TorchBackend.sample_continuous`) on the
requests the group admits to it. Between decode steps it reads what the group sent (admissions,
cancellations, the end of the session) without waiting; while it has nothing to decode it waits
for the group. Tokens of streamed requests are buffered during a step and sent as one message
per step (never after their request's answer); each request's answer is sent as soon as it is
known, once. A sharded group's rank reads the group only at the points the group decides for
every rank alike (sharded_session.py overrides `_wait` and `_read`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tuneloop.server.engine.isolation import bisect_failures
from tuneloop.server.engine.types import (
    CANCELLED,
    EngineError,
    SampleResult,
    SampleWork,
    TokenHook,
    TopkRow,
)
from tuneloop.server.engine.workers.protocol import (
    Admit,
    Answer,
    Cancel,
    ItemError,
    Stop,
    TokenEvent,
    Tokens,
    receive,
    send,
)

if TYPE_CHECKING:
    from tuneloop.server.engine.torch_backend import TorchBackend

__all__ = ["RankSession"]

log = logging.getLogger(__name__)


class RankSession:
    def __init__(self, backend: TorchBackend, conn: Connection) -> None:
        self.backend, self.conn = backend, conn
        self.keys: dict[int, int] = {}  # id(local work) -> its key, until answered
        self.works: dict[int, SampleWork] = {}  # key -> local work, until answered
        self.fresh: list[SampleWork] = []  # admitted, not yet handed to the decoder
        self.told: set[int] = set()  # keys that have sent a token
        self.tokens: list[TokenEvent] = []  # drawn this step, not yet sent
        self.gone: frozenset[str] = frozenset()
        self.stopping = False

    def serve(self, first: Admit) -> None:
        """Decode what is admitted until the group says stop."""
        self._take(first)
        while not (self.stopping and not self.fresh):
            if self.fresh:
                batch, self.fresh = self.fresh, []
                self._decode(batch)
            elif not self.stopping:
                self._wait()  # nothing to decode

    def _take(self, message: Any) -> None:
        if isinstance(message, Admit):
            for key, work in message.works:
                local = replace(work, on_token=self._hook(key)) if key in message.streamed else work
                self.keys[id(local)] = key
                self.works[key] = local
                self.fresh.append(local)
        elif isinstance(message, Cancel):
            self.gone = message.ids
        elif isinstance(message, Stop):
            self.stopping = True
        else:
            raise TypeError(f"unexpected message in a sampling session: {message!r}")

    def _hook(self, key: int) -> TokenHook:
        def told(index: int, token: int, logprob: float, topk: TopkRow) -> None:
            self.told.add(key)
            self.tokens.append((key, index, token, logprob, topk))

        return told

    def _flush(self) -> None:
        if self.tokens:
            events, self.tokens = tuple(self.tokens), []
            send(self.conn, Tokens(events))

    def _wait(self) -> None:
        """Nothing to decode: wait for the group's next message."""
        self._take(receive(self.conn))

    def _read(self) -> None:
        """Between decode steps: whatever the group has sent, without waiting."""
        while self.conn.poll(0):
            self._take(receive(self.conn))

    def _admit(self) -> list[SampleWork]:
        """Called once per decode step: send the step's tokens, read what the group sent."""
        self._flush()
        self._read()
        joining, self.fresh = self.fresh, []
        return joining

    def _send_answer(self, key: int, value: SampleResult | ItemError) -> None:
        send(self.conn, Answer(key, value))

    def _deliver(self, work: SampleWork, result: SampleResult | EngineError) -> None:
        key = self.keys.pop(id(work), None)
        if key is None:
            return
        self.works.pop(key, None)
        self._flush()  # a request's tokens go before its answer
        self._send_answer(key, ItemError.of(result) if isinstance(result, EngineError) else result)

    def _decode(self, batch: list[SampleWork]) -> None:
        try:
            self.backend.sample_continuous(batch, self._admit, self._deliver, lambda: self.gone)
        except Exception as exc:
            # What the failed run had not answered, as the engine loop does in one process:
            # run again in halves so that only a request failing alone fails; one that streamed
            # tokens already gets the error (telling them again would repeat them).
            log.exception("continuous sampling failed on this rank")
            self._flush()
            waiting = {id(w) for w in self.fresh}
            left = [w for w in self.works.values() if id(w) not in waiting]
            error = EngineError(f"{type(exc).__name__}: {exc}")
            again = []
            for work in left:
                if work.cancelled_by(self.gone):
                    self._deliver(work, EngineError(CANCELLED, "user"))
                elif self.keys[id(work)] in self.told:
                    self._deliver(work, error)
                else:
                    again.append(work)
            if again:
                results = bisect_failures(self.backend.sample, again, "sample")
                for work, result in zip(again, results, strict=True):
                    self._deliver(work, result)
