"""The server builds its backend on the engine thread and calls it only there.

torch's OpenMP runtime keeps a pool of worker threads per thread that runs parallel kernels;
with two such threads in one process (a model loaded on one, run on another) its idle workers
stop spinning and every operation waits for them to wake (scheduler/loop.py's engine_thread).
A recording fake backend notes the thread of its construction and of every call while a tenant
trains and samples over HTTP.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.unit.server.harness import Api, datum, optim_step, sample_body
from tuneloop.server import app as app_module
from tuneloop.server.config import ServerConfig
from tuneloop.server.engine.fake import FakeBackend
from tuneloop.server.storage.keys import KeyStore

TOKENS = [3, 5, 7, 9, 11]


class RecordingBackend(FakeBackend):
    """FakeBackend noting the thread of its construction and of each method call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, threading.Thread]] = [("__init__", threading.current_thread())]
        super().__init__()

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if callable(value) and not name.startswith("_") and name != "calls":
            self.calls.append((name, threading.current_thread()))
        return value


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[RecordingBackend]:
    """Every backend `create_app` builds, as a RecordingBackend."""
    made: list[RecordingBackend] = []

    def build(config: ServerConfig) -> RecordingBackend:
        made.append(RecordingBackend())
        return made[-1]

    monkeypatch.setattr(app_module, "build_backend", build)
    return made


async def test_the_backend_is_built_and_called_on_the_engine_thread(
    tmp_path: Path, built: list[RecordingBackend]
) -> None:
    app = app_module.create_app(ServerConfig(data_dir=tmp_path, long_poll_s=1.0, backend="fake"))
    (backend,) = built
    engine_thread = backend.calls[0][1]
    assert engine_thread is not threading.current_thread()
    assert engine_thread.name.startswith("engine")

    async with app.router.lifespan_context(app):
        key, _ = KeyStore(tmp_path / "keys.json").create("alice")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tuneloop") as http:
            api = Api(http, key, KeyStore(tmp_path / "keys.json"))
            session_id = await api.session()
            model_id = await api.model(session_id)
            done = await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
            assert done.status_code == 200, done.text
            assert (await optim_step(api, model_id, 2)).status_code == 200
            snapshot = await api.result(
                await api.post(
                    "save_weights_for_sampler",
                    {"model_id": model_id, "seq_id": 3, "sampling_session_seq_id": 7},
                )
            )
            sampler_id = snapshot.json()["sampling_session_id"]
            sampled = await api.result(await api.post("asample", sample_body(sampler_id, [1, 2])))
            assert sampled.status_code == 200, sampled.text

        work = {"forward_backward", "optim_step", "sample", "sample_continuous"}
        ran = [(name, thread) for name, thread in backend.calls if name in work]
        assert {"forward_backward", "optim_step"} <= {name for name, _ in ran}
        elsewhere = [(name, thread.name) for name, thread in ran if thread is not engine_thread]
        assert not elsewhere, f"backend work off the thread that built it: {elsewhere}"

    # A second start of the same app gets a live engine thread of its own.
    async with app.router.lifespan_context(app):
        state = app.state.tuneloop
        again = await state.engine.call(threading.current_thread)
        assert again is not engine_thread
        assert again.is_alive()


def test_a_worker_group_is_built_on_the_callers_thread(
    tmp_path: Path, built: list[RecordingBackend]
) -> None:
    """A group's processes run the model; the group itself is made where Ray, when it places
    them, can install its signal handlers (the main thread of `tuneloop serve`)."""
    for settings in ({"workers": 2}, {"ray_address": "local"}):
        app_module.create_app(ServerConfig(data_dir=tmp_path, backend="torch", **settings))
        assert built[-1].calls[0][1] is threading.current_thread()
    assert len(built) == 2
