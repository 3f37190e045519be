"""Continuous batching across a worker group: the server process's side of a sampling session.

`GroupContinuousRun` runs on the engine thread. It opens a session on every rank (the
`sample_continuous` call, rank_session.py) and then multiplexes: it reads whatever the ranks
send as it arrives (streamed tokens, answers) and tells it at once to the caller (`on_token`,
`deliver`), passes cancellations on, and between messages (at least every POLL_S) asks the
engine for requests to admit and hands each to the least-loaded rank (by rows x cache width
outstanding). Each rank decodes its share with its own continuous batching; no rank waits for
another. Once nothing is outstanding and nothing joins, every rank is told to stop. What the
group sends goes out on a thread of its own (`_Outbox`), so the engine thread never stops
reading while a rank is itself blocked sending. (A sharded group's ranks decode every request
together, in lockstep: sharded_session.py runs this session decided step by step.)

A rank that dies: what the other ranks had already sent is still told, the group is restarted
and restored (the group's `_recover`), and the requests not yet answered run again on the new
group, except those that streamed tokens already: telling them again would repeat them, so
they get an error, as in one process. A request whose rank dies `attempts` times fails.

Every request is answered exactly once: answers are keyed by the session's own request keys,
and a key is forgotten when it is answered.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol, runtime_checkable

from tuneloop.server.engine.types import CANCELLED, EngineError, SampleResult, SampleWork
from tuneloop.server.engine.workers.protocol import (
    Admit,
    Answer,
    Call,
    Cancel,
    Failure,
    Stop,
    Tokens,
    WorkerDiedError,
    engine_item,
    receive,
    send,
)

__all__ = ["POLL_S", "GroupContinuousRun", "Streams", "sample_in_batches"]

log = logging.getLogger(__name__)
# The longest the group waits on the ranks before it asks the engine for joining requests
# again (the engine's admit() costs nothing while the queue is empty).
POLL_S = 0.01
# How long the end of a session waits for its last messages to be sent.
CLOSE_S = 5.0
Link = tuple[Connection, Any]  # a rank's pipe and its process sentinel
Deliver = Callable[[SampleWork, SampleResult | EngineError], None]


@runtime_checkable
class Streams(Protocol):
    """A placement whose workers the group reaches through pipes (`LocalPlacement`)."""

    def links(self) -> list[Link]: ...


def cost(work: SampleWork) -> int:
    """What a request holds on its rank: rows x cache width (as sharding.split_samples)."""
    return work.num_samples * (len(work.prompt) + work.max_tokens)


@dataclass(eq=False)
class _Request:
    work: SampleWork  # the caller's own, with its hook
    cost: int
    rank: int = -1  # -1: not placed on the running group
    told: bool = False  # a token of it reached the caller
    deaths: int = 0  # ranks that died while it was outstanding


class GroupContinuousRun:
    def __init__(
        self,
        links: Callable[[], list[Link]],
        recover: Callable[[str], None],
        admit: Callable[[], Sequence[SampleWork]],
        deliver: Deliver,
        cancelled: Callable[[], Collection[str]],
        attempts: int,
    ) -> None:
        self.links, self.recover = links, recover
        self.admit, self.deliver, self.cancelled = admit, deliver, cancelled
        self.attempts = attempts
        self.requests: dict[int, _Request] = {}  # outstanding, by key
        self.unplaced: list[int] = []  # keys to hand to a rank, in arrival order
        self.next_key = 0
        self.left: set[int] = set()  # ranks that left the session (answered its call early)
        self.sent: Collection[str] = frozenset()  # the cancelled ids the ranks know
        self.outbox: _Outbox  # the running session's (a new one per session)

    def run(self, batch: Sequence[SampleWork]) -> None:
        self._add(batch)
        while True:
            links = self.links()
            try:
                self._session(links)
                return
            except WorkerDiedError as exc:
                log.warning("%s during continuous sampling; restarting the worker group", exc)
                self._lost(exc)
                try:
                    self.recover(str(exc))
                except EngineError as error:  # no group to run on: everything left fails
                    for key in list(self.requests):
                        self._answer(key, error)
                    return
            except BaseException:
                # The caller's admit() or deliver() raised: the ranks are still in the session
                # and would read the next call as a session message. A restarted (and restored)
                # group is back to plain calls; the caller answers what is left.
                log.warning("continuous sampling interrupted; restarting the worker group")
                with contextlib.suppress(Exception):
                    self.recover("an interrupted sampling session")
                raise

    # ---- requests ---------------------------------------------------------------------------

    def _add(self, works: Sequence[SampleWork]) -> None:
        for work in works:
            self.requests[self.next_key] = _Request(work, cost(work))
            self.unplaced.append(self.next_key)
            self.next_key += 1

    def _answer(self, key: int, value: SampleResult | EngineError) -> None:
        request = self.requests.pop(key, None)
        if request is not None:  # answered once: a later answer of the key is dropped
            self.deliver(request.work, value)

    def _lost(self, exc: WorkerDiedError) -> None:
        """The outstanding requests after a death: again on the next group, or their error."""
        for key, request in sorted(self.requests.items()):
            if request.rank < 0:
                continue
            request.deaths += 1
            if request.told:
                self._answer(key, EngineError(f"sampling stopped after streaming: {exc}"))
            elif request.deaths >= self.attempts:
                self._answer(
                    key,
                    EngineError(
                        f"the worker group lost a worker on this request {request.deaths} times"
                    ),
                )
            else:
                request.rank = -1
        self.unplaced = sorted(k for k, r in self.requests.items() if r.rank < 0)

    def _place(self, size: int) -> dict[int, Admit]:
        """Each unplaced request onto the least-loaded rank, largest first (ties: the lowest
        rank), as one admission per rank; cancelled ones answered here."""
        if not self.unplaced:  # the common case, every POLL_S
            return {}
        gone = self.cancelled()
        keys, self.unplaced = self.unplaced, []
        live = [r for r in range(size) if r not in self.left]
        loads = dict.fromkeys(live, 0)
        for request in self.requests.values():
            if request.rank in loads:
                loads[request.rank] += request.cost
        shares: dict[int, list[int]] = {}
        for key in sorted(keys, key=lambda k: (-self.requests[k].cost, k)):
            request = self.requests[key]
            if request.work.cancelled_by(gone):
                self._answer(key, EngineError(CANCELLED, "user"))
                continue
            if not loads:
                self._answer(key, EngineError("no worker is left to sample on"))
                continue
            rank = min(loads, key=lambda r: (loads[r], r))
            loads[rank] += request.cost
            request.rank = rank
            shares.setdefault(rank, []).append(key)
        return {
            rank: Admit(
                tuple((k, self.requests[k].work) for k in sorted(share)),
                frozenset(k for k in share if self.requests[k].work.on_token is not None),
            )
            for rank, share in shares.items()
        }

    # ---- one session on one generation of the group -----------------------------------------

    def _session(self, links: list[Link]) -> None:
        self.left, self.sent = set(), frozenset()
        self.outbox = _Outbox()
        try:
            self._decode(links)
        except WorkerDiedError as exc:
            # Reading what the living ranks sent also frees a send of the outbox stuck on one.
            self._salvage(links, exc.rank)
            raise
        finally:
            self.outbox.close()

    def _decode(self, links: list[Link]) -> None:
        _send = self.outbox.put
        first = self._place(len(links))
        for rank, (conn, _) in enumerate(links):
            _send(rank, conn, Call("sample_continuous", (first.get(rank, Admit(())),)))
        conns = {conn: rank for rank, (conn, _) in enumerate(links)}
        sentinels = {sentinel: rank for rank, (_, sentinel) in enumerate(links)}
        while True:
            ready = wait([*conns, *sentinels], POLL_S)
            for obj in ready:
                if obj in conns:
                    self._drain(conns[obj], obj)
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    self._drain(rank, links[rank][0])  # what it sent before it died counts
                    raise WorkerDiedError(rank, "it ended during continuous sampling")
            gone = self.cancelled()
            if gone is not self.sent and gone != self.sent:
                for rank, (conn, _) in enumerate(links):
                    if rank not in self.left:
                        _send(rank, conn, Cancel(frozenset(gone)))
                self.sent = gone
            self._add(self.admit())
            for rank, admission in self._place(len(links)).items():
                _send(rank, links[rank][0], admission)
            if not self.requests:
                break
        self._stop(links)

    def _drain(self, rank: int, conn: Connection) -> None:
        """Tell everything the rank has sent so far, in order."""
        try:
            while conn.poll():
                self._handle(rank, receive(conn))
        except (EOFError, OSError):
            raise WorkerDiedError(rank, "its pipe closed") from None

    def _handle(self, rank: int, message: Any) -> bool:
        """Tell one message; False for the reply of the session's call (the rank left it)."""
        if isinstance(message, Tokens):
            for key, index, token, logprob, topk in message.events:
                request = self.requests.get(key)
                if request is None:
                    continue
                request.told = True
                if request.work.on_token is not None:
                    try:
                        request.work.on_token(index, token, logprob, topk)
                    except Exception:  # a listener's bug must not fail the batch
                        log.exception("a token hook failed")
            return True
        if isinstance(message, Answer):
            self._answer(message.key, engine_item(message.value))
            return True
        # The call's reply before the group said stop: the rank's session failed as a whole.
        self.left.add(rank)
        error = EngineError(f"worker {rank} left the sampling session")
        if isinstance(message, Failure):
            log.error("worker %d failed its sampling session:\n%s", rank, message.traceback)
            error = message.error.error()
        for key in [k for k, r in self.requests.items() if r.rank == rank]:
            self._answer(key, error)
        return False

    def _stop(self, links: list[Link]) -> None:
        """Tell every rank still in the session to stop and wait for its call's reply."""
        waiting: dict[Any, int] = {}
        for rank, (conn, _) in enumerate(links):
            if rank not in self.left:
                self.outbox.put(rank, conn, Stop())
                waiting[conn] = rank
        sentinels = {links[rank][1]: rank for rank in waiting.values()}
        while waiting:
            for obj in wait([*waiting, *sentinels]):
                if obj in waiting:
                    rank = waiting[obj]
                    conn = links[rank][0]
                    try:
                        while conn.poll() and rank not in self.left:
                            self._handle(rank, receive(conn))
                    except (EOFError, OSError):
                        raise WorkerDiedError(rank, "its pipe closed") from None
                    if rank in self.left:
                        del waiting[obj]
                        del sentinels[links[rank][1]]
                elif obj in sentinels:
                    raise WorkerDiedError(sentinels[obj], "it ended while stopping")

    def _salvage(self, links: list[Link], dead: int) -> None:
        """Before the group is restarted: tell what the living ranks have sent already."""
        for rank, (conn, _) in enumerate(links):
            if rank == dead or rank in self.left:
                continue
            try:
                self._drain(rank, conn)
            except WorkerDiedError:
                continue


