"""Per-tenant quotas: live sessions and requests in flight, answered with a retryable 429."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.unit.server.harness import (
    Api,
    datum,
    decode_output,
    optim_step,
    sample_body,
    sampler,
    serve,
)
from tuneloop.server.config import ServerConfig
from tuneloop.server.storage.limits import LimitStore, TenantLimits

TOKENS = [5, 17, 33, 90, 120, 7]


def expect_quota(response: httpx.Response, limit: str, value: int) -> dict[str, Any]:
    """A 429 that names the limit and its value, and tells the SDKs when to retry."""
    assert response.status_code == 429, response.text
    body: dict[str, Any] = response.json()
    assert body["type"] == "rate_limited"
    assert body["limit"] == limit
    assert body["field"] == limit
    assert body["value"] == value
    assert limit in body["detail"]
    assert str(value) in body["detail"]
    assert response.headers["x-should-retry"] == "true"
    seconds = int(response.headers["retry-after"])
    millis = int(response.headers["retry-after-ms"])
    assert 1 <= seconds <= 30
    assert 1000 <= millis <= 30_000
    assert seconds * 1000 >= millis  # whole seconds, rounded up
    return body


def app_of(api: Api) -> Any:
    transport = api.http._transport
    assert isinstance(transport, httpx.ASGITransport)
    return transport.app


async def other(api: Api, tenant: str) -> Api:
    """Another tenant on the same in-process server."""
    key, _ = api.keys.create(tenant)
    return Api(api.http, key, api.keys)


async def test_session_limit_answers_429_until_one_finishes(tmp_path: Path, db_url: str) -> None:
    async with serve(tmp_path, db_url=db_url, max_sessions=2) as api:
        first = await api.session()
        await api.session()
        body = {"tags": [], "sdk_version": "test"}
        expect_quota(await api.post("create_session", body), "max_sessions", 2)
        # Another tenant has a budget of its own.
        bob = await other(api, "bob")
        assert (await bob.post("create_session", body)).status_code == 200

        finished = await api.post(f"sessions/{first}/finish", {"reason": {"type": "success"}})
        assert finished.status_code == 200
        assert (await api.post("create_session", body)).status_code == 200
        expect_quota(await api.post("create_session", body), "max_sessions", 2)


async def test_zero_means_unlimited(tmp_path: Path) -> None:
    async with serve(tmp_path, max_sessions=0, max_inflight=0) as api:
        for _ in range(5):
            await api.session()


async def test_override_applies_to_a_running_server(tmp_path: Path) -> None:
    async with serve(tmp_path, max_sessions=5) as api:
        await api.session()
        limits = LimitStore(tmp_path / "limits.json")  # beside keys.json, as the CLI writes it
        limits.set("alice", max_sessions=1)
        body = {"tags": [], "sdk_version": "test"}
        expect_quota(await api.post("create_session", body), "max_sessions", 1)
        limits.set("alice", max_sessions=None)  # back to the server default
        assert (await api.post("create_session", body)).status_code == 200


async def test_inflight_limit_counts_unresolved_futures(tmp_path: Path, db_url: str) -> None:
    async with serve(tmp_path, db_url=db_url, max_inflight=1) as api:
        session_id = await api.session()
        model_id = await api.model(session_id)
        sampler_id = await sampler(api, session_id)
        # seq 2 waits for seq 1, so it stays in flight: the tenant is at its limit.
        waiting = await api.forward_backward(model_id, 2, [datum(TOKENS)])
        assert waiting.status_code == 200
        expect_quota(
            await api.post("asample", sample_body(sampler_id, TOKENS, max_tokens=2)),
            "max_inflight",
            1,
        )
        # Another tenant is not held back by alice's requests.
        bob = await other(api, "bob")
        bob_session = await bob.session()
        bob_sampler = await sampler(bob, bob_session)
        assert (await bob.post("asample", sample_body(bob_sampler, TOKENS))).status_code == 200

        # seq 1 is let in over the limit: seq 2 waits for it, so refusing it would deadlock.
        await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
        await api.result(waiting)
        sampled = await api.post("asample", sample_body(sampler_id, TOKENS, max_tokens=2))
        assert sampled.status_code == 200, sampled.text


async def test_a_refused_training_request_keeps_its_seq_id(tmp_path: Path, db_url: str) -> None:
    """The SDKs retry a 429 with the same seq_id, so the 429 must not consume it."""
    async with serve(tmp_path, db_url=db_url, max_inflight=1) as api:
        session_id = await api.session()
        model_a = await api.model(session_id, seq=0)
        model_b = await api.model(session_id, seq=1)
        # Model b's seq 2 waits for its seq 1: it holds alice's only slot.
        blocker = await api.forward_backward(model_b, 2, [datum(TOKENS)])
        refused = await api.forward_backward(model_a, 1, [datum(TOKENS)])
        expect_quota(refused, "max_inflight", 1)
        step = {"model_id": model_a, "seq_id": 2, "adam_params": {"learning_rate": 0.05}}
        expect_quota(await api.post("optim_step", step), "max_inflight", 1)

        await api.result(await api.forward_backward(model_b, 1, [datum(TOKENS)]))
        await api.result(blocker)
        # The retry, with the same seq_id and body, is accepted and runs in order.
        retried = await api.result(await api.forward_backward(model_a, 1, [datum(TOKENS)]))
        before = decode_output(retried.content).metrics["loss:sum"]
        stepped = await optim_step(api, model_a, 2)
        assert stepped.status_code == 200, stepped.text
        assert "error" not in stepped.json()
        after = await api.result(await api.forward_backward(model_a, 3, [datum(TOKENS)]))
        assert decode_output(after.content).metrics["loss:sum"] < before


async def test_retry_after_follows_the_tenants_request_time(tmp_path: Path) -> None:
    async with serve(tmp_path, max_inflight=1) as api:
        state = app_of(api).state.tuneloop
        session_id = await api.session()
        model_id = await api.model(session_id)
        await api.forward_backward(model_id, 2, [datum(TOKENS)])
        # Pretend alice's requests take 8 s each: one slot of one frees in about 8 s.
        state.futures._latency_s["alice"] = 8.0
        refused = await api.forward_backward(model_id, 3, [datum(TOKENS)])
        expect_quota(refused, "max_inflight", 1)
        assert refused.headers["retry-after-ms"] == "8000"
        assert refused.headers["retry-after"] == "8"


async def test_sdk_backs_off_and_succeeds_once_capacity_frees(tmp_path: Path) -> None:
    """Our SDK's retry of a 429 over the real app: it waits, then its request goes through."""
    from tuneloop._http import HttpTransport

    async with serve(tmp_path, max_sessions=1) as api:
        first = await api.session()
        transport = HttpTransport(
            "http://tuneloop", api.key, transport=httpx.ASGITransport(app=app_of(api))
        )
        try:
            creating = asyncio.ensure_future(
                transport.request(
                    "POST", "/api/v1/create_session", json_body={"tags": [], "sdk_version": "t"}
                )
            )
            await asyncio.sleep(0.5)
            assert not creating.done()  # refused with 429 and waiting to retry
            await api.post(f"sessions/{first}/finish", {"reason": {"type": "success"}})
            response = await asyncio.wait_for(creating, 15)
            assert response.status_code == 200
            assert response.json()["session_id"] != first
        finally:
            await transport.aclose()


