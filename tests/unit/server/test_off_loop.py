"""No registry statement runs on the event loop during a request (SQLite and PostgreSQL).

Every SQL statement the registry's engine executes is recorded with the thread it ran on, while
a tenant drives the whole training and sampling flow over HTTP; none may have run on the event
loop's thread (where the test and the app run). Finish steps store on a thread too, and their
future still resolves only once the row is there, in the order the engine ran them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event

from tests.unit.server.harness import Api, datum, optim_step, sample_body, sampler
from tuneloop.server.storage.keys import KeyStore

TOKENS = [3, 5, 7, 9, 11]


class Statements:
    """SQL statements of one engine with the thread each ran on, while listening."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seen: list[tuple[threading.Thread, str]] = []

    def _record(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        self.seen.append((threading.current_thread(), statement))

    def __enter__(self) -> Statements:
        event.listen(self.engine, "before_cursor_execute", self._record)
        return self

    def __exit__(self, *_exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._record)

    def on(self, thread: threading.Thread) -> list[str]:
        return [statement for ran_on, statement in self.seen if ran_on is thread]


@pytest.fixture
def statements(server: tuple[Any, KeyStore]) -> Iterator[Statements]:
    app, _keys = server
    with Statements(app.state.tuneloop.registry.engine) as recorded:
        yield recorded


async def test_the_recorder_sees_a_statement_run_on_the_loop(
    server: tuple[Any, KeyStore], statements: Statements
) -> None:
    """The check below can fail: a registry call made on the loop is caught."""
    app, _keys = server
    app.state.tuneloop.registry.session("no-such-session", "alice")
    assert statements.on(threading.current_thread())


async def test_no_registry_statement_runs_on_the_event_loop(
    api: Api, statements: Statements
) -> None:
    loop_thread = threading.current_thread()
    session_id = await api.session()
    assert (await api.post("session_heartbeat", {"session_id": session_id})).status_code == 200
    model_id = await api.model(session_id)
    info = await api.post("get_info", {"model_id": model_id})
    assert info.status_code == 200, info.text
    fwdbwd = await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    assert fwdbwd.status_code == 200, fwdbwd.text
    assert (await optim_step(api, model_id, 2)).status_code == 200
    saved = await api.result(
        await api.post("save_weights", {"model_id": model_id, "seq_id": 3, "path": "w1"})
    )
    path = saved.json()["path"]
    snapshot = await api.result(
        await api.post(
            "save_weights_for_sampler",
            {"model_id": model_id, "seq_id": 4, "sampling_session_seq_id": 7},
        )
    )
    snapshot_id = snapshot.json()["sampling_session_id"]
    from_path = await sampler(api, session_id, seq=1, base_model=None, model_path=path)
    for sampler_id in (snapshot_id, from_path):
        sampled = await api.result(await api.post("asample", sample_body(sampler_id, [1, 2])))
        assert sampled.status_code == 200, sampled.text
    loaded = await api.result(
        await api.post("load_weights", {"model_id": model_id, "seq_id": 5, "path": path})
    )
    assert loaded.status_code == 200, loaded.text
    info = await api.post("weights_info", {"tinker_path": path})
    assert info.status_code == 200, info.text
    assert (await api.get(f"sessions/{session_id}")).status_code == 200
    assert (await api.get("training_runs")).status_code == 200
    finished = await api.post(f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
    assert finished.status_code == 200, finished.text

    on_loop = statements.on(loop_thread)
    assert not on_loop, f"{len(on_loop)} statements ran on the event loop: {on_loop[:5]}"
    # The flow did use the registry (on threads): the check above is not vacuous.
    assert len(statements.seen) >= 20


async def test_a_save_queued_behind_an_optim_step_sees_the_step(
    api: Api, statements: Statements
) -> None:
    """Both finish steps store on the writer thread, in the engine's order: the save's
    package has the step the optim_step counted, and its row exists when its future resolves."""
    session_id = await api.session()
    model_id = await api.model(session_id)
    await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    body = {"model_id": model_id, "adam_params": {"learning_rate": 0.05}}
    pending = await asyncio.gather(
        api.post("optim_step", {**body, "seq_id": 2}),
        api.post("save_weights", {"model_id": model_id, "seq_id": 3, "path": "after"}),
    )
    for response in pending:
        assert (await api.result(response)).status_code == 200
    listed = await api.get(f"training_runs/{model_id}/checkpoints")
    (checkpoint,) = listed.json()["checkpoints"]
    assert checkpoint["training_step"] == 1
    assert not statements.on(threading.current_thread())
