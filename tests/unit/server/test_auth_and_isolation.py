"""API keys (missing, wrong, revoked, stored hashed) and tenant isolation: another tenant's
objects are 404, never 403, and never listed."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute, iter_route_contexts

from tests.unit.server.harness import (
    Api,
    datum,
    expect_error,
    optim_step,
    sample,
    sample_body,
    sampler,
)
from tuneloop.server.storage.keys import KeyStore

TOKENS = [5, 17, 33, 90, 120, 7]


async def test_missing_key_is_401(api: Api) -> None:
    for response in (
        await api.http.post("/api/v1/create_session", json={}),
        await api.http.get("/api/v1/training_runs"),
        await api.http.get("/api/v1/get_server_capabilities"),
    ):
        expect_error(response, 401, "X-API-Key")


async def test_wrong_key_is_401(api: Api) -> None:
    for key in ("tml-not-a-real-key", api.key + "x", api.key[:-1]):
        response = await api.http.post(
            "/api/v1/create_session", json={}, headers={"x-api-key": key}
        )
        expect_error(response, 401, "X-API-Key")
    bearer = await api.http.get(
        "/api/v1/training_runs", headers={"authorization": "Bearer tml-nope"}
    )
    expect_error(bearer, 401, "X-API-Key")


async def test_bearer_token_is_accepted(api: Api) -> None:
    response = await api.http.get(
        "/api/v1/training_runs", headers={"authorization": f"Bearer {api.key}"}
    )
    assert response.status_code == 200, response.text


async def test_revoked_key_is_401_immediately(api: Api) -> None:
    # Repeated, so a revocation landing in the same file-timestamp tick as the key's creation
    # (and the server's cached read of the file) is caught too.
    for _ in range(20):
        key, record = api.keys.create("carol")
        headers = {"x-api-key": key}
        ok = await api.http.get("/api/v1/training_runs", headers=headers)
        assert ok.status_code == 200, ok.text
        assert api.keys.revoke(record.key_id)
        revoked = await api.http.get("/api/v1/training_runs", headers=headers)
        expect_error(revoked, 401, "X-API-Key")
    # Other keys are untouched.
    assert (await api.get("training_runs")).status_code == 200


async def test_keys_are_stored_hashed(api: Api, other_tenant: Api) -> None:
    text = api.keys.path.read_text()
    for key in (api.key, other_tenant.key):
        assert key.startswith("tml-")
        assert key not in text
        assert key.removeprefix("tml-") not in text
    assert {r.tenant for r in KeyStore(api.keys.path).list()} == {"alice", "bob"}
    assert oct(api.keys.path.stat().st_mode & 0o777) == "0o600"


@dataclass
class AliceWorld:
    session_id: str
    model_id: str
    sampler_id: str
    weights_path: str
    sampler_path: str
    pending_request_id: str
    done_request_id: str


@pytest.fixture
async def alice(api: Api) -> AliceWorld:
    session_id = await api.session()
    model_id = await api.model(session_id)
    await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    await optim_step(api, model_id, 2)
    saved = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "w1", "seq_id": 3})
    )
    sampled = await api.result(
        await api.post(
            "save_weights_for_sampler", {"model_id": model_id, "path": "s1", "seq_id": 4}
        )
    )
    sampler_id = await sampler(api, session_id, seq=0)
    # Left unfinished: seq 6 waits for a seq 5 that never comes.
    pending = await api.post("optim_step", {"model_id": model_id, "seq_id": 6, "adam_params": {}})
    return AliceWorld(
        session_id,
        model_id,
        sampler_id,
        saved.json()["path"],
        sampled.json()["path"],
        pending.json()["request_id"],
        json.loads(saved.request.content)["request_id"],  # the poll that got its result
    )


async def bob_requests(bob: Api, a: AliceWorld) -> list[tuple[str, httpx.Response, str]]:
    """Every way bob could touch alice's objects: (what, response, field named)."""
    bob_session = await bob.session()
    run, ckpt = a.model_id, "weights/w1"
    return [
        (
            "heartbeat",
            await bob.post("session_heartbeat", {"session_id": a.session_id}),
            "session_id",
        ),
        ("finish", await bob.post(f"sessions/{a.session_id}/finish", {}), "session_id"),
        ("session get", await bob.get(f"sessions/{a.session_id}"), "session_id"),
        (
            "create_model in alice's session",
            await bob.post(
                "create_model",
                {"session_id": a.session_id, "model_seq_id": 9, "base_model": "tuneloop/fake-tiny"},
            ),
            "session_id",
        ),
        ("get_info", await bob.post("get_info", {"model_id": run}), "model_id"),
        ("forward_backward", await bob.forward_backward(run, 5, [datum(TOKENS)]), "model_id"),
        (
            "optim_step",
            await bob.post("optim_step", {"model_id": run, "seq_id": 5, "adam_params": {}}),
            "model_id",
        ),
        (
            "save_weights",
            await bob.post("save_weights", {"model_id": run, "path": "steal", "seq_id": 5}),
            "model_id",
        ),
        (
            "save_weights_for_sampler",
            await bob.post(
                "save_weights_for_sampler",
                {"model_id": run, "sampling_session_seq_id": 3, "seq_id": 5},
            ),
            "model_id",
        ),
        (
            "legacy load_weights into alice's model",
            await bob.post("load_weights", {"model_id": run, "seq_id": 5, "path": a.weights_path}),
            "path",
        ),
        ("sampler get", await bob.get(f"samplers/{a.sampler_id}"), "sampler_id"),
        (
            "asample",
            await bob.post("asample", sample_body(a.sampler_id, [5, 7], max_tokens=2)),
            "sampling_session_id",
        ),
        ("training run get", await bob.get(f"training_runs/{run}"), "training_run_id"),
        (
            "checkpoints list",
            await bob.get(f"training_runs/{run}/checkpoints"),
            "training_run_id",
        ),
        ("checkpoint get", await bob.post("weights_info", {"tinker_path": a.weights_path}), None),
        (
            "checkpoint delete",
            await bob.http.delete(
                f"/api/v1/training_runs/{run}/checkpoints/{ckpt}", headers=bob.headers()
            ),
            "checkpoint_id",
        ),
        (
            "retrieve_future",
            await bob.post("retrieve_future", {"request_id": a.pending_request_id}),
            "request_id",
        ),
        (
            "load_weights from alice's checkpoint",
            await bob.post(
                "load_weights",
                {"session_id": bob_session, "model_seq_id": 0, "path": a.weights_path},
            ),
            "path",
        ),
        (
            "sampler from alice's checkpoint",
            await bob.post(
                "create_sampling_session",
                {
                    "session_id": bob_session,
                    "sampling_session_seq_id": 0,
                    "model_path": a.sampler_path,
                },
            ),
            "model_path",
        ),
        (
            "sampler in alice's session",
            await bob.post(
                "create_sampling_session",
                {
                    "session_id": a.session_id,
                    "sampling_session_seq_id": 7,
                    "base_model": "tuneloop/fake-tiny",
                },
            ),
            "session_id",
        ),
    ]


