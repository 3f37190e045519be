"""Continuous batching on a sharded worker group: both sides of its sampling session.

A sharded group's ranks cannot decode shares of their own (continuous.py's way): each forward
all-gathers every layer from every rank, so every rank must run the same decode steps over the
same rows. Admissions and cancellations must therefore reach every rank at the same step
boundary, which messages read "whenever they arrive" do not give. So the ranks take nothing on
their own: at every boundary rank 0 asks the group (`Step`) and every rank reads the one `Plan`
the group answers it with, the same messages for all, applied before the next step. One
decision per step, made in the server process on rank 0's request: its tokens and answers so
far went before the request on the same pipe, so the group knows exactly what is outstanding
(when nothing is, and nothing joins, the plan is `Stop`). A joining request starts at the next
step of the running batch, as in one process and in a replicated group.

Rank 0 alone streams tokens and sends results; the other ranks compute the same bits and keep
them. They do keep the same books (which request streamed a token, `told`), so that a failing
decode is run again in halves identically on every rank (rank_session.py).

Errors are the one answer every rank sends, and an error is told only once every rank sent it:
a rank whose peer died fails its collectives, and that error is not the request's. The peer's
death restarts the group (the replicated group's recovery: streamed requests get an error, the
others run again), while an error every rank reached (a cancellation, a poisoned sampler) is the
request's own. A rank that leaves the session early (its call fails) breaks the lockstep: the
group is restarted as if it had died.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from tuneloop.server.engine.types import EngineError, SampleResult
from tuneloop.server.engine.workers.continuous import GroupContinuousRun, Link
from tuneloop.server.engine.workers.protocol import (
    Admit,
    Answer,
    Call,
    Cancel,
    Failure,
    ItemError,
    Plan,
    Step,
    Stop,
    Tokens,
    WorkerDiedError,
    engine_item,
    receive,
    send,
)
from tuneloop.server.engine.workers.rank_session import RankSession

if TYPE_CHECKING:
    from tuneloop.server.engine.torch_backend import TorchBackend

__all__ = ["LockstepContinuousRun", "LockstepRankSession"]

log = logging.getLogger(__name__)


class LockstepRankSession(RankSession):
    """A rank of a sharded group in a sampling session; rank 0 is the `leader`."""

    def __init__(self, backend: TorchBackend, conn: Connection, leader: bool) -> None:
        super().__init__(backend, conn)
        self.leader = leader

    def _plan(self) -> None:
        if self.leader:
            send(self.conn, Step())
        plan = receive(self.conn)
        if not isinstance(plan, Plan):
            raise TypeError(f"expected the step's plan, got {plan!r}")
        for message in plan.messages:
            self._take(message)

    def _wait(self) -> None:
        self._plan()  # idle: the group decides whether more joins or the session ends

    def _read(self) -> None:
        self._plan()  # between steps: what the group decided for this step, on every rank

    def _flush(self) -> None:
        if self.leader:
            super()._flush()
        else:
            self.tokens = []

    def _send_answer(self, key: int, value: SampleResult | ItemError) -> None:
        if self.leader or isinstance(value, ItemError):
            super()._send_answer(key, value)


class LockstepContinuousRun(GroupContinuousRun):
    """The server's side: the replicated group's run (requests, answers, recovery) over ranks
    that hold every request together, decided step by step."""

    def _session(self, links: list[Link]) -> None:
        self.session = links
        self.errors: dict[int, set[int]] = {}  # key -> ranks that answered it with an error
        self.held: dict[int, EngineError] = {}  # key -> rank 0's error, until all ranks agree
        self.replied: set[int] = set()  # ranks that answered the session's call
        self.stopped = self.salvaging = False
        super()._session(links)

    def _decode(self, links: list[Link]) -> None:
        first = self._place(1).get(0, Admit(()))  # one placement: the whole group
        for rank, (conn, _) in enumerate(links):
            self.outbox.put(rank, conn, Call("sample_continuous", (first,)))
        conns = {conn: rank for rank, (conn, _) in enumerate(links)}
        sentinels = {sentinel: rank for rank, (_, sentinel) in enumerate(links)}
        # No timeout: nothing is decided but on rank 0's Step, and every rank speaks last
        # (its call's reply) or dies (its sentinel).
        while len(self.replied) < len(links):
            ready = wait([*conns, *sentinels])
            for obj in ready:
                if obj in conns:
                    self._drain(conns[obj], obj)
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    self._drain(rank, links[rank][0])
                    raise WorkerDiedError(rank, "it ended during continuous sampling")
        for key, error in list(self.held.items()):  # every rank ended well: errors stand
            self._answer(key, error)

    def _step(self) -> None:
        """Rank 0 is at a step boundary: decide what every rank does before the next step."""
        messages: list[Admit | Cancel | Stop] = []
        gone = self.cancelled()
        if gone is not self.sent and gone != self.sent:
            messages.append(Cancel(frozenset(gone)))
            self.sent = gone
        self._add(self.admit())
        admission = self._place(1).get(0)
        if admission is not None:
            messages.append(admission)
        elif all(key in self.held for key in self.requests):  # rank 0 holds nothing more
            messages.append(Stop())
            self.stopped = True
        plan = Plan(tuple(messages))
        for rank, (conn, _) in enumerate(self.session):
            self.outbox.put(rank, conn, plan)

    def _handle(self, rank: int, message: Any) -> bool:
        if isinstance(message, Tokens):
            return super()._handle(rank, message)
        if isinstance(message, Answer):
            self._told(rank, message.key, engine_item(message.value))
            return True
        if isinstance(message, Step):
            if not self.salvaging:  # a dying session decides nothing
                self._step()
            return True
        if message is None and self.stopped:
            self.replied.add(rank)
            return False
        detail = "it left the sampling session"
        if isinstance(message, Failure):
            log.error("worker %d failed its sampling session:\n%s", rank, message.traceback)
            detail = f"{detail}: {message.error.message}"
        raise WorkerDiedError(rank, detail)

    def _told(self, rank: int, key: int, value: SampleResult | EngineError) -> None:
        if not isinstance(value, EngineError):  # the same bits on every rank: rank 0 sent it
            self._answer(key, value)
            return
        if rank == 0:
            self.held[key] = value
        agreed = self.errors.setdefault(key, set())
        agreed.add(rank)
        if len(agreed) == len(self.session) and key in self.held:
            del self.errors[key]
            self._answer(key, self.held.pop(key))

    def _salvage(self, links: list[Link], dead: int) -> None:
        self.salvaging = True
        super()._salvage(links, dead)
