"""The operator view's engine state from the real accessors: the batch on the engine and the
training operations waiting (a fake backend held mid-batch), and the torch engine's KV-cache use
while a decode batch runs."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.unit.server.harness import MODEL, Api, datum
from tuneloop.server.app import create_app
from tuneloop.server.config import ServerConfig
from tuneloop.server.engine.fake import FakeBackend
from tuneloop.server.engine.types import ForwardBackwardWork, SampleWork
from tuneloop.server.storage.keys import KeyStore

TOKENS = [5, 17, 33, 90, 120, 7]


class HeldFake(FakeBackend):
    """A fake backend whose forward_backward waits until released (at most 30 s)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward_backward(self, batch: Sequence[ForwardBackwardWork]) -> list[Any]:
        self.entered.set()
        self.release.wait(30)
        return super().forward_backward(batch)


async def test_the_running_batch_and_waiting_operations_are_shown(tmp_path: Path) -> None:
    backend = HeldFake()
    config = ServerConfig(data_dir=tmp_path, long_poll_s=1.0, backend="fake")
    app = create_app(config, backend=backend)
    async with app.router.lifespan_context(app):
        keys = KeyStore(tmp_path / "keys.json")
        key, _ = keys.create("alice")
        admin, _ = keys.create("ops", admin=True)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tuneloop") as http:
            api = Api(http, key, keys)
            model_id = await api.model(await api.session())
            pending = await api.forward_backward(model_id, 1, [datum(TOKENS)])
            optim = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.1}}
            stepped = await api.post("optim_step", optim)
            assert stepped.status_code == 200
            assert await _wait(backend.entered)
            signed = await http.post("/console/sign-in", data={"api_key": admin})
            assert signed.status_code == 303
            held = (await http.get("/console/data/engine")).json()
            backend.release.set()
            assert held["running"] == {"kind": "forward_backward", "operations": 1}
            assert held["training_waiting_by_run"] == {model_id: 1}  # the optim_step
            assert held["training_waiting_by_model"] == {MODEL: 1}
            assert (await api.result(pending)).status_code == 200
            assert (await api.result(stepped)).status_code == 200
            page = await http.get("/console/fragments/operator")
            assert page.status_code == 200
            assert "<dt>Running batch</dt><dd>idle</dd>" in page.text
            done = (await http.get("/console/data/engine")).json()
            assert done["running"] is None
            assert done["tokens_per_s"]["trained"] > 0


async def _wait(event: threading.Event) -> bool:
    return await asyncio.to_thread(event.wait, 30)


def test_kv_cache_use_while_a_decode_batch_runs(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tuneloop.server.engine.torch_backend import TorchBackend

    backend = TorchBackend(["tuneloop/tiny-qwen3"], cache_dir=tmp_path / "cache", device="cpu")
    try:
        backend.create_sampler("s", "tuneloop/tiny-qwen3")
        assert backend.kv_cache_use().tokens == 0
        assert backend.kv_cache_use().token_budget > 0  # the pool's size before it is made

        def work(length: int, max_tokens: int) -> SampleWork:
            tokens = np.arange(1, length + 1, dtype=np.int64)
            return SampleWork("s", tokens, 1, max_tokens, 1.0, -1, 1.0, 0, (), ())

        short, long = work(4, 2), work(6, 12)
        seen: dict[int, int] = {}
        backend.sample_continuous(
            [short, long], list, lambda w, _r: seen.update({id(w): backend.kv_cache_use().tokens})
        )
        # When the short request is answered the long one still holds its cache rows.
        assert seen[id(short)] >= len(long.prompt)
        assert backend.kv_cache_use().tokens == 0  # none after the decode run
    finally:
        backend.close()


@pytest.mark.slow
def test_worker_group_health_and_restarts(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tuneloop.server.api.console.engine_state import worker_group_state
    from tuneloop.server.engine.workers.build import worker_group

    group = worker_group(
        ("tuneloop/tiny-qwen3",), workers=1, cache_dir=tmp_path / "cache", device="cpu"
    )
    try:
        first = worker_group_state(group)
        assert first is not None
        assert (first.workers, first.alive, first.restarts, first.generation) == (1, 1, 0, 1)
        os.kill(first.pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        state = first
        while time.monotonic() < deadline:  # the watchdog restarts the group between calls
            state = worker_group_state(group)
            if state is not None and state.restarts == 1:
                break
            time.sleep(0.2)
        assert state is not None
        assert (state.restarts, state.generation, state.alive) == (1, 2, 1)
        assert state.pids != first.pids
        assert state.last_recovery_s is not None
    finally:
        group.close()
    assert worker_group_state(object()) is None  # a backend without workers