async def test_other_tenant_gets_404_for_everything(
    api: Api, other_tenant: Api, alice: AliceWorld
) -> None:
    for what, response, field in await bob_requests(other_tenant, alice):
        assert response.status_code == 404, (what, response.status_code, response.text)
        body: dict[str, Any] = response.json()
        assert body["type"] == "not_found", what
        assert body["detail"], what
        if field is not None and what != "checkpoint get":
            assert body["field"] == field, (what, body)

    # Nothing of alice's was touched: her session lives, her checkpoints and futures remain.
    assert (
        await api.post("session_heartbeat", {"session_id": alice.session_id})
    ).status_code == 200
    listed = (await api.get(f"training_runs/{alice.model_id}/checkpoints")).json()
    assert {c["tinker_path"] for c in listed["checkpoints"]} == {
        alice.weights_path,
        alice.sampler_path,
    }
    out = await sample(api, alice.sampler_id, [5, 7], max_tokens=2, seed=0)
    assert out.sequences
    waiting = await api.post("retrieve_future", {"request_id": alice.pending_request_id})
    assert waiting.status_code == 408


async def test_other_tenant_rejections_do_not_consume_alice_seq_ids(
    api: Api, other_tenant: Api
) -> None:
    model_id = await api.model(await api.session())
    # Rejected before ownership is checked (wrong content type, bad JSON field): still no effect.
    json_body = await other_tenant.post("forward_backward", {"model_id": model_id, "seq_id": 1})
    assert json_body.status_code == 415
    bad_adam = await other_tenant.post(
        "optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"beta1": 2}}
    )
    assert bad_adam.status_code == 400
    await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    step = await optim_step(api, model_id, 2)
    assert step.json()["metrics"]["grad_norm"] > 0