def test_limits_file_validates_and_resets(tmp_path: Path) -> None:
    store = LimitStore(tmp_path / "limits.json")
    assert store.get("alice") == TenantLimits()
    assert store.set("alice", max_inflight=3) == TenantLimits(max_inflight=3)
    assert store.set("alice", max_sessions=0) == TenantLimits(max_sessions=0, max_inflight=3)
    assert LimitStore(tmp_path / "limits.json").get("alice").max_inflight == 3
    with pytest.raises(ValueError, match="max_sessions"):
        store.set("alice", max_sessions=-1)
    with pytest.raises(ValueError, match="unknown"):
        store.set("alice", max_tokens=3)
    assert store.reset("alice")
    assert not store.reset("alice")
    assert store.all() == {}


def test_config_reads_quota_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TUNELOOP_MAX_SESSIONS", "3")
    monkeypatch.setenv("TUNELOOP_MAX_INFLIGHT", "9")
    monkeypatch.setenv("TUNELOOP_SESSION_TTL_S", "12.5")
    config = ServerConfig.from_env(data_dir=tmp_path, max_inflight=4)
    assert (config.max_sessions, config.max_inflight, config.session_ttl_s) == (3, 4, 12.5)
    assert config.limits_path == tmp_path / "limits.json"
    assert ServerConfig(tmp_path, keys_file=tmp_path / "k" / "keys.json").limits_path == (
        tmp_path / "k" / "limits.json"
    )
    with pytest.raises(ValueError, match="max_sessions"):
        ServerConfig(tmp_path, max_sessions=-1)


# ---- command line ----------------------------------------------------------------------------


def cli(*args: str) -> Any:
    from typer.testing import CliRunner

    from tuneloop.cli import build_app

    return CliRunner().invoke(build_app(with_demo=False), list(args), catch_exceptions=False)


def test_keys_create_sets_the_tenants_limits(tmp_path: Path) -> None:
    created = cli(
        "keys",
        "create",
        "--data-dir",
        str(tmp_path),
        "--tenant",
        "alice",
        "--max-sessions",
        "2",
        "--max-inflight",
        "0",
    )
    assert created.exit_code == 0, created.output
    assert created.stdout.strip().startswith("tml-")
    assert LimitStore(tmp_path / "limits.json").get("alice") == TenantLimits(2, 0)
    # A bad value fails before any key is made.
    bad = cli(
        "keys", "create", "--data-dir", str(tmp_path), "--tenant", "bob", "--max-sessions", "-3"
    )
    assert bad.exit_code == 2
    assert "max-sessions" in bad.stderr
    listed = cli("keys", "list", "--data-dir", str(tmp_path), "--json")
    assert [k["tenant"] for k in json.loads(listed.stdout)] == ["alice"]