class _Outbox:
    """Sends a session's messages to the ranks in order, on a thread of its own. The engine
    thread then never waits on a send and keeps reading: a large admission one way and a large
    answer the other way through full pipes would otherwise wait on each other for ever (the
    rank reads only between its decode steps)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, Connection, Any] | None] = queue.SimpleQueue()
        self.failed: dict[int, str] = {}  # rank -> why a send to it failed (it is gone)
        self._thread = threading.Thread(target=self._run, name="sampling-outbox", daemon=True)
        self._thread.start()

    def put(self, rank: int, conn: Connection, message: Any) -> None:
        if rank in self.failed:
            raise WorkerDiedError(rank, self.failed[rank])
        self._queue.put((rank, conn, message))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            rank, conn, message = item
            if rank in self.failed:
                continue
            try:
                send(conn, message)
            except (OSError, ValueError) as exc:  # a closed pipe: its sentinel tells the rest
                self.failed[rank] = str(exc)

    def close(self) -> None:
        """Done once what was queued is sent; a send stuck on a rank that no longer reads ends
        when the group is restarted (its pipes close), so the wait is bounded."""
        self._queue.put(None)
        self._thread.join(timeout=CLOSE_S)


def sample_in_batches(
    sample: Callable[[Sequence[SampleWork]], list[SampleResult | EngineError]],
    batch: Sequence[SampleWork],
    admit: Callable[[], Sequence[SampleWork]],
    deliver: Deliver,
    cancelled: Callable[[], Collection[str]],
) -> None:
    """Where the workers have no pipe to stream on (Ray actors): whole batches, one after
    another, each taking in what queued while the one before ran."""
    works = list(batch)
    while works:
        gone = cancelled()
        live = []
        for work in works:
            if work.cancelled_by(gone):
                deliver(work, EngineError(CANCELLED, "user"))
            else:
                live.append(work)
        if live:
            for work, result in zip(live, sample(live), strict=True):
                deliver(work, result)
        works = list(admit())