async def test_other_tenant_listings_exclude_alice(
    api: Api, other_tenant: Api, alice: AliceWorld
) -> None:
    bob = other_tenant
    bob_session = await bob.session()
    bob_model = await bob.model(bob_session)
    await bob.result(
        await bob.post("save_weights", {"model_id": bob_model, "path": "b1", "seq_id": 1})
    )

    runs = (await bob.get("training_runs")).json()
    assert [r["training_run_id"] for r in runs["training_runs"]] == [bob_model]
    assert runs["cursor"]["total_count"] == 1
    assert all(r["model_owner"] == "bob" for r in runs["training_runs"])
    checkpoints = (await bob.get("checkpoints")).json()
    assert [c["tinker_path"] for c in checkpoints["checkpoints"]] == [
        f"tinker://{bob_model}/weights/b1"
    ]
    assert checkpoints["cursor"]["total_count"] == 1
    assert (await bob.get("sessions")).json()["sessions"] == [bob_session]

    # And alice sees only hers.
    alice_runs = (await api.get("training_runs")).json()["training_runs"]
    assert [r["training_run_id"] for r in alice_runs] == [alice.model_id]
    assert (await api.get("sessions")).json()["sessions"] == [alice.session_id]
    paths = {c["tinker_path"] for c in (await api.get("checkpoints")).json()["checkpoints"]}
    assert paths == {alice.weights_path, alice.sampler_path}


async def test_sample_ids_are_not_shared_across_tenants(
    api: Api, other_tenant: Api, alice: AliceWorld
) -> None:
    # bob samples from his own sampler with the same seq_id alice used; no cross-talk.
    bob_sampler = await sampler(other_tenant, await other_tenant.session())
    body = sample_body(alice.sampler_id, [5, 7], max_tokens=2, seed=3, seq_id=1)
    first = await api.post("asample", body)
    theirs = await other_tenant.post("asample", {**body, "sampling_session_id": bob_sampler})
    assert first.json()["request_id"] != theirs.json()["request_id"]
    expect_error(
        await other_tenant.post("retrieve_future", {"request_id": first.json()["request_id"]}),
        404,
        "request_id",
    )


# ---- every route, by table ---------------------------------------------------------------------


@dataclass
class BobWorld:
    session_id: str
    weights_path: str  # bob's own checkpoint, to aim at alice's model or session


Call = Callable[[Api, AliceWorld, BobWorld], Awaitable[httpx.Response]]
MODEL = "tuneloop/fake-tiny"


def _fb(bob: Api, a: AliceWorld, _s: BobWorld) -> Awaitable[httpx.Response]:
    return bob.forward_backward(a.model_id, 5, [datum(TOKENS)])


def _this_hour() -> dict[str, str]:
    start = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return {
        "starting_on": start.isoformat(),
        "ending_before": (start + timedelta(hours=1)).isoformat(),
    }


def _ckpt(a: AliceWorld) -> str:
    return f"training_runs/{a.model_id}/checkpoints/weights/w1"


