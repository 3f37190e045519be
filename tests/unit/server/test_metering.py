"""Token metering: prefill / sampled / trained counts equal the tokens sent and generated, per
operation, session, training run and tenant, in hour and day buckets; failed or rejected work
costs nothing; counts survive restarts and failed writes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.unit.server.harness import Api, datum, expect_error, optim_step, sample, sampler, serve
from tuneloop.server.api.metering import Meter, hour_of
from tuneloop.server.app import create_app
from tuneloop.server.config import ServerConfig
from tuneloop.server.engine.fake import FakeBackend
from tuneloop.server.engine.types import (
    EngineError,
    ForwardBackwardResult,
    ForwardBackwardWork,
    SampleResult,
    SampleWork,
)
from tuneloop.server.storage.keys import KeyStore
from tuneloop.server.storage.registry import Registry, UsageCount, UsageFilter
from tuneloop.types import Datum

NONE = {"prefill_tokens": 0, "sampled_tokens": 0, "trained_tokens": 0, "requests": 0}


def counts(prefill: int = 0, sampled: int = 0, trained: int = 0, requests: int = 0) -> Any:
    return {
        "prefill_tokens": prefill,
        "sampled_tokens": sampled,
        "trained_tokens": trained,
        "requests": requests,
    }


async def usage(api: Api, **params: Any) -> dict[str, Any]:
    response = await api.get("usage", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def input_tokens(data: Sequence[Datum]) -> int:
    """What the client sent: the length of every datum's model_input."""
    return sum(d.model_input.length for d in data)


async def test_token_classes_equal_the_tokens_sent_and_generated(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    trained = [datum([1, 2, 3, 4, 5, 6]), datum([7, 8, 9, 10])]
    forward = [datum([3, 4, 5]), datum([6, 7, 8, 9, 10, 11, 12])]
    await api.result(await api.forward_backward(model_id, 1, trained))
    await api.result(await api.forward_backward(model_id, 2, forward, forward_only=True))
    await optim_step(api, model_id, 3)  # no tokens: optim_step is not metered
    sampler_id = await sampler(api, session_id)
    prompts = [[11, 12, 13, 14], [20, 21]]
    generated = 0
    for tokens, n in zip(prompts, (3, 2), strict=True):
        response = await sample(api, sampler_id, tokens, num_samples=n, max_tokens=4)
        generated += sum(len(s.tokens) for s in response.sequences)
    assert generated > 0
    prefill_sample = sum(len(p) for p in prompts)  # each prompt is prefilled once

    body = await usage(api, session_id=session_id)
    assert (body["tenant"], body["session_id"], body["bucket"]) == ("alice", session_id, "none")
    assert body["by_operation"] == {
        "forward_backward": counts(trained=input_tokens(trained), requests=1),
        "forward": counts(prefill=input_tokens(forward), requests=1),
        "sample": counts(prefill=prefill_sample, sampled=generated, requests=2),
    }
    assert input_tokens(trained) == 5 + 3  # datum() feeds tokens[:-1]
    assert body["totals"] == counts(
        prefill=input_tokens(forward) + prefill_sample,
        sampled=generated,
        trained=input_tokens(trained),
        requests=4,
    )
    assert body["buckets"] == []
    assert (await usage(api))["totals"] == body["totals"]  # the tenant's only session

    run = await usage(api, training_run_id=model_id)
    assert run["training_run_id"] == model_id
    assert run["totals"] == counts(
        prefill=input_tokens(forward), trained=input_tokens(trained), requests=2
    )
    of_sampler = await usage(api, training_run_id=sampler_id)
    assert of_sampler["totals"] == counts(prefill=prefill_sample, sampled=generated, requests=2)


class FailingBackend(FakeBackend):
    """Fails, inside the engine, every forward_backward whose first token is 13 and every sample
    whose prompt starts with 13: work that was accepted and then failed."""

    def forward_backward(
        self, batch: Sequence[ForwardBackwardWork]
    ) -> list[ForwardBackwardResult | EngineError]:
        results = super().forward_backward(batch)
        return [
            EngineError("poisoned", "user") if int(w.examples[0].tokens[0]) == 13 else r
            for w, r in zip(batch, results, strict=True)
        ]

    def sample(self, batch: Sequence[SampleWork]) -> list[SampleResult | EngineError]:
        results = super().sample(batch)
        return [
            EngineError("poisoned", "user") if int(w.prompt[0]) == 13 else r
            for w, r in zip(batch, results, strict=True)
        ]


@contextlib.asynccontextmanager
async def failing_server(tmp_path: Path) -> AsyncIterator[Api]:
    config = ServerConfig(data_dir=tmp_path, long_poll_s=1.0, backend="fake")
    app = create_app(config, backend=FailingBackend())
    async with app.router.lifespan_context(app):
        keys = KeyStore(tmp_path / "keys.json")
        key, _ = keys.create("alice")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tuneloop") as http:
            yield Api(http, key, keys)


async def test_failed_and_rejected_requests_cost_nothing(tmp_path: Path) -> None:
    async with failing_server(tmp_path) as api:
        session_id = await api.session()
        model_id = await api.model(session_id)
        rejected = await api.forward_backward(model_id, 1, [datum([1, 300000, 2])])
        expect_error(rejected, 400, "data[0].model_input")
        failed = await api.result(await api.forward_backward(model_id, 2, [datum([13, 1, 2])]))
        assert failed.json()["error"] == "poisoned" or "poisoned" in failed.text
        await api.result(await api.forward_backward(model_id, 3, [datum([1, 2, 3])]))
        sampler_id = await sampler(api, session_id)
        bad_sample = await api.post(
            "asample",
            {
                "sampling_session_id": sampler_id,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 999999]}]},
                "sampling_params": {"max_tokens": 2},
            },
        )
        assert bad_sample.status_code == 400
        failed_sample = await api.result(
            await api.post(
                "asample",
                {
                    "sampling_session_id": sampler_id,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [13, 5, 6]}]},
                    "sampling_params": {"max_tokens": 3},
                },
            )
        )
        assert "poisoned" in failed_sample.text
        body = await usage(api)
        assert body["totals"] == counts(trained=2, requests=1)
        assert body["by_operation"]["sample"] == NONE


