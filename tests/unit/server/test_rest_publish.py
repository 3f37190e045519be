"""Published checkpoints: other tenants read them by path (sampling, loading into a new training
run, weights info), and can never change, unpublish or delete them."""

from __future__ import annotations

from typing import Any

from tests.unit.server.harness import MODEL, Api, datum, expect_error, sample, sampler

TOKENS = [5, 17, 33, 90, 120, 7]


async def _alice_checkpoints(api: Api) -> tuple[str, str, str]:
    session_id = await api.session()
    model_id = await api.model(session_id)
    await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    weights = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "w1", "seq_id": 2})
    )
    sampled = await api.result(
        await api.post(
            "save_weights_for_sampler", {"model_id": model_id, "path": "s1", "seq_id": 3}
        )
    )
    return model_id, weights.json()["path"], sampled.json()["path"]


def _route(path: str) -> str:
    run, _, checkpoint = path.removeprefix("tinker://").partition("/")
    return f"/api/v1/training_runs/{run}/checkpoints/{checkpoint}"


async def _publish(api: Api, path: str) -> dict[str, Any]:
    response = await api.http.post(f"{_route(path)}/publish", headers=api.headers())
    assert response.status_code == 200, response.text
    return dict(response.json())


async def test_a_published_checkpoint_is_readable_by_other_tenants(
    api: Api, other_tenant: Api
) -> None:
    model_id, weights, sampler_path = await _alice_checkpoints(api)
    bob_session = await other_tenant.session()
    # Private: not found for bob, by any read.
    expect_error(
        await other_tenant.post("weights_info", {"tinker_path": weights}), 404, "tinker_path"
    )
    body = {"session_id": bob_session, "sampling_session_seq_id": 0, "model_path": sampler_path}
    expect_error(await other_tenant.post("create_sampling_session", body), 404, "model_path")

    assert (await _publish(api, weights))["changed"] is True
    assert (await _publish(api, weights))["changed"] is False  # twice: a no-op, not a 409
    await _publish(api, sampler_path)
    listed = (await api.get("checkpoints")).json()["checkpoints"]
    assert {c["tinker_path"]: c["public"] for c in listed} == {weights: True, sampler_path: True}
    run = (await api.get(f"training_runs/{model_id}")).json()
    assert run["last_checkpoint"]["public"] is True
    assert run["last_sampler_checkpoint"]["public"] is True

    info = await other_tenant.post("weights_info", {"tinker_path": weights})
    assert info.status_code == 200
    assert info.json()["base_model"] == MODEL
    # Sampling from alice's sampler weights, in bob's own session.
    bob_sampler = await sampler(other_tenant, bob_session, model_path=sampler_path)
    out = await sample(other_tenant, bob_sampler, [5, 7], max_tokens=3, seed=1)
    assert len(out.sequences[0].tokens) == 3
    # A training run of bob's from alice's weights (create_training_client_from_state).
    loaded = await other_tenant.result(
        await other_tenant.post(
            "load_weights",
            {"session_id": bob_session, "model_seq_id": 0, "path": weights, "optimizer": False},
        )
    )
    assert loaded.status_code == 200, loaded.text
    bob_run = f"{bob_session}:train:0"
    assert (await other_tenant.get(f"training_runs/{bob_run}")).json()["model_owner"] == "bob"
    # Alice's audit log shows the reads, by whom.
    events = (await api.get("audit", params={"event_type": "checkpoints"})).json()["entries"]
    reads = [e for e in events if e["event"] == "checkpoint_read"]
    assert {e["event_details"]["reader"] for e in reads} == {"bob"}
    assert {e["event"] for e in events} >= {"checkpoint_published", "checkpoint_read"}


async def test_others_can_never_write_a_published_checkpoint(api: Api, other_tenant: Api) -> None:
    _model, weights, _ = await _alice_checkpoints(api)
    await _publish(api, weights)
    route = _route(weights)
    headers = other_tenant.headers()
    attempts = [
        await other_tenant.http.delete(route, headers=headers),
        await other_tenant.http.put(f"{route}/ttl", json={"ttl_seconds": 3600}, headers=headers),
        await other_tenant.http.delete(f"{route}/publish", headers=headers),
        await other_tenant.http.post(f"{route}/publish", headers=headers),
    ]
    for response in attempts:
        expect_error(response, 404, "checkpoint_id")
    # Still there, still public, no expiry.
    listed = (await api.get("checkpoints")).json()["checkpoints"]
    mine = next(c for c in listed if c["tinker_path"] == weights)
    assert mine["public"] is True
    assert mine["expires_at"] is None
    # Bob's listings never show it.
    assert weights not in (await other_tenant.get("checkpoints")).text


async def test_unpublish_and_delete_end_other_tenants_reads(api: Api, other_tenant: Api) -> None:
    _model, weights, _ = await _alice_checkpoints(api)
    await _publish(api, weights)
    assert (await other_tenant.post("weights_info", {"tinker_path": weights})).status_code == 200
    response = await api.http.delete(f"{_route(weights)}/publish", headers=api.headers())
    assert response.json()["changed"] is True
    expect_error(
        await other_tenant.post("weights_info", {"tinker_path": weights}), 404, "tinker_path"
    )
    await _publish(api, weights)
    assert (await api.http.delete(_route(weights), headers=api.headers())).status_code == 200
    expect_error(
        await other_tenant.post("weights_info", {"tinker_path": weights}), 404, "tinker_path"
    )
    events = {e["event"] for e in (await api.get("audit")).json()["entries"]}
    assert {"checkpoint_unpublished", "checkpoint_deleted"} <= events


async def test_new_files_at_a_published_path_are_private(api: Api, other_tenant: Api) -> None:
    model_id, weights, _ = await _alice_checkpoints(api)
    await _publish(api, weights)
    assert (await other_tenant.post("weights_info", {"tinker_path": weights})).status_code == 200
    # Overwritten (new files at the same path): the publication covered the old ones.
    body = {"model_id": model_id, "path": "w1", "seq_id": 4, "overwrite": True}
    assert (await api.result(await api.post("save_weights", body))).status_code == 200
    expect_error(
        await other_tenant.post("weights_info", {"tinker_path": weights}), 404, "tinker_path"
    )
    listed = (await api.get("checkpoints")).json()["checkpoints"]
    assert next(c for c in listed if c["tinker_path"] == weights)["public"] is False
