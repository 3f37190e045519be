"""Projects (per tenant), copy_weights with an idempotency key, checkpoint storage per project,
session search, trace export through a signed URL, and billing usage events."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from tests.unit.server.harness import Api, datum, expect_error, sample, sampler

TOKENS = [5, 17, 33, 90, 120, 7]


async def _run_with_checkpoint(api: Api, project: str | None = None) -> tuple[str, str, str]:
    body: dict[str, Any] = {"tags": [], "sdk_version": "test", "display_name": "Nightly RL run"}
    if project is not None:
        body["project_id"] = project
    session_id = (await api.post("create_session", body)).json()["session_id"]
    model_id = await api.model(session_id)
    await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    saved = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "w1", "seq_id": 2})
    )
    return session_id, model_id, saved.json()["path"]


def _runs(response: httpx.Response) -> set[str]:
    assert response.status_code == 200, response.text
    return {r["training_run_id"] for r in response.json()["training_runs"]}


async def test_runs_belong_to_their_sessions_project(api: Api, other_tenant: Api) -> None:
    s1, run1, _ = await _run_with_checkpoint(api, "research")
    s2, run2, _ = await _run_with_checkpoint(api)
    assert _runs(await api.get("training_runs", params={"project_id": "research"})) == {run1}
    assert _runs(await api.get("training_runs", params={"project_id": "default"})) == {run2}
    moved = await api.http.put(
        f"/api/v1/sessions/{s2}/project", json={"project_id": "research"}, headers=api.headers()
    )
    assert moved.status_code == 200
    assert _runs(await api.get("training_runs", params={"project_id": "research"})) == {
        run1,
        run2,
    }
    # Project names are per tenant: bob's "research" holds nothing of alice's.
    assert (
        _runs(await other_tenant.get("training_runs", params={"project_id": "research"})) == set()
    )
    expect_error(
        await api.http.put(
            f"/api/v1/sessions/{s1}/project", json={"project_id": "a b"}, headers=api.headers()
        ),
        400,
        "project_id",
    )
    storage = (await api.get("billing/usage/checkpoints/current")).json()["data"]
    assert [(d["project_id"], d["checkpoint_count"]) for d in storage] == [("research", 2)]
    assert storage[0]["size_bytes"] > 0
    one = await api.get("billing/usage/checkpoints/current", params={"project_id": "default"})
    assert one.json()["data"] == []


async def test_copy_weights_into_another_project_is_idempotent(api: Api) -> None:
    _s, _run, weights = await _run_with_checkpoint(api)
    headers = {**api.headers(), "x-idempotency-key": "copy-1"}
    body = {"source_path": weights, "destination_project_id": "archive"}
    first = await api.http.post("/api/v1/copy_weights", json=body, headers=headers)
    again = await api.http.post("/api/v1/copy_weights", json=body, headers=headers)
    assert first.status_code == 200, first.text
    copied = first.json()["tinker_path"]
    assert again.json()["tinker_path"] == copied  # a retry answers the first copy
    assert copied.endswith("/weights/w1")
    assert copied != weights
    other = await api.http.post(
        "/api/v1/copy_weights", json=body, headers={**api.headers(), "x-idempotency-key": "k2"}
    )
    assert other.json()["tinker_path"] != copied  # a new key: a new copy
    copy_run = copied.removeprefix("tinker://").split("/")[0]
    assert copy_run in _runs(await api.get("training_runs", params={"project_id": "archive"}))
    # The copy outlives its source, and cannot be trained on (its session is finished).
    route = weights.removeprefix("tinker://").replace("/", "/checkpoints/", 1)
    assert (
        await api.http.delete(f"/api/v1/training_runs/{route}", headers=api.headers())
    ).status_code == 200
    loaded = await api.result(
        await api.post(
            "load_weights",
            {"session_id": await api.session(), "model_seq_id": 0, "path": copied},
        )
    )
    assert loaded.status_code == 200, loaded.text
    expect_error(
        await api.post("optim_step", {"model_id": copy_run, "seq_id": 1, "adam_params": {}}),
        410,
        "session_id",
    )
    expect_error(
        await api.post("copy_weights", {"source_path": weights, "destination_project_id": "x"}),
        404,
        "source_path",
    )
    expect_error(
        await api.post("copy_weights", {"source_path": copied}), 400, "destination_project_id"
    )
    expect_error(
        await api.post(
            "copy_weights", {"source_path": copied, "destination_project_id": "x", "ttl_seconds": 5}
        ),
        400,
        "ttl_seconds",
    )


async def test_search_sessions_by_name_metadata_status_and_pages(api: Api) -> None:
    ids = []
    for i in range(3):
        body = {
            "tags": [],
            "sdk_version": "t",
            "display_name": f"Sweep lr {i}",
            "user_metadata": {"sweep": "a" if i < 2 else "b"},
        }
        ids.append((await api.post("create_session", body)).json()["session_id"])
    await api.post(f"sessions/{ids[0]}/finish", {"reason": {"type": "success"}})

    async def search(**criteria: Any) -> dict[str, Any]:
        response = await api.post("sessions/search", criteria)
        assert response.status_code == 200, response.text
        return dict(response.json())

    found = await search(display_name="sweep LR")
    assert [s["session_id"] for s in found["sessions"]] == ids[::-1]  # newest first
    assert {s["owner"] for s in found["sessions"]} == {"tml:user:alice"}
    assert [s["session_id"] for s in (await search(user_metadata={"sweep": "a"}))["sessions"]] == [
        ids[1],
        ids[0],
    ]
    done = await search(statuses=[{"type": "client_finished", "reasons": ["success"]}])
    assert [s["session_id"] for s in done["sessions"]] == [ids[0]]
    assert done["sessions"][0]["status"] == {
        "type": "client_finished",
        "reason": {"type": "success"},
    }
    active = await search(statuses=[{"type": "active"}], display_name="sweep")
    assert {s["session_id"] for s in active["sessions"]} == {ids[1], ids[2]}
    page1 = await search(display_name="sweep", limit=2)
    page2 = await search(display_name="sweep", limit=2, cursor=page1["next_cursor"])
    assert [s["session_id"] for s in page1["sessions"] + page2["sessions"]] == ids[::-1]
    assert page2["next_cursor"] is None
    expect_error(await api.post("sessions/search", {"limit": 0}), 400, "limit")
    expect_error(
        await api.post("sessions/search", {"project_ids": ["no way"]}), 400, "project_ids[0]"
    )


async def test_trace_export_is_a_signed_json_file_of_the_sessions_requests(
    api: Api, other_tenant: Api
) -> None:
    session_id, model_id, _ = await _run_with_checkpoint(api)
    sampler_id = await sampler(api, session_id)
    await sample(api, sampler_id, [5, 7], max_tokens=2)
    answer = await api.get(f"sessions/{session_id}/trace_export")
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "ready"
    url = answer.json()["url"]
    fetched = await api.http.get(url)  # no key: the signature is the credential
    assert fetched.status_code == 200, fetched.text
    trace = json.loads(fetched.content)
    requests = trace["requests"]
    assert [r["type"] for r in requests] == [
        "CreateModel",
        "ForwardBackward",
        "SaveWeights",
        "Sample",
    ]
    assert {r["target"] for r in requests} == {model_id, sampler_id}
    assert all(r["status"] == "ok" and r["duration_s"] >= 0 for r in requests)
    assert [e["ph"] for e in trace["traceEvents"] if e["ph"] == "X"] == ["X"] * 4
    # Altered: 403; another tenant's session: 404.
    assert (await api.http.get(url.replace("tenant=alice", "tenant=bob"))).status_code == 403
    expect_error(await other_tenant.get(f"sessions/{session_id}/trace_export"), 404, "session_id")


async def test_billing_usage_events_come_from_metering(api: Api) -> None:
    session_id, _model, _ = await _run_with_checkpoint(api, "research")
    sampler_id = await sampler(api, session_id)
    # No stop tokens: an unseeded draw could end at EOS before the four tokens metered below.
    await sample(api, sampler_id, [5, 7, 9], max_tokens=4, stop=[])
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    window = {
        "starting_on": hour.isoformat(),
        "ending_before": (hour + timedelta(hours=1)).isoformat(),
    }
    response = await api.get("billing/usage/events", params=window)
    assert response.status_code == 200, response.text
    kinds = {e["event_info"]["type"]: e for e in response.json()["data"]}
    assert kinds["training"]["event_info"]["token_count"] == len(TOKENS) - 1
    assert kinds["sampling_prefill"]["event_info"]["token_count"] == 3
    assert kinds["sampling_sample"]["event_info"]["token_count"] == 4
    assert kinds["checkpoint"]["event_info"]["count"] == 1
    assert {e["project_id"] for e in response.json()["data"]} == {"research"}
    assert set(response.json()["sessions"]) == {session_id}
    bad = {
        "starting_on": (hour + timedelta(minutes=5)).isoformat(),
        "ending_before": window["ending_before"],
    }
    expect_error(await api.get("billing/usage/events", params=bad), 400, "starting_on")
    long = {**window, "ending_before": (hour + timedelta(days=15)).isoformat()}
    expect_error(await api.get("billing/usage/events", params=long), 400, "ending_before")


async def test_copy_into_a_session_slot_and_refused_tokens(api: Api) -> None:
    session_id, _run, weights = await _run_with_checkpoint(api, "research")
    body = {"source_path": weights, "session_id": session_id, "model_seq_id": 5}
    copied = await api.post("copy_weights", body)
    assert copied.status_code == 200, copied.text
    path = copied.json()["tinker_path"]
    assert path.startswith(f"tinker://{session_id}:train:5/")
    # The slot is taken now; the copy is in its session's project.
    expect_error(await api.post("copy_weights", body), 400, "model_seq_id")
    runs = _runs(await api.get("training_runs", params={"project_id": "research"}))
    assert f"{session_id}:train:5" in runs
    expect_error(await api.post("copy_weights", {**body, "model_seq_id": None}), 400, "session_id")
    token = {"source_path": weights, "destination_project_id": "x", "weights_access_token": "t"}
    expect_error(await api.post("copy_weights", token), 400, "weights_access_token")