# (method, route) -> every way its resource ids can name one of alice's: (call, field named).
# Called as bob, with bob's own live session as the third argument.
RESOURCE_ROUTES: dict[tuple[str, str], list[tuple[Call, str | None]]] = {
    ("POST", "/api/v1/session_heartbeat"): [
        (lambda b, a, _s: b.post("session_heartbeat", {"session_id": a.session_id}), "session_id")
    ],
    ("POST", "/api/v1/sessions/{session_id}/finish"): [
        (lambda b, a, _s: b.post(f"sessions/{a.session_id}/finish", {}), "session_id")
    ],
    ("GET", "/api/v1/sessions/{session_id}"): [
        (lambda b, a, _s: b.get(f"sessions/{a.session_id}"), "session_id")
    ],
    ("POST", "/api/v1/create_model"): [
        (
            lambda b, a, _s: b.post(
                "create_model",
                {"session_id": a.session_id, "model_seq_id": 9, "base_model": MODEL},
            ),
            "session_id",
        )
    ],
    ("POST", "/api/v1/get_info"): [
        (lambda b, a, _s: b.post("get_info", {"model_id": a.model_id}), "model_id")
    ],
    ("POST", "/api/v1/load_weights"): [
        (
            lambda b, a, _s: b.post(
                "load_weights", {"model_id": a.model_id, "seq_id": 5, "path": a.weights_path}
            ),
            "path",
        ),
        (
            lambda b, a, s: b.post(
                "load_weights", {"model_id": a.model_id, "seq_id": 5, "path": s.weights_path}
            ),
            "model_id",
        ),
        (
            lambda b, a, s: b.post(
                "load_weights",
                {"session_id": s.session_id, "model_seq_id": 0, "path": a.weights_path},
            ),
            "path",
        ),
        (
            lambda b, a, s: b.post(
                "load_weights",
                {"session_id": a.session_id, "model_seq_id": 8, "path": s.weights_path},
            ),
            "session_id",
        ),
    ],
    ("POST", "/api/v1/forward_backward"): [(_fb, "model_id")],
    ("POST", "/api/v1/optim_step"): [
        (
            lambda b, a, _s: b.post(
                "optim_step", {"model_id": a.model_id, "seq_id": 5, "adam_params": {}}
            ),
            "model_id",
        )
    ],
    ("POST", "/api/v1/save_weights"): [
        (
            lambda b, a, _s: b.post(
                "save_weights", {"model_id": a.model_id, "path": "steal", "seq_id": 5}
            ),
            "model_id",
        )
    ],
    ("POST", "/api/v1/save_weights_for_sampler"): [
        (
            lambda b, a, _s: b.post(
                "save_weights_for_sampler", {"model_id": a.model_id, "path": "s", "seq_id": 5}
            ),
            "model_id",
        ),
        (
            lambda b, a, _s: b.post(
                "save_weights_for_sampler",
                {"model_id": a.model_id, "sampling_session_seq_id": 3, "seq_id": 5},
            ),
            "model_id",
        ),
    ],
    ("POST", "/api/v1/create_custom_loss"): [
        (
            lambda b, a, _s: b.post(
                "create_custom_loss",
                {
                    "session_id": a.session_id,
                    "custom_loss_seq_id": 0,
                    "name": "neg",
                    "inputs": [{"name": "logprobs", "rank": 1}],
                    "graph": {
                        "nodes": [{"op": "placeholder", "name": "logprobs", "target": "logprobs"}]
                    },
                },
            ),
            "session_id",
        )
    ],
    ("POST", "/api/v1/create_sampling_session"): [
        (
            lambda b, a, _s: b.post(
                "create_sampling_session",
                {"session_id": a.session_id, "sampling_session_seq_id": 7, "base_model": MODEL},
            ),
            "session_id",
        ),
        (
            lambda b, a, s: b.post(
                "create_sampling_session",
                {
                    "session_id": s.session_id,
                    "sampling_session_seq_id": 0,
                    "model_path": a.sampler_path,
                },
            ),
            "model_path",
        ),
    ],
    ("GET", "/api/v1/samplers/{sampler_id}"): [
        (lambda b, a, _s: b.get(f"samplers/{a.sampler_id}"), "sampler_id")
    ],
    ("POST", "/api/v1/asample"): [
        (
            lambda b, a, _s: b.post("asample", sample_body(a.sampler_id, [5, 7], max_tokens=2)),
            "sampling_session_id",
        )
    ],
    ("POST", "/api/v1/retrieve_future"): [
        (
            lambda b, a, _s: b.post("retrieve_future", {"request_id": a.pending_request_id}),
            "request_id",
        ),
        (
            lambda b, a, _s: b.post("retrieve_future", {"request_id": a.done_request_id}),
            "request_id",
        ),
    ],
    ("GET", "/api/v1/training_runs/{run_id}"): [
        (lambda b, a, _s: b.get(f"training_runs/{a.model_id}"), "training_run_id")
    ],
    ("GET", "/api/v1/training_runs/{run_id}/checkpoints"): [
        (lambda b, a, _s: b.get(f"training_runs/{a.model_id}/checkpoints"), "training_run_id")
    ],
    ("PUT", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl"): [
        (
            lambda b, a, _s: b.http.put(
                f"/api/v1/{_ckpt(a)}/ttl", json={"ttl_seconds": 7200}, headers=b.headers()
            ),
            "checkpoint_id",
        )
    ],
    ("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}"): [
        (
            lambda b, a, _s: b.http.delete(f"/api/v1/{_ckpt(a)}", headers=b.headers()),
            "checkpoint_id",
        )
    ],
    (
        "GET",
        "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls",
    ): [
        (
            lambda b, a, _s: b.get(
                f"training_runs/{a.model_id}/checkpoints/external_weights/w1/external_weights_urls"
            ),
            "checkpoint_id",
        )
    ],
    ("POST", "/api/v1/save_weights_external"): [
        (
            lambda b, a, _s: b.post(
                "save_weights_external", {"model_id": a.model_id, "path": "steal", "seq_id": 5}
            ),
            "model_id",
        )
    ],
    ("POST", "/api/v1/weights_info"): [
        (lambda b, a, _s: b.post("weights_info", {"tinker_path": a.weights_path}), "tinker_path")
    ],
    ("POST", "/api/v1/retrieve_futures"): [
        (
            lambda b, a, _s: b.post(
                "retrieve_futures",
                {"target": {"sampling_session_id": a.sampler_id}, "timeout": 0},
            ),
            "target.sampling_session_id",
        )
    ],
    ("POST", "/api/v1/join_sampling_session"): [
        (
            lambda b, a, _s: b.post("join_sampling_session", {"sampling_session_id": a.sampler_id}),
            "sampling_session_id",
        )
    ],
    ("POST", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish"): [
        (lambda b, a, _s: b.post(f"{_ckpt(a)}/publish"), "checkpoint_id")
    ],
    ("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish"): [
        (
            lambda b, a, _s: b.http.delete(f"/api/v1/{_ckpt(a)}/publish", headers=b.headers()),
            "checkpoint_id",
        )
    ],
    ("PUT", "/api/v1/sessions/{session_id}/project"): [
        (
            lambda b, a, _s: b.http.put(
                f"/api/v1/sessions/{a.session_id}/project",
                json={"project_id": "p"},
                headers=b.headers(),
            ),
            "session_id",
        )
    ],
    ("GET", "/api/v1/sessions/{session_id}/trace_export"): [
        (lambda b, a, _s: b.get(f"sessions/{a.session_id}/trace_export"), "session_id")
    ],
    ("POST", "/api/v1/copy_weights"): [
        (
            lambda b, a, _s: b.post(
                "copy_weights", {"source_path": a.weights_path, "destination_project_id": "p"}
            ),
            "source_path",
        ),
        (
            lambda b, a, s: b.post(
                "copy_weights",
                {"source_path": s.weights_path, "session_id": a.session_id, "model_seq_id": 3},
            ),
            "session_id",
        ),
    ],
    ("GET", "/api/v1/usage"): [
        (lambda b, a, _s: b.get("usage", params={"session_id": a.session_id}), "session_id"),
        (
            lambda b, a, _s: b.get("usage", params={"training_run_id": a.model_id}),
            "training_run_id",
        ),
        (
            lambda b, a, _s: b.get("usage", params={"training_run_id": a.sampler_id}),
            "training_run_id",
        ),
    ],
}