async def test_usage_is_tenant_scoped(api: Api, other_tenant: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    await api.result(await api.forward_backward(model_id, 1, [datum([1, 2, 3])]))
    body = expect_error(
        await other_tenant.get("usage", params={"session_id": session_id}), 404, "session_id"
    )
    assert body["type"] == "not_found"
    expect_error(
        await other_tenant.get("usage", params={"training_run_id": model_id}),
        404,
        "training_run_id",
    )
    expect_error(await api.get("usage", params={"session_id": "nope"}), 404, "session_id")
    assert (await usage(other_tenant))["totals"] == NONE
    assert (await usage(other_tenant))["tenant"] == "bob"
    assert (await usage(api))["totals"] == counts(trained=2, requests=1)
    unauthenticated = await api.http.get("/api/v1/usage")
    assert unauthenticated.status_code == 401


async def test_hour_and_day_buckets_and_time_ranges(api: Api, server: Any) -> None:
    app, _keys = server
    meter: Meter = app.state.tuneloop.meter
    session_id = await api.session()
    model_id = await api.model(session_id)
    times = [
        datetime(2025, 3, 1, 10, 5, tzinfo=UTC),
        datetime(2025, 3, 1, 10, 55, tzinfo=UTC),
        datetime(2025, 3, 1, 11, 0, tzinfo=UTC),
        datetime(2025, 3, 2, 9, 30, tzinfo=UTC),
    ]
    for seq, (when, length) in enumerate(zip(times, (2, 3, 4, 5), strict=True), start=1):
        meter.clock = lambda when=when: when
        data = [datum(list(range(1, length + 2)))]
        await api.result(await api.forward_backward(model_id, seq, data))

    hourly = await usage(api, bucket="hour")
    assert [(b["start"], b["totals"]["trained_tokens"]) for b in hourly["buckets"]] == [
        ("2025-03-01T10:00:00Z", 5),
        ("2025-03-01T11:00:00Z", 4),
        ("2025-03-02T09:00:00Z", 5),
    ]
    assert hourly["buckets"][0]["by_operation"]["forward_backward"] == counts(trained=5, requests=2)
    daily = await usage(api, bucket="day", session_id=session_id)
    assert [(b["start"], b["totals"]["requests"]) for b in daily["buckets"]] == [
        ("2025-03-01T00:00:00Z", 3),
        ("2025-03-02T00:00:00Z", 1),
    ]
    assert daily["totals"] == counts(trained=14, requests=4)
    # Whole hours: 10:30 includes the 10:00 hour; until is exclusive at an hour boundary.
    ranged = await usage(api, since="2025-03-01T10:30:00Z", until="2025-03-01T11:00:00")
    assert ranged["totals"] == counts(trained=5, requests=2)
    assert ranged["since"] == "2025-03-01T10:30:00Z"
    assert (await usage(api, since="2025-03-02"))["totals"]["trained_tokens"] == 5
    assert (await usage(api, since="24h"))["totals"] == NONE  # all of it is long ago

    expect_error(await api.get("usage", params={"bucket": "week"}), 400, "bucket")
    expect_error(await api.get("usage", params={"since": "yesterday"}), 400, "since")
    expect_error(await api.get("usage", params={"until": "2025-13-01"}), 400, "until")


async def test_counts_survive_a_restart_on_the_same_database(tmp_path: Path) -> None:
    async with serve(tmp_path) as api:
        session_id = await api.session()
        model_id = await api.model(session_id)
        await api.result(await api.forward_backward(model_id, 1, [datum([1, 2, 3, 4])]))
        # No usage read here: the shutdown itself must write the counts still in memory.
    async with serve(tmp_path) as api:
        assert (await usage(api, session_id=session_id))["totals"] == counts(trained=3, requests=1)
        model_id = await api.model(await api.session())
        await api.result(await api.forward_backward(model_id, 1, [datum([5, 6])]))
        assert (await usage(api))["totals"] == counts(trained=4, requests=2)  # accumulates


async def test_finishing_a_session_writes_its_usage(api: Api, server: Any) -> None:
    app, _keys = server
    state = app.state.tuneloop
    session_id = await api.session()
    model_id = await api.model(session_id)
    await api.result(await api.forward_backward(model_id, 1, [datum([1, 2, 3])]))
    finished = await api.post(f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
    assert finished.status_code == 200, finished.text
    sums = state.registry.usage_sums(UsageFilter("alice", session_id))
    assert [(s.operation, s.trained_tokens, s.requests) for s in sums] == [
        ("forward_backward", 2, 1)
    ]


async def test_background_flush_writes_counts(tmp_path: Path) -> None:
    registry = Registry(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    meter = Meter()
    meter.add("t", "s", "s:train:0", "forward_backward", trained=7)
    meter.add("t", "s", "s:train:0", "forward_backward", trained=3)
    task = asyncio.get_running_loop().create_task(meter.run_flusher(registry, interval_s=0.01))
    try:
        for _ in range(200):
            if registry.usage_sums(UsageFilter("t")):
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    [total] = registry.usage_sums(UsageFilter("t"))
    assert (total.operation, total.trained_tokens, total.requests) == ("forward_backward", 10, 2)
    assert registry.usage_sums(UsageFilter("other")) == []
    registry.close()


def test_a_failed_write_keeps_the_counts(tmp_path: Path) -> None:
    class Broken(Registry):
        def add_usage(self, counts: Any) -> None:
            raise OSError("disk full")

    broken = Broken(f"sqlite:///{tmp_path / 'broken.sqlite3'}")
    when = datetime(2025, 1, 1, 8, 30, tzinfo=UTC)
    meter = Meter(clock=lambda: when)
    meter.add("t", "s", "m", "forward", prefill=5)
    meter.clock = lambda: when + timedelta(hours=1)  # a retry later keeps the original hour
    with pytest.raises(OSError, match="disk full"):
        meter.flush(broken)
    broken.close()
    registry = Registry(f"sqlite:///{tmp_path / 'ok.sqlite3'}")
    assert meter.flush(registry) == 1
    assert meter.flush(registry) == 0  # drained
    registry.add_usage([UsageCount("t", hour_of(when), "s", "m", "forward", 1, 0, 0, 1)])
    [total] = registry.usage_sums(UsageFilter("t", "s"))
    assert (total.hour, total.prefill_tokens, total.requests) == (hour_of(when), 6, 2)
    registry.close()


async def test_counts_equal_the_tokens_with_the_torch_engine(tmp_path: Path) -> None:
    """The real engine with the tiny model: several samples decoded together (continuous
    batching), a training step and a forward pass are metered exactly as sent and generated."""
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
            dtype="float32",  # no dtype probe (a child process) for a tiny model
            cache_dir=tmp_path / "cache",
        ) as api:
            session_id = await api.session()
            create = {"session_id": session_id, "model_seq_id": 0, "base_model": tiny}
            create["lora_config"] = {"rank": 4, "seed": 0}
            model_id = (await api.result(await api.post("create_model", create))).json()["model_id"]
            trained = [datum([5, 6, 7, 8, 9, 10, 11]), datum([12, 13, 14, 15])]
            forward = [datum([20, 21, 22, 23, 24])]
            await api.result(await api.forward_backward(model_id, 1, trained))
            await api.result(await api.forward_backward(model_id, 2, forward, forward_only=True))
            sampler_id = await sampler(api, session_id, base_model=tiny)
            prompts = [[30, 31, 32], [40, 41, 42, 43, 44, 45], [50]]
            responses = await asyncio.gather(
                *(
                    sample(api, sampler_id, p, num_samples=n, max_tokens=6, temperature=1.0, seed=n)
                    for p, n in zip(prompts, (2, 1, 3), strict=True)
                )
            )
            generated = sum(len(s.tokens) for r in responses for s in r.sequences)
            assert generated > 0
            body = await usage(api, session_id=session_id)
    finally:
        torch.set_num_threads(threads)
    assert body["by_operation"] == {
        "forward_backward": counts(trained=input_tokens(trained), requests=1),
        "forward": counts(prefill=input_tokens(forward), requests=1),
        "sample": counts(prefill=sum(map(len, prompts)), sampled=generated, requests=3),
    }
