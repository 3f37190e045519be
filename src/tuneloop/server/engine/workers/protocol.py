"""Messages between the worker group (server process) and its workers.

A call names a `WorkerRuntime` method with its arguments; the reply is the method's value or a
`Failure`. Everything crosses the pipe pickled; engine errors are carried as `ItemError` values
because an unpickled `EngineError` would lose its category (pickling keeps only `args`).

One call, `sample_continuous`, opens a session of asynchronous messages before its reply
(workers/continuous.py): the group sends `Admit`, `Cancel` and finally `Stop`; the rank sends
`Tokens` and `Answer` as they happen, then the call's reply once it has stopped. Outside a session
the pipe carries calls and replies only, so every other call is unchanged.

A sharded group's session (workers/sharded_session.py) changes who decides when: its ranks
decode the same rows in lockstep, so they take nothing on their own between steps. Rank 0 sends
`Step` at every step boundary and every rank reads the one `Plan` the group answers it with
(the same messages to every rank, applied at the same step).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

from tuneloop.server.engine.types import EngineError, SampleResult, SampleWork, TopkRow


@dataclass(frozen=True)
class Call:
    method: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class ItemError:
    """An `EngineError` on the wire."""

    message: str
    category: Literal["user", "server"]

    @classmethod
    def of(cls, exc: EngineError) -> ItemError:
        return cls(str(exc), exc.category)

    def error(self) -> EngineError:
        return EngineError(self.message, self.category)


@dataclass(frozen=True)
class Failure:
    """A call that raised: an engine error (the user's or the server's) or a bug with its
    traceback, which the group logs."""

    error: ItemError
    traceback: str = ""


class WorkerDiedError(Exception):
    """A worker process (or actor) ended while the group waited on it."""

    def __init__(self, rank: int, detail: str = "") -> None:
        super().__init__(f"worker {rank} died{': ' + detail if detail else ''}")
        self.rank = rank


# ---- a continuous sampling session (see continuous.py) -----------------------------------------


@dataclass(frozen=True)
class Admit:
    """Group -> rank: requests joining the rank's decode batch, each under the session's key
    for it. `streamed` holds the keys whose tokens the rank sends as they are drawn (the hook
    itself stays in the server process: `SampleWork` is pickled without it)."""

    works: tuple[tuple[int, SampleWork], ...]
    streamed: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Cancel:
    """Group -> rank: every sampler id and cancel key cancelled so far (the whole set, sent
    when it changes)."""

    ids: frozenset[str]


@dataclass(frozen=True)
class Stop:
    """Group -> rank: the session ends (sent once nothing is outstanding on the rank); the
    rank answers the `sample_continuous` call and goes back to plain calls."""


@dataclass(frozen=True)
class Step:
    """Rank 0 of a sharded group -> group: at a decode-step boundary (or idle), waiting for
    the step's `Plan`; its tokens and answers so far went before it on the same pipe."""


@dataclass(frozen=True)
class Plan:
    """Group -> every rank of a sharded group, once per `Step`: what each rank applies before
    its next decode step (`Cancel`, `Admit`, `Stop`, in that order; often nothing)."""

    messages: tuple[Admit | Cancel | Stop, ...] = ()


# (key, sample index, token, logprob, top-k row or None)
TokenEvent = tuple[int, int, int, float, TopkRow]


@dataclass(frozen=True)
class Tokens:
    """Rank -> group: the tokens of streamed requests drawn in one decode step, in order."""

    events: tuple[TokenEvent, ...]


@dataclass(frozen=True)
class Answer:
    """Rank -> group: the one answer of the request under `key` (a result or its error)."""

    key: int
    value: SampleResult | ItemError


def engine_item(value: Any) -> Any:
    """An item of a batch reply: an `ItemError` back to an `EngineError`, anything else as is."""
    return value.error() if isinstance(value, ItemError) else value


def send(conn: Connection, message: Any) -> None:
    """Plain pickle, not the connection's own: that one (multiprocessing's ForkingPickler, with
    torch's reductions registered) moves tensors through shared memory, so a snapshot sent to
    two workers would be one optimizer state that both step in place."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())