def _oai(route: str, model: Callable[[AliceWorld], str]) -> list[tuple[Call, str | None]]:
    """An OpenAI-compatible route naming one of alice's models (answered in OpenAI's shape)."""
    body = (
        {"messages": [{"role": "user", "content": "hi"}]}
        if route == "chat/completions"
        else {"prompt": [5, 7]}
    )

    def call(b: Api, a: AliceWorld, _s: BobWorld) -> Awaitable[httpx.Response]:
        payload = {**body, "model": model(a), "max_tokens": 2}
        return b.http.post(f"/oai/api/v1/{route}", json=payload, headers=b.headers())

    return [(call, "model")]


for _route in ("chat/completions", "completions"):
    RESOURCE_ROUTES[("POST", f"/oai/api/v1/{_route}")] = [
        *_oai(_route, lambda a: a.sampler_path),
        *_oai(_route, lambda a: a.weights_path),
        *_oai(_route, lambda a: a.sampler_id),
        *_oai(_route, lambda a: f"{MODEL};{a.sampler_path}"),
    ]

# Routes that take no resource id (or, like usage, also answer without one): checked apart,
# each answer must hold nothing of alice's.
NO_RESOURCE_ROUTES: dict[tuple[str, str], Call] = {
    ("POST", "/api/v1/client/config"): lambda b, _a, _s: b.post("client/config", {}),
    ("POST", "/api/v1/client/dynamic_config"): lambda b, _a, _s: b.post("client/dynamic_config"),
    ("POST", "/api/v1/telemetry"): lambda b, _a, _s: b.post("telemetry", {}),
    ("GET", "/api/v1/healthz"): lambda b, _a, _s: b.get("healthz"),
    ("GET", "/api/v1/get_server_capabilities"): lambda b, _a, _s: b.get("get_server_capabilities"),
    ("GET", "/api/v1/tokenizer"): lambda b, _a, _s: b.get(
        "tokenizer", params={"base_model": MODEL}
    ),
    ("POST", "/api/v1/create_session"): lambda b, _a, _s: b.post("create_session", {}),
    ("GET", "/api/v1/sessions"): lambda b, _a, _s: b.get("sessions"),
    ("GET", "/api/v1/training_runs"): lambda b, _a, _s: b.get("training_runs"),
    ("GET", "/api/v1/checkpoints"): lambda b, _a, _s: b.get("checkpoints"),
    ("GET", "/api/v1/usage"): lambda b, _a, _s: b.get("usage"),
    ("POST", "/api/v1/sessions/search"): lambda b, _a, _s: b.post("sessions/search", {}),
    ("GET", "/api/v1/audit"): lambda b, _a, _s: b.get("audit"),
    ("GET", "/api/v1/billing/usage/events"): lambda b, _a, _s: b.get(
        "billing/usage/events", params=_this_hour()
    ),
    ("GET", "/api/v1/billing/usage/checkpoints/current"): lambda b, _a, _s: b.get(
        "billing/usage/checkpoints/current"
    ),
    ("GET", "/oai/api/v1/models"): lambda b, _a, _s: b.http.get(
        "/oai/api/v1/models", headers=b.headers()
    ),
    ("GET", "/oai/api/v1/health"): lambda b, _a, _s: b.http.get("/oai/api/v1/health"),
}


