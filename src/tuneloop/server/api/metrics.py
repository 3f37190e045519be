"""Prometheus metrics: what the server counts, and `/metrics` in the text exposition format.

Each app has its own `CollectorRegistry` (tests build many apps in one process; the library's
global registry would mix their counts). Two kinds of metric:
- counted as things happen: HTTP requests (by route template, never the raw path, so no id
  reaches a label), metered tokens, registry statement times (SQLAlchemy cursor events on the
  registry's engine, so no storage code changes);
- read at scrape time from the server's state (`_StateCollector`): futures in flight, queue
  depth, engine busy seconds, KV-cache use, worker restarts.

Label values are bounded: methods, route templates, status codes, tenant names, base-model
names, operation and token-class names. Rates (tokens/s, busy fraction) are the scraper's job:
`rate(tuneloop_tokens_total[1m])`, `rate(tuneloop_engine_busy_seconds_total[1m])`.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterator
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from sqlalchemy import event

from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.metering import TOKEN_CLASSES, Completed
from tuneloop.server.engine.backend import ReportsKVCache

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from tuneloop.server.api.state import ServerState

__all__ = ["METRICS_PATH", "Metrics", "router"]

METRICS_PATH = "/metrics"
# Seconds: from a cached health check (~1 ms) to a held retrieve_future poll (30 s by default)
# and a long streamed completion.
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Seconds: a SQLite read is ~0.1 ms, a PostgreSQL round trip ~1 ms, a busy database far more.
DB_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_STATEMENTS = frozenset({"select", "insert", "update", "delete", "begin", "commit"})
# Base models of the training runs and samplers seen queued (ids never change their model):
# bounded, so a long-running server does not keep every id it ever saw.
_BASE_MODEL_CACHE = 4096


@runtime_checkable
class _WorkerGroup(Protocol):
    """What a worker-group backend tells (engine/workers/group.py)."""

    restarts: int

    @property
    def size(self) -> int: ...


class Metrics:
    """One app's metrics. `attach(state)` once the server state exists (the app's lifespan)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tuneloop_http_requests",
            "HTTP requests answered, by method, route template and status code.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "tuneloop_http_request_duration_seconds",
            "Seconds from a request's arrival to the end of its response (long polls and "
            "streams included), by method, route template and status code.",
            ["method", "route", "status"],
            buckets=HTTP_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "tuneloop_tokens",
            "Metered tokens of completed work, by token class (prefill, sampled, trained), "
            "tenant and operation; rate() gives tokens per second.",
            ["token_class", "tenant", "operation"],
            registry=self.registry,
        )
        self.operations = Counter(
            "tuneloop_operations",
            "Metered operations completed (forward_backward, forward, sample), by tenant.",
            ["tenant", "operation"],
            registry=self.registry,
        )
        self.registry_latency = Histogram(
            "tuneloop_registry_statement_duration_seconds",
            "Seconds per SQL statement the registry runs, by statement kind.",
            ["statement"],
            buckets=DB_BUCKETS,
            registry=self.registry,
        )
        # (method, route template, status) -> its counter and histogram children (bounded: the
        # label values are).
        self._request_children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self._state_collector = _StateCollector()
        self.registry.register(self._state_collector)

    def attach(self, state: ServerState) -> None:
        """Read the live gauges from `state` (set once the app's lifespan built it)."""
        self._state_collector.state = state

    def watch_database(self, engine: Engine) -> None:
        """Time every statement on `engine` (SQLAlchemy cursor events; any thread)."""

        @event.listens_for(engine, "before_cursor_execute")
        def _before(conn: Any, _cursor: Any, _sql: str, *_args: Any) -> None:
            conn.info.setdefault("tuneloop_started", []).append(time.perf_counter())

        @event.listens_for(engine, "after_cursor_execute")
        def _after(conn: Any, _cursor: Any, sql: str, *_args: Any) -> None:
            started = conn.info.get("tuneloop_started")
            if not started:
                return
            took = time.perf_counter() - started.pop()
            self.registry_latency.labels(statement_kind(sql)).observe(took)

        @event.listens_for(engine, "handle_error")
        def _failed(context: Any) -> None:  # a failed statement gets no after_cursor_execute
            started = (
                context.connection.info.get("tuneloop_started") if context.connection else None
            )
            if started:
                started.pop()

    def count_request(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        children = self._request_children.get(key)
        if children is None:  # labels() takes a lock and builds the key: once per label set
            labels = (method, route, str(status))
            children = (self.requests.labels(*labels), self.latency.labels(*labels))
            self._request_children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def count_completed(self, tenant: str | None, usage: Completed | None) -> None:
        """Count a completed operation's tokens (the engine loop's success hook)."""
        if tenant is None or usage is None:
            return
        for token_class, tokens in zip(
            TOKEN_CLASSES, (usage.prefill, usage.sampled, usage.trained), strict=True
        ):
            if tokens:
                self.tokens.labels(token_class, tenant, usage.operation).inc(tokens)
        self.operations.labels(tenant, usage.operation).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def model_label(name: str) -> str:
    """A base model's label: its name, or a served folder's own name (`tuneloop deploy` serves
    a path, which under the data dir holds a tenant and a run id)."""
    return PurePath(name).name if PurePath(name).is_absolute() else name


def statement_kind(sql: str) -> str:
    """The statement's first word, lower case, if a common one (bounded label values)."""
    word = sql.lstrip().split(None, 1)[0].lower() if sql.strip() else ""
    return word if word in _STATEMENTS else "other"


class _StateCollector(Collector):
    """The gauges and counters read from the server's state at scrape time."""

    def __init__(self) -> None:
        self.state: ServerState | None = None
        self._base_models: dict[str, str] = {}

    def collect(self) -> Iterator[Metric]:
        state = self.state
        if state is None:  # before the lifespan started (or a describe() call)
            return
        in_flight = GaugeMetricFamily(
            "tuneloop_futures_in_flight",
            "Requests submitted and without a result yet, by tenant.",
            labels=["tenant"],
        )
        for tenant, pending in sorted(state.futures.in_flight().items()):
            in_flight.add_metric([tenant], pending)
        yield in_flight
        yield self._queue_depth(state)
        busy = CounterMetricFamily(
            "tuneloop_engine_busy_seconds",
            "Seconds the engine thread spent running backend work; rate() is the busy "
            "fraction (1 = never idle).",
        )
        busy.add_metric([], state.engine.busy_seconds())
        yield busy
        backend = state.engine.backend
        if isinstance(backend, ReportsKVCache):
            use = backend.kv_cache_use()
            for name, doc, value in (
                ("tokens", "KV-cache tokens held by running decode batches.", use.tokens),
                ("token_budget", "The most KV-cache tokens one decode run may hold.",
                 use.token_budget),
                ("bytes", "Memory of the KV-cache tokens held (keys and values, all layers).",
                 use.bytes),
            ):  # fmt: skip
                gauge = GaugeMetricFamily(f"tuneloop_kv_cache_{name}", doc)
                gauge.add_metric([], value)
                yield gauge
        if isinstance(backend, _WorkerGroup):
            restarts = CounterMetricFamily(
                "tuneloop_worker_restarts",
                "Times the engine's worker group was restarted after a worker died.",
            )
            restarts.add_metric([], backend.restarts)
            yield restarts
            workers = GaugeMetricFamily("tuneloop_workers", "Engine worker processes.")
            workers.add_metric([], backend.size)
            yield workers

    def _queue_depth(self, state: ServerState) -> Metric:
        depth = GaugeMetricFamily(
            "tuneloop_queue_depth",
            "Operations waiting for the engine, by base model and kind (forward_backward, "
            "single: optim_step, save, load, create; sample).",
            labels=["base_model", "kind"],
        )
        counts: dict[tuple[str, str], int] = {(m, "sample"): 0 for m in state.models}
        counts |= {(m, "forward_backward"): 0 for m in state.models}
        for op in state.queue.queued():
            key = op.model_id or getattr(op.work, "sampler_id", None) or ""
            model = self._base_model(state, key, op.request_id)
            counts[(model, op.kind)] = counts.get((model, op.kind), 0) + 1
        for (model, kind), n in sorted(counts.items()):
            depth.add_metric([model_label(model), kind], n)
        return depth

    def _base_model(self, state: ServerState, run_or_sampler: str, request_id: str) -> str:
        if len(state.models) == 1:
            return next(iter(state.models))
        model = self._base_models.get(run_or_sampler)
        if model is not None:
            return model
        tenant = state.futures.tenant(request_id) or ""
        run = state.registry.training_run(run_or_sampler, tenant)
        sampler = None if run is not None else state.registry.sampler(run_or_sampler, tenant)
        row = run or sampler
        if row is None:
            return "unknown"
        if len(self._base_models) >= _BASE_MODEL_CACHE:
            self._base_models.clear()
        self._base_models[run_or_sampler] = row.base_model
        return row.base_model


router = APIRouter()


@router.get(METRICS_PATH, include_in_schema=False)
async def metrics(request: Request) -> Response:
    """The server's metrics in the Prometheus text format; with a scrape token configured,
    only for `Authorization: Bearer <token>`."""
    config = request.app.state.tuneloop.config
    token = config.metrics_token
    if token:
        auth = request.headers.get("authorization", "")
        given = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise ApiError(
                401, "metrics need the scrape token: Authorization: Bearer <token>",
                "authorization",
            )  # fmt: skip
    registry: Metrics = request.app.state.metrics
    return Response(registry.exposition(), media_type=CONTENT_TYPE_LATEST)
