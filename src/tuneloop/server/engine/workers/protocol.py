"""Messages between the worker group (server process) and its workers.

A call names a `WorkerRuntime` method with its arguments; the reply is the method's value or a
`Failure`. Everything crosses the pipe pickled; engine errors are carried as `ItemError` values
because an unpickled `EngineError` would lose its category (pickling keeps only `args`).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

from tuneloop.server.engine.types import EngineError


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
