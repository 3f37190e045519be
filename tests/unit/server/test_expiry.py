"""Session expiry: a session with no heartbeat or request for the TTL is finished and freed."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.unit.server.harness import (
    Api,
    datum,
    decode_output,
    expect_error,
    sample,
    sample_body,
    sampler,
    serve,
)

TOKENS = [5, 17, 33, 90, 120, 7]


def state_of(api: Api) -> Any:
    transport = api.http._transport
    assert isinstance(transport, httpx.ASGITransport)
    return transport.app.state.tuneloop  # type: ignore[attr-defined]


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@asynccontextmanager
async def beating(api: Api, session_id: str, every_s: float = 0.1) -> AsyncIterator[None]:
    """Heartbeats in the background while the body sets the session up, as the SDKs send
    them: the setup's own time (slow on a loaded machine) must not count as silence."""

    async def beat() -> None:
        while True:
            await api.post("session_heartbeat", {"session_id": session_id})
            await asyncio.sleep(every_s)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def expired(api: Api, session_id: str) -> bool:
    row = state_of(api).registry.session(session_id, "alice")
    return bool(row.finished_at is not None and row.finish_reason == "expired")


async def test_a_silent_session_expires_and_is_freed(tmp_path: Path, db_url: str) -> None:
    async with serve(tmp_path, db_url=db_url, session_ttl_s=1.0, expiry_check_s=0.1) as api:
        state = state_of(api)
        backend = state.engine.backend
        session_id = await api.session()
        async with beating(api, session_id):
            model_id = await api.model(session_id)
            await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
            saved = await api.result(
                await api.post("save_weights", {"model_id": model_id, "path": "w", "seq_id": 2})
            )
            checkpoint = saved.json()["path"]
            snapshot = await api.result(
                await api.post(
                    "save_weights_for_sampler",
                    {"model_id": model_id, "seq_id": 3, "sampling_session_seq_id": 7},
                )
            )
            sampler_id = snapshot.json()["sampling_session_id"]
            # seq 5 waits for a seq 4 that never comes: work left pending when the client
            # vanished.
            pending = await api.forward_backward(model_id, 5, [datum(TOKENS)])
        assert model_id in backend._adapters
        assert sampler_id in backend._samplers
        assert state.futures.pending("alice") == 1

        # No heartbeat and no request on the session: it expires and its memory is freed.
        await until(
            lambda: model_id not in backend._adapters and sampler_id not in backend._samplers
        )
        assert expired(api, session_id)
        assert state.futures.pending("alice") == 0
        failed = await api.result(pending)
        assert failed.json()["category"] == "user"
        assert "expired" in failed.json()["error"]
        assert session_id in failed.json()["error"]

        for gone in (
            await api.post("session_heartbeat", {"session_id": session_id}),
            await api.forward_backward(model_id, 4, [datum(TOKENS)]),
            await api.post("asample", sample_body(sampler_id, TOKENS)),
            await api.post(
                "create_model",
                {"session_id": session_id, "model_seq_id": 1, "base_model": "tuneloop/fake-tiny"},
            ),
        ):
            body = expect_error(gone, 410, "session_id")
            assert "expired" in body["detail"]

        # The checkpoint outlives the session: a new session of the tenant loads it.
        fresh = await api.session()
        loaded = await api.result(
            await api.post(
                "load_weights", {"session_id": fresh, "model_seq_id": 0, "path": checkpoint}
            )
        )
        restored = loaded.json()["model_id"]
        out = await api.result(await api.forward_backward(restored, 1, [datum(TOKENS)]))
        assert decode_output(out.content).metrics["loss:sum"] > 0


async def test_heartbeats_or_requests_keep_a_session_alive(tmp_path: Path) -> None:
    async with serve(tmp_path, session_ttl_s=2.0, expiry_check_s=0.1) as api:
        beating, working, idle = await api.session(), await api.session(), await api.session()
        sampler_id = await sampler(api, working)
        started = time.monotonic()
        while time.monotonic() - started < 4.0:
            beat = await api.post("session_heartbeat", {"session_id": beating})
            assert beat.status_code == 200, beat.text
            await sample(api, sampler_id, TOKENS, max_tokens=2)  # activity without heartbeats
            await asyncio.sleep(0.2)
        assert not expired(api, beating)
        assert not expired(api, working)
        assert expired(api, idle)