def test_keys_limits_shows_sets_and_resets(tmp_path: Path) -> None:
    where = ("--data-dir", str(tmp_path))
    changed = cli("keys", "limits", "alice", "--max-inflight", "5", *where, "--json")
    assert changed.exit_code == 0, changed.output
    assert json.loads(changed.stdout) == {
        "tenant": "alice",
        "max_sessions": None,
        "max_inflight": 5,
    }
    cli("keys", "limits", "bob", "--max-sessions", "1", *where)
    every = json.loads(cli("keys", "limits", *where, "--json").stdout)
    assert [row["tenant"] for row in every] == ["alice", "bob"]
    cli("keys", "limits", "alice", "--max-inflight", "default", *where)
    assert "alice" not in LimitStore(tmp_path / "limits.json").all()
    assert cli("keys", "limits", "bob", "--reset", *where).exit_code == 0
    assert LimitStore(tmp_path / "limits.json").all() == {}
    assert cli("keys", "limits", "--max-sessions", "1", *where).exit_code == 2


def test_serve_passes_quota_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import tuneloop.server.app as app_module

    seen: list[ServerConfig] = []

    def fake_create_app(config: ServerConfig) -> Any:
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(app_module, "create_app", fake_create_app)
    cli(
        "serve",
        "--data-dir",
        str(tmp_path),
        "--backend",
        "fake",
        "--max-sessions",
        "3",
        "--max-inflight",
        "7",
        "--session-ttl-s",
        "60",
        "--expiry-check-s",
        "2",
    )
    [config] = seen
    assert (config.max_sessions, config.max_inflight) == (3, 7)
    assert (config.session_ttl_s, config.expiry_check_s) == (60.0, 2.0)


async def oai_completion(api: Api, prompts: list[str], n: int) -> httpx.Response:
    body = {"model": "tuneloop/fake-tiny", "prompt": prompts, "n": n, "max_tokens": 2}
    headers = {"authorization": f"Bearer {api.key}"}
    return await api.http.post("/oai/api/v1/completions", json=body, headers=headers)


async def test_openai_requests_count_every_prompt_and_choice(tmp_path: Path) -> None:
    async with serve(tmp_path, max_inflight=6) as api:
        session_id = await api.session()
        model_id = await api.model(session_id)
        # 3 prompts x n 2 = 6 generations: the whole quota, answered whole.
        whole = await oai_completion(api, ["a", "b", "c"], 2)
        assert whole.status_code == 200, whole.text
        assert len(whole.json()["choices"]) == 6
        # 7 can never fit: a 400 naming the limit (a retry would never succeed).
        never = await oai_completion(api, ["a", "b", "c", "d"], 2)
        assert never.status_code == 400, never.text
        assert never.json()["error"]["param"] == "max_inflight"
        assert never.headers["x-should-retry"] == "false"
        # With 2 requests in flight (seq 3 and 2 wait for seq 1), 3 x 2 = 6 more do not fit.
        waiting = [await api.forward_backward(model_id, s, [datum(TOKENS)]) for s in (3, 2)]
        assert all(w.status_code == 200 for w in waiting)
        busy = await oai_completion(api, ["a", "b", "c"], 2)
        assert busy.status_code == 429, busy.text
        assert busy.json()["error"]["param"] == "max_inflight"
        assert 1 <= int(busy.headers["retry-after"]) <= 30
        # ... but fit once they ran.
        await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
        for w in waiting:
            await api.result(w)
        fits = await oai_completion(api, ["a", "b", "c"], 2)
        assert fits.status_code == 200, fits.text


async def test_openai_choices_are_held_until_the_request_ends(tmp_path: Path) -> None:
    async with serve(tmp_path, max_inflight=8) as api:
        quotas = app_of(api).state.tuneloop.quotas
        release = quotas.hold("alice", 5)
        assert quotas.in_flight("alice") == 5
        busy = await oai_completion(api, ["a", "b"], 2)  # 5 + 4 > 8
        assert busy.status_code == 429, busy.text
        release()
        release()  # a second call releases nothing more
        assert quotas.in_flight("alice") == 0
        assert (await oai_completion(api, ["a", "b"], 2)).status_code == 200
        assert quotas.in_flight("alice") == 0  # everything of the request was released


async def test_openai_prompts_per_request_are_capped(tmp_path: Path) -> None:
    from tuneloop.server.api.oai.params import MAX_PROMPTS

    async with serve(tmp_path, max_inflight=0) as api:
        response = await oai_completion(api, ["x"] * (MAX_PROMPTS + 1), 1)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt"
        assert str(MAX_PROMPTS) in response.json()["error"]["message"]
