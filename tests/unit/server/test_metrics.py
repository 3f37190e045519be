"""GET /metrics: Prometheus text that the official parser reads, counters that move with traffic,
gauges of the server's state, no id in any label, and the scrape token when one is set."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.server.harness import Api, datum, expect_error, sample, sampler, serve

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(api: Api, **headers: str) -> Samples:
    response = await api.http.get("/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_counters_move_with_traffic(tmp_path: Path) -> None:
    async with serve(tmp_path) as api:
        before = await scrape(api)
        session = await api.session()
        model = await api.model(session)
        tokens = [5, 6, 7, 8, 9, 10]  # 5 input tokens are trained
        done = await api.result(await api.forward_backward(model, 1, [datum(tokens)]))
        assert done.status_code == 200
        sampler_id = await sampler(api, session, seq=1)
        result = await sample(api, sampler_id, [1, 2, 3], max_tokens=4, num_samples=2)
        generated = sum(len(s.tokens) for s in result.sequences)
        refusal = await api.post("create_session", {"tags": "not-a-list"})
        assert refusal.status_code == 400
        after = await scrape(api)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    tokens_total = "tuneloop_tokens_total"
    assert moved(tokens_total, token_class="trained", tenant="alice", operation="forward_backward")
    assert (
        moved(tokens_total, token_class="trained", tenant="alice", operation="forward_backward")
        == len(tokens) - 1
    )
    assert moved(tokens_total, token_class="prefill", tenant="alice", operation="sample") == 3
    assert moved(tokens_total, token_class="sampled", tenant="alice", operation="sample") == (
        generated
    )
    assert moved("tuneloop_operations_total", tenant="alice", operation="sample") == 1
    route = {"method": "POST", "route": "/api/v1/forward_backward", "status": "200"}
    assert moved("tuneloop_http_requests_total", **route) == 1
    assert moved("tuneloop_http_request_duration_seconds_count", **route) == 1
    assert moved("tuneloop_http_request_duration_seconds_sum", **route) > 0
    polls = {"method": "POST", "route": "/api/v1/retrieve_future", "status": "200"}
    assert moved("tuneloop_http_requests_total", **polls) >= 3
    refused = [
        k
        for k, v in after.items()
        if k[0] == "tuneloop_http_requests_total"
        and ("route", "/api/v1/create_session") in k[1]
        and dict(k[1])["status"].startswith("4")
    ]
    assert refused, "the refused create_session is counted under its 4xx status"
    assert moved("tuneloop_registry_statement_duration_seconds_count", statement="insert") >= 2
    assert moved("tuneloop_registry_statement_duration_seconds_count", statement="select") >= 1
    assert moved("tuneloop_engine_busy_seconds_total") > 0
    # The fake backend has no KV cache; it says so with zeros.
    assert value(after, "tuneloop_kv_cache_tokens") == 0
    assert ("tuneloop_kv_cache_bytes", ()) in after


async def test_queue_depth_and_futures_in_flight(tmp_path: Path) -> None:
    """A training request that arrives before its predecessor waits in the queue (and its
    future is in flight) until the predecessor comes."""
    async with serve(tmp_path) as api:
        session = await api.session()
        model = await api.model(session)
        early = await api.forward_backward(model, 2, [datum([1, 2, 3])])
        assert early.status_code == 200, early.text
        waiting = await scrape(api)
        depth = {"base_model": "tuneloop/fake-tiny", "kind": "forward_backward"}
        assert value(waiting, "tuneloop_queue_depth", **depth) == 1
        assert value(waiting, "tuneloop_futures_in_flight", tenant="alice") == 1
        await api.result(await api.forward_backward(model, 1, [datum([1, 2, 3])]))
        await api.result(early)
        drained = await scrape(api)
        assert value(drained, "tuneloop_queue_depth", **depth) == 0
        assert value(drained, "tuneloop_futures_in_flight", tenant="alice") == 0


# What an id looks like here: sessions, runs and samplers (uuid-like hex, "...:train:0"),
# request ids (req-...), anything long and hexadecimal.
_ID_LIKE = re.compile(r"[0-9a-f]{8}-|:train:|:sample:|req-|[0-9a-f]{12}")


async def test_no_id_in_any_label(tmp_path: Path) -> None:
    async with serve(tmp_path) as api:
        session = await api.session()
        model = await api.model(session)
        await api.get(f"training_runs/{model}")
        await api.get(f"training_runs/{model}/checkpoints")
        await api.get(f"sessions/{session}")
        await api.get("training_runs/no-such-run-0123456789abcdef")
        await api.http.get("/no/such/path/0123456789abcdef0123", headers=api.headers())
        await api.http.delete("/api/v1/create_session", headers=api.headers())  # a 405
        samples = await scrape(api)
    values = {v for _name, labels in samples for _k, v in labels}
    assert not [v for v in values if _ID_LIKE.search(v)], values
    routes = {dict(labels).get("route") for _name, labels in samples} - {None}
    assert "/api/v1/training_runs/{run_id}" in routes
    assert "unmatched" in routes  # every unknown path under one value
    assert "/api/v1/create_session" in routes  # the 405 is named for the path it asked for
    assert all(r == "unmatched" or r.startswith("/") for r in routes)


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"authorization": "Bearer wrong-token"}, 401),
        ({"authorization": "scrape-secret-1"}, 401),  # not a Bearer header
        ({"authorization": "Bearer scrape-secret-1"}, 200),
    ],
)
async def test_the_scrape_token_is_enforced_when_set(
    tmp_path: Path, headers: dict[str, str], status: int
) -> None:
    async with serve(tmp_path, metrics_token="scrape-secret-1") as api:
        response = await api.http.get("/metrics", headers=headers)
        if status == 401:
            expect_error(response, 401, "authorization")
            # an API key is not a scrape token
            keyed = await api.http.get("/metrics", headers=api.headers())
            expect_error(keyed, 401, "authorization")
        else:
            assert response.status_code == 200
            assert "tuneloop_http_requests_total" in response.text


async def test_each_app_counts_only_its_own_requests(tmp_path: Path) -> None:
    """Per-app registries: a second app in the same process starts from zero."""
    async with serve(tmp_path / "a") as first:
        for _ in range(3):
            await first.session()
        async with serve(tmp_path / "b") as second:
            counted = await scrape(second)
    route = {"method": "POST", "route": "/api/v1/create_session", "status": "200"}
    assert value(counted, "tuneloop_http_requests_total", **route) == 0


def test_a_served_folder_is_labelled_by_its_name() -> None:
    from tuneloop.server.api.metrics import model_label

    assert model_label("tuneloop/tiny-qwen3") == "tuneloop/tiny-qwen3"
    assert (
        model_label("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    folder = "/data/checkpoints/alice/5f0c8a3e-1d2b:train:0/external_weights/w1-merged"
    assert model_label(folder) == "w1-merged"


def test_statement_kinds_are_bounded() -> None:
    from tuneloop.server.api.metrics import statement_kind

    assert statement_kind("  SELECT * FROM sessions") == "select"
    assert statement_kind("INSERT INTO usage VALUES (?)") == "insert"
    assert statement_kind("PRAGMA journal_mode=WAL") == "other"
    assert statement_kind("") == "other"


async def test_the_torch_engine_reports_its_kv_cache_and_queues_per_model(tmp_path: Path) -> None:
    """The real engine (two tiny models): the KV budget is exported, and the cache is empty
    again once sampling is done; sampled tokens are counted; a waiting training request is
    counted under its own base model."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch

    from tuneloop.server.engine.memory import CPU_MAX_KV_TOKENS, CPU_MIN_KV_TOKENS

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: no spinning OpenMP workers
    tiny, llama = "tuneloop/tiny-qwen3", "tuneloop/tiny-llama"
    try:
        async with serve(
            tmp_path,
            backend="torch",
            models=(tiny, llama),
            device="cpu",
            dtype="float32",  # no dtype probe (a child process) for a tiny model
            cache_dir=tmp_path / "cache",
        ) as api:
            session = await api.session()
            sampler_id = await sampler(api, session, base_model=tiny)
            result = await sample(api, sampler_id, [30, 31, 32], num_samples=2, max_tokens=5)
            scraped = await scrape(api)
            create = {"session_id": session, "model_seq_id": 0, "base_model": llama}
            create["lora_config"] = {"rank": 4, "seed": 0}
            model = (await api.result(await api.post("create_model", create))).json()["model_id"]
            early = await api.forward_backward(model, 2, [datum([1, 2, 3])])  # waits for seq 1
            waiting = await scrape(api)
            await api.result(await api.forward_backward(model, 1, [datum([1, 2, 3])]))
            await api.result(early)
    finally:
        torch.set_num_threads(threads)
    budget = value(scraped, "tuneloop_kv_cache_token_budget")  # sized from free memory
    assert CPU_MIN_KV_TOKENS <= budget <= CPU_MAX_KV_TOKENS
    assert budget % 16 == 0
    assert value(scraped, "tuneloop_kv_cache_tokens") == 0
    assert value(scraped, "tuneloop_kv_cache_bytes") == 0
    sampled = sum(len(s.tokens) for s in result.sequences)
    labels = {"token_class": "sampled", "tenant": "alice", "operation": "sample"}
    assert value(scraped, "tuneloop_tokens_total", **labels) == sampled
    assert value(scraped, "tuneloop_queue_depth", base_model=tiny, kind="sample") == 0
    training = {"kind": "forward_backward"}
    assert value(waiting, "tuneloop_queue_depth", base_model=llama, **training) == 1
    assert value(waiting, "tuneloop_queue_depth", base_model=tiny, **training) == 0


async def test_engine_busy_seconds_count_the_work_still_running() -> None:
    """A decode run may last minutes: its time counts while it runs, not only once it ends."""
    import asyncio
    import threading

    from tuneloop.server.engine.fake import FakeBackend
    from tuneloop.server.scheduler.futures import FutureTable
    from tuneloop.server.scheduler.loop import EngineLoop
    from tuneloop.server.scheduler.queue import OperationQueue

    engine = EngineLoop(FakeBackend(), OperationQueue(), FutureTable())
    release = threading.Event()
    running = asyncio.get_running_loop().create_task(engine.call(release.wait, 10.0))
    await asyncio.sleep(0.05)
    first = engine.busy_seconds()
    await asyncio.sleep(0.05)
    second = engine.busy_seconds()
    assert 0 < first < second  # counted while still running
    release.set()
    await running
    done = engine.busy_seconds()
    await asyncio.sleep(0.02)
    assert engine.busy_seconds() == done >= second  # idle: no more time counted
    await engine.stop()