# Routes whose credential is a signature in the URL, not an API key (tests/unit/server/
# test_downloads.py covers them): a URL bob alters to reach alice's checkpoint is a 403.
SIGNED_ROUTES: dict[tuple[str, str], Call] = {
    ("GET", "/api/v1/trace_files/{session_id}/{file}"): lambda b, a, _s: b.http.get(
        f"/api/v1/trace_files/{a.session_id}/trace-1-00000000.json",
        params={"tenant": "bob", "expires": 2**40, "signature": "0" * 64},
    ),
    ("GET", "/api/v1/downloads/{run_id}/{name}/{file_path:path}"): lambda b, a, _s: b.http.get(
        f"/api/v1/downloads/{a.model_id}/w1/adapter_config.json",
        params={"tenant": "bob", "expires": 2**40, "signature": "0" * 64},
    ),
}


# Routes for the operator, not for tenants: /metrics counts every tenant's work (tenant names as
# labels); a scrape token guards it when set, and no API key opens it (test_metrics.py).
OPERATOR_ROUTES = {("GET", "/metrics")}


def app_routes(app: Any) -> set[tuple[str, str]]:
    """(method, path) of every API route the app serves, however its routers are nested."""
    out = set()
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, APIRoute):
            assert context.path is not None
            out |= {(method, context.path) for method in route.methods}
    return out


