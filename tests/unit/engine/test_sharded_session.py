"""The server's side of a sharded group's sampling session against scripted ranks (no torch).

The ranks here are threads at the ends of real pipes that say what a rank of a sharded group
says (workers/sharded_session.py); a rank "dies" by closing its pipe and its sentinel. What must
hold: an error is told only once every rank sent it (the error of a rank whose peer died is not
the request's: the request runs again on the restored group), an error every rank sent is the
request's own, and each `Step` is answered with one `Plan`, the same to every rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from tuneloop.server.engine.types import EngineError, SampleResult, SampleWork
from tuneloop.server.engine.workers.protocol import (
    Admit,
    Answer,
    Call,
    ItemError,
    Plan,
    Step,
    Stop,
    receive,
    send,
)
from tuneloop.server.engine.workers.sharded_session import LockstepContinuousRun

Script = Callable[[Connection, Admit, "Rank"], None]


class Rank:
    """One scripted rank: receives the session's call, runs `script`, then waits for calls
    (as a rank does after its session) until the group closes the pipe."""

    def __init__(self, script: Script) -> None:
        self.server, self.conn = Pipe()
        self.sentinel, self._alive = Pipe(duplex=False)  # readable (EOF) once the rank ends
        self.plans: list[Plan] = []
        self.thread = threading.Thread(target=self._run, args=(script,), daemon=True)
        self.thread.start()

    def _run(self, script: Script) -> None:
        try:
            call = receive(self.conn)
            assert isinstance(call, Call)
            assert call.method == "sample_continuous"
            script(self.conn, call.args[0], self)
            receive(self.conn)  # back to plain calls, until the group is stopped
        except (EOFError, OSError):  # the group was stopped (or the rank died)
            pass
        finally:
            self.die()

    def plan(self) -> Plan:
        plan = receive(self.conn)
        assert isinstance(plan, Plan)
        self.plans.append(plan)
        return plan

    def die(self) -> None:
        self.conn.close()
        self._alive.close()

    def link(self) -> tuple[Connection, Any]:
        return self.server, self.sentinel


def _keys(admit: Admit) -> list[int]:
    return [key for key, _ in admit.works]


def _answer_and_stop(conn: Connection, admit: Admit, rank: Rank, leader: bool) -> None:
    """A healthy rank: rank 0 sends each request's result; both then take plans to the end."""
    if leader:
        for key in _keys(admit):
            send(conn, Answer(key, SampleResult([])))
    while True:
        if leader:
            send(conn, Step())
        if any(isinstance(m, Stop) for m in rank.plan().messages):
            send(conn, None)  # the session call's reply
            return


def _request() -> SampleWork:
    return SampleWork("s", np.arange(4, dtype=np.int64), 1, 8, 1.0, -1, 1.0, 0, (), ())


def _run(generations: list[list[Script]]) -> tuple[list[Any], list[str], list[list[Rank]]]:
    """One session over the scripted generations of the group; what was delivered, why the
    group was restarted, and the ranks of each generation."""
    started: list[list[Rank]] = [[Rank(script) for script in generations[0]]]
    restarts: list[str] = []
    delivered: list[Any] = []

    def recover(reason: str) -> None:
        restarts.append(reason)
        for rank in started[-1]:
            rank.server.close()
        started.append([Rank(script) for script in generations[len(started)]])

    run = LockstepContinuousRun(
        lambda: [rank.link() for rank in started[-1]],
        recover,
        list,
        lambda work, value: delivered.append(value),
        frozenset,
        attempts=3,
    )
    run.run([_request()])
    for rank in started[-1]:
        rank.server.close()
    for generation in started:
        for rank in generation:
            rank.thread.join(timeout=10)
            assert not rank.thread.is_alive()
    return delivered, restarts, started


def _healthy(leader: bool) -> Script:
    return lambda conn, admit, rank: _answer_and_stop(conn, admit, rank, leader)


def test_the_error_of_a_rank_whose_peer_died_is_not_told() -> None:
    """Rank 0 answers with the error its failed collective gave it, then rank 1 dies: the
    request is not answered with that error but runs again on the restored group."""
    sent = threading.Event()

    def failing_leader(conn: Connection, admit: Admit, rank: Rank) -> None:
        for key in _keys(admit):
            send(conn, Answer(key, ItemError("RuntimeError: connection closed by peer", "server")))
        sent.set()
        receive(conn)  # blocked, as in a collective, until the group is stopped

    def dying(conn: Connection, admit: Admit, rank: Rank) -> None:
        assert sent.wait(10)
        threading.Event().wait(0.2)  # the server reads rank 0's error before the death
        rank.die()

    delivered, restarts, _ = _run([[failing_leader, dying], [_healthy(True), _healthy(False)]])
    [restart] = restarts
    assert restart.startswith("worker 1 died")
    assert len(delivered) == 1
    assert isinstance(delivered[0], SampleResult)


def test_an_error_every_rank_sent_is_the_requests_own() -> None:
    def erring(leader: bool) -> Script:
        def script(conn: Connection, admit: Admit, rank: Rank) -> None:
            for key in _keys(admit):
                send(conn, Answer(key, ItemError("no sampler 's'", "user")))
            _answer_and_stop(conn, Admit(()), rank, leader)

        return script

    delivered, restarts, ranks = _run([[erring(True), erring(False)]])
    assert restarts == []
    [error] = delivered
    assert isinstance(error, EngineError)
    assert (str(error), error.category) == ("no sampler 's'", "user")
    # every Step was answered with one Plan, the same to both ranks
    assert ranks[0][0].plans == ranks[0][1].plans == [Plan((Stop(),))]


@pytest.mark.parametrize("leaving", [0, 1])
def test_a_rank_that_leaves_the_session_restarts_the_group(leaving: int) -> None:
    """A rank whose session call ends early (it failed as a whole) has left the lockstep."""

    def leaves(conn: Connection, admit: Admit, rank: Rank) -> None:
        send(conn, None)

    def waits(conn: Connection, admit: Admit, rank: Rank) -> None:
        receive(conn)

    first = [waits, waits]
    first[leaving] = leaves
    delivered, restarts, _ = _run([first, [_healthy(True), _healthy(False)]])
    assert restarts == [f"worker {leaving} died: it left the sampling session"]
    assert len(delivered) == 1
    assert isinstance(delivered[0], SampleResult)
