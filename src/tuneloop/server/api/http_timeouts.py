"""Read timeouts for half-sent requests, which uvicorn does not have.

uvicorn closes idle keep-alive connections, but a client that sends part of a request's
headers, or headers and part of the body, holds its connection (and a slot of the server's
connection limit) for as long as it likes. The protocol below closes such a connection:

- the headers of a request must be complete within `header_timeout_s` of the connection's
  start (or of the previous response), however slowly their bytes trickle in;
- while the body is being received, `body_timeout_s` may pass at most between two reads.

Once a request is complete the handler may take as long as it needs (long-polls, streams).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# nginx's client_header_timeout / client_body_timeout are 60 s; requests here come from
# programs, not people on slow links, so a few seconds of headers is generous.
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0


class TimedH11Protocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading_body = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:  # progress on the body: the next read has its own bound
            self._reading_body = True
            self._arm(self.body_timeout_s)
        elif state is not h11.IDLE:  # the request is complete: the handler takes its time
            self._cancel()
        elif self._reading_body:  # a pipelined next request: its headers start now
            self._reading_body = False
            self._arm(self.header_timeout_s)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._reading_body = False
            self._arm(self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._cancel()
        self._read_timer = self.loop.call_later(seconds, self._expire)

    def _cancel(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _expire(self) -> None:
        self._read_timer = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            # As uvicorn's own keep-alive timeout does; a handler reading the body sees a
            # disconnect.
            self.transport.close()


def timed_protocol(header_timeout_s: float, body_timeout_s: float) -> type[TimedH11Protocol]:
    """The protocol class for uvicorn's `http` setting, with these bounds."""
    return type(
        "TimedH11Protocol",
        (TimedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )


__all__ = ["BODY_TIMEOUT_S", "HEADER_TIMEOUT_S", "TimedH11Protocol", "timed_protocol"]