def alice_secrets(a: AliceWorld) -> list[str]:
    ids = [a.session_id, a.model_id, a.sampler_id, a.weights_path, a.sampler_path]
    return [*ids, a.pending_request_id, a.done_request_id, "alice"]


async def test_every_route_is_classified(server: tuple[Any, KeyStore]) -> None:
    # A new route fails here until it is added to one of the tables (and so tested below).
    # The console's routes (cookie-signed, under /console) are walked by tenant B in
    # tests/unit/server/test_console.py, whose own check keeps that walk complete.
    routes = {r for r in app_routes(server[0]) if not r[1].startswith("/console")}
    classified = set(RESOURCE_ROUTES) | set(NO_RESOURCE_ROUTES) | set(SIGNED_ROUTES)
    classified |= OPERATOR_ROUTES
    assert routes == classified, routes ^ classified


async def test_every_route_answers_404_for_another_tenants_resource(
    api: Api, other_tenant: Api, alice: AliceWorld
) -> None:
    bob_session = await other_tenant.session()
    bob_model = await other_tenant.model(bob_session)
    saved = await other_tenant.result(
        await other_tenant.post("save_weights", {"model_id": bob_model, "path": "b", "seq_id": 1})
    )
    bob = BobWorld(bob_session, saved.json()["path"])
    for route, calls in RESOURCE_ROUTES.items():
        for i, (call, field) in enumerate(calls):
            response = await call(other_tenant, alice, bob)
            what = (route, i)
            assert response.status_code == 404, (what, response.status_code, response.text)
            body: dict[str, Any] = response.json()
            if "error" in body:  # the OpenAI-compatible routes answer in OpenAI's shape
                body = {"type": body["error"]["code"], "field": body["error"]["param"]}
            assert body["type"] == "not_found", what
            assert body["field"] == field, (what, body)
            # An error may echo the id bob sent, never anything else of alice's.
            sent = (str(response.request.url) + response.request.content.decode()).replace(
                "%3A", ":"
            )
            for secret in alice_secrets(alice):
                # A checkpoint path may come back assembled from the URL's run and checkpoint.
                parts = secret.removeprefix("tinker://").split("/", 1)
                echoed = all(part in sent for part in parts)
                assert secret not in response.text or echoed, (what, secret, body)

    # Nothing of alice's was touched: her session lives, her checkpoints and futures remain.
    assert (
        await api.post("session_heartbeat", {"session_id": alice.session_id})
    ).status_code == 200
    listed = (await api.get(f"training_runs/{alice.model_id}/checkpoints")).json()
    assert {c["tinker_path"] for c in listed["checkpoints"]} == {
        alice.weights_path,
        alice.sampler_path,
    }
    assert all(c["expires_at"] is None for c in listed["checkpoints"])
    waiting = await api.post("retrieve_future", {"request_id": alice.pending_request_id})
    assert waiting.status_code == 408


async def test_routes_without_resource_ids_show_nothing_of_another_tenant(
    other_tenant: Api, alice: AliceWorld
) -> None:
    for route, call in NO_RESOURCE_ROUTES.items():
        response = await call(other_tenant, alice, BobWorld("", ""))
        assert response.status_code == 200, (route, response.text)
        for secret in alice_secrets(alice):
            assert secret not in response.text, (route, secret, response.text)


async def test_signed_routes_refuse_another_tenants_files(
    other_tenant: Api, alice: AliceWorld
) -> None:
    for route, call in SIGNED_ROUTES.items():
        response = await call(other_tenant, alice, BobWorld("", ""))
        assert response.status_code == 403, (route, response.text)
        assert response.json()["field"] == "signature", route
        for secret in alice_secrets(alice):
            assert secret not in response.text, (route, secret, response.text)