async def test_expiry_uses_the_stored_time_across_a_restart(tmp_path: Path, db_url: str) -> None:
    async with serve(tmp_path, db_url=db_url) as api:  # default TTL: minutes
        session_id = await api.session()
        await api.model(session_id)
    await asyncio.sleep(0.6)
    async with serve(tmp_path, db_url=db_url, session_ttl_s=0.5, expiry_check_s=0.1) as api:
        # No request names the session: the new server's sweep finds it in the registry.
        await until(lambda: expired(api, session_id))


async def test_expired_sessions_free_the_session_quota(tmp_path: Path) -> None:
    # A long sweep interval: the quota must not wait for the sweep to see the silence.
    async with serve(tmp_path, max_sessions=1, session_ttl_s=1.0, expiry_check_s=60) as api:
        await api.session()
        body = {"tags": [], "sdk_version": "test"}
        refused = await api.post("create_session", body)
        assert refused.status_code == 429
        # The wait it advertises is no longer than until the silent session expires.
        assert int(refused.headers["retry-after-ms"]) <= 1000
        await asyncio.sleep(1.1)
        assert (await api.post("create_session", body)).status_code == 200


async def test_ttl_zero_never_expires(tmp_path: Path) -> None:
    async with serve(tmp_path, session_ttl_s=0, expiry_check_s=0.05) as api:
        session_id = await api.session()
        state = state_of(api)
        assert await state.expire_idle_sessions() == []
        await asyncio.sleep(0.2)
        assert not expired(api, session_id)


async def test_expiry_frees_torch_adapter_and_sampler_memory(tmp_path: Path) -> None:
    """With the real engine: the LoRA factors and optimizer state of an expired session are
    released (nothing references the tensors any more), not merely forgotten by name."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: no spinning OpenMP workers
    tiny = "tuneloop/tiny-qwen3"
    try:
        async with serve(
            tmp_path,
            backend="torch",
            models=(tiny,),
            device="cpu",
            cache_dir=tmp_path / "cache",
            session_ttl_s=1.0,
            expiry_check_s=0.1,
        ) as api:
            backend = state_of(api).engine.backend
            session_id = await api.session()
            async with beating(api, session_id):
                create = {"session_id": session_id, "model_seq_id": 0, "base_model": tiny}
                create["lora_config"] = {"rank": 4, "seed": 0}
                model_id = (await api.result(await api.post("create_model", create))).json()[
                    "model_id"
                ]
                await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
                step = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}}
                await api.result(await api.post("optim_step", step))
                snapshot = await api.result(
                    await api.post(
                        "save_weights_for_sampler",
                        {"model_id": model_id, "seq_id": 3, "sampling_session_seq_id": 1},
                    )
                )
                sampler_id = snapshot.json()["sampling_session_id"]

            [runtime] = backend._runtimes.values()
            bank = runtime.bank
            tensors = [
                tensor
                for module in bank.modules.values()
                for key in (model_id, sampler_id)
                for tensor in module.factors[key][:2]
            ]
            adamw = backend._adapters[model_id].optimizer._adamw
            optimizer_state = [
                value
                for per_param in adamw.state.values()
                for value in per_param.values()
                if isinstance(value, torch.Tensor) and value.numel() > 1
            ]
            assert optimizer_state  # the step above made Adam's moments
            held = [weakref.ref(t) for t in tensors + optimizer_state]
            held_bytes = sum(t.numel() * t.element_size() for t in tensors + optimizer_state)
            assert held_bytes > 0
            del tensors, optimizer_state, adamw  # the test must not keep them alive itself

            await until(
                lambda: model_id not in backend._adapters and sampler_id not in backend._samplers
            )
            gc.collect()
            assert expired(api, session_id)
            assert model_id not in bank.specs
            assert sampler_id not in bank.specs
            for module in bank.modules.values():
                assert model_id not in module.factors
                assert sampler_id not in module.factors
            alive = [ref for ref in held if ref() is not None]
            assert not alive, f"{len(alive)} of {len(held)} tensors ({held_bytes} bytes) kept"
    finally:
        torch.set_num_threads(threads)


async def test_a_request_on_a_silent_session_expires_it_before_the_sweep(tmp_path: Path) -> None:
    # The sweep runs at start and then not for a minute: the request itself must find the silence.
    async with serve(tmp_path, session_ttl_s=0.5, expiry_check_s=60) as api:
        backend = state_of(api).engine.backend
        session_id = await api.session()
        async with beating(api, session_id):
            model_id = await api.model(session_id)
        await asyncio.sleep(0.7)
        body = expect_error(
            await api.forward_backward(model_id, 1, [datum(TOKENS)]), 410, "session_id"
        )
        assert "expired" in body["detail"]
        assert expired(api, session_id)
        await until(lambda: model_id not in backend._adapters)
