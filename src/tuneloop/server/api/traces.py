"""Per-session request traces: every long operation a session submits (training and sampling),
when it was submitted and when its result was ready; exported as a JSON file in the Trace Event
Format (ui.perfetto.dev and chrome://tracing open it) by `GET /sessions/{id}/trace_export`.

Kept in memory, bounded: the last MAX_REQUESTS requests of each of the last MAX_SESSIONS
sessions that submitted any, since the server started.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from tuneloop.server.scheduler.futures import FutureTable, Outcome

__all__ = ["MAX_REQUESTS", "MAX_SESSIONS", "TraceRecorder", "TracedRequest"]

MAX_REQUESTS = 50_000  # ~10 MB of JSON at most per session
MAX_SESSIONS = 2_048


@dataclass
class TracedRequest:
    request_id: str
    request_type: str  # the X-Tinker-Request-Type names: ForwardBackward, Sample, ...
    target: str  # a training run id or a sampler id
    seq_id: int | None
    submitted_at: float  # wall-clock seconds
    completed_at: float | None = None
    failed: bool = False


@dataclass
class _SessionTrace:
    requests: deque[TracedRequest] = field(default_factory=lambda: deque(maxlen=MAX_REQUESTS))
    dropped: int = 0


class TraceRecorder:
    def __init__(self, futures: FutureTable) -> None:
        self._sessions: OrderedDict[str, _SessionTrace] = OrderedDict()
        self._open: dict[str, TracedRequest] = {}
        futures.listeners.append(self._resolved)

    def submitted(
        self, request_id: str, session_id: str, request_type: str, target: str, seq_id: int | None
    ) -> None:
        trace = self._sessions.get(session_id)
        if trace is None:
            trace = self._sessions[session_id] = _SessionTrace()
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        if len(trace.requests) == MAX_REQUESTS:
            trace.dropped += 1
            self._open.pop(trace.requests[0].request_id, None)
        traced = TracedRequest(request_id, request_type, target, seq_id, time.time())
        trace.requests.append(traced)
        self._open[request_id] = traced

    def _resolved(self, request_id: str, outcome: Outcome) -> None:
        traced = self._open.pop(request_id, None)
        if traced is not None:
            traced.completed_at = time.time()
            traced.failed = outcome.failed

    def export(self, session_id: str, extra: dict[str, Any]) -> dict[str, Any]:
        """The session's trace as a Trace Event Format document, plus a plain `requests` list."""
        trace = self._sessions.get(session_id) or _SessionTrace()
        targets: dict[str, int] = {}
        events: list[dict[str, Any]] = []
        requests: list[dict[str, Any]] = []
        for r in list(trace.requests):
            tid = targets.setdefault(r.target, len(targets) + 1)
            duration = r.completed_at - r.submitted_at if r.completed_at is not None else None
            status = "pending" if duration is None else ("failed" if r.failed else "ok")
            requests.append(
                {
                    "request_id": r.request_id,
                    "type": r.request_type,
                    "target": r.target,
                    "seq_id": r.seq_id,
                    "submitted_at": r.submitted_at,
                    "completed_at": r.completed_at,
                    "duration_s": duration,
                    "status": status,
                }
            )
            events.append(
                {
                    "name": r.request_type,
                    "cat": "sampling" if r.request_type == "Sample" else "training",
                    "ph": "X",
                    "ts": round(r.submitted_at * 1e6),
                    "dur": round((duration or 0.0) * 1e6),
                    "pid": 1,
                    "tid": tid,
                    "args": {"request_id": r.request_id, "seq_id": r.seq_id, "status": status},
                }
            )
        names = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": target}}
            for target, tid in targets.items()
        ]
        return {
            "traceEvents": names + events,
            "displayTimeUnit": "ms",
            "otherData": {**extra, "session_id": session_id, "dropped_requests": trace.dropped},
            "requests": requests,
        }
