"""REST routes: training runs, checkpoints, weights info, sessions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.unit.server.harness import MODEL, Api, datum, expect_error, sampler

TOKENS = [5, 17, 33, 90, 120, 7]


async def create_model(api: Api, session_id: str, seq: int, **extra: Any) -> str:
    body = {"session_id": session_id, "model_seq_id": seq, "base_model": MODEL, **extra}
    done = await api.result(await api.post("create_model", body))
    return str(done.json()["model_id"])


async def test_training_runs_list_paginates_with_cursor(api: Api) -> None:
    session_id = await api.session()
    models = [await create_model(api, session_id, i, lora_config={"rank": 2}) for i in range(5)]
    seen: list[str] = []
    for offset in (0, 2, 4):
        page = await api.get("training_runs", params={"limit": 2, "offset": offset})
        assert page.status_code == 200, page.text
        body = page.json()
        assert body["cursor"] == {"offset": offset, "limit": 2, "total_count": 5}
        assert len(body["training_runs"]) == (1 if offset == 4 else 2)
        seen += [r["training_run_id"] for r in body["training_runs"]]
    assert sorted(seen) == sorted(models)
    assert len(set(seen)) == 5
    past = (await api.get("training_runs", params={"limit": 2, "offset": 10})).json()
    assert past["training_runs"] == []
    assert past["cursor"]["total_count"] == 5
    run = (await api.get("training_runs")).json()["training_runs"][0]
    assert run["base_model"] == MODEL
    assert run["model_owner"] == "alice"
    assert run["is_lora"] is True
    assert run["lora_rank"] == 2
    expect_error(await api.get("training_runs", params={"limit": 0}), 400, "limit")
    expect_error(await api.get("training_runs", params={"offset": -1}), 400, "offset")


async def test_training_run_get_round_trips_user_metadata(api: Api) -> None:
    session_id = await api.session()
    metadata = {"renderer_name": "llama3", "step": 3, "nested": {"a": [1, 2]}}
    model_id = await create_model(api, session_id, 0, user_metadata=metadata)
    run = (await api.get(f"training_runs/{model_id}")).json()
    assert run["training_run_id"] == model_id
    assert run["user_metadata"] == metadata
    assert run["last_checkpoint"] is None
    assert run["last_sampler_checkpoint"] is None
    expect_error(await api.get("training_runs/nope:train:0"), 404, "training_run_id")

    # A model loaded from a checkpoint keeps the source's metadata unless given new metadata.
    await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    saved = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "w", "seq_id": 2})
    )
    path = saved.json()["path"]
    load = {"session_id": session_id, "path": path}
    inherited = await api.result(await api.post("load_weights", {**load, "model_seq_id": 1}))
    clone = inherited.json()["model_id"]
    assert (await api.get(f"training_runs/{clone}")).json()["user_metadata"] == metadata
    replaced = await api.result(
        await api.post(
            "load_weights", {**load, "model_seq_id": 2, "user_metadata": {"renderer_name": "x"}}
        )
    )
    run = (await api.get(f"training_runs/{replaced.json()['model_id']}")).json()
    assert run["user_metadata"] == {"renderer_name": "x"}


async def test_checkpoints_list_training_and_sampler(api: Api) -> None:
    model_id = await api.model(await api.session())
    await api.result(
        await api.post(
            "save_weights",
            {"model_id": model_id, "path": "w1", "seq_id": 1, "user_metadata": {"k": "v"}},
        )
    )
    await api.result(
        await api.post(
            "save_weights_for_sampler",
            {"model_id": model_id, "path": "s1", "seq_id": 2, "ttl_seconds": 3600},
        )
    )
    listed = (await api.get(f"training_runs/{model_id}/checkpoints")).json()["checkpoints"]
    by_id = {c["checkpoint_id"]: c for c in listed}
    assert set(by_id) == {"weights/w1", "sampler_weights/s1"}
    assert by_id["weights/w1"]["checkpoint_type"] == "training"
    assert by_id["weights/w1"]["tinker_path"] == f"tinker://{model_id}/weights/w1"
    assert by_id["weights/w1"]["user_metadata"] == {"k": "v"}
    assert by_id["weights/w1"]["expires_at"] is None
    assert by_id["sampler_weights/s1"]["checkpoint_type"] == "sampler"
    assert by_id["sampler_weights/s1"]["expires_at"] is not None
    assert all(c["size_bytes"] > 0 for c in listed)
    assert all(c["public"] is False for c in listed)

    run = (await api.get(f"training_runs/{model_id}")).json()
    assert run["last_checkpoint"]["checkpoint_id"] == "weights/w1"
    assert run["last_sampler_checkpoint"]["checkpoint_id"] == "sampler_weights/s1"


async def test_user_checkpoints_list_spans_runs_and_paginates(api: Api) -> None:
    session_id = await api.session()
    paths = set()
    for i in range(2):
        model_id = await create_model(api, session_id, i)
        for j in range(2):
            saved = await api.result(
                await api.post(
                    "save_weights", {"model_id": model_id, "path": f"c{j}", "seq_id": j + 1}
                )
            )
            paths.add(saved.json()["path"])
    everything = (await api.get("checkpoints")).json()
    assert {c["tinker_path"] for c in everything["checkpoints"]} == paths
    assert everything["cursor"]["total_count"] == 4
    pages = [
        (await api.get("checkpoints", params={"limit": 3, "offset": o})).json() for o in (0, 3)
    ]
    assert [len(p["checkpoints"]) for p in pages] == [3, 1]
    assert {c["tinker_path"] for p in pages for c in p["checkpoints"]} == paths


def files_under(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()]


async def test_delete_checkpoint_removes_files_and_row(api: Api) -> None:
    model_id = await api.model(await api.session())
    for seq, name in ((1, "keep"), (2, "gone")):
        await api.result(
            await api.post("save_weights", {"model_id": model_id, "path": name, "seq_id": seq})
        )
    root = api.keys.path.parent / "checkpoints"
    gone_dirs = [p for p in root.rglob("gone") if p.is_dir()]
    assert len(gone_dirs) == 1
    assert files_under(gone_dirs[0])

    url = f"/api/v1/training_runs/{model_id}/checkpoints/weights/gone"
    deleted = await api.http.delete(url, headers=api.headers())
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"deleted": f"tinker://{model_id}/weights/gone"}
    assert not gone_dirs[0].exists()
    listed = (await api.get(f"training_runs/{model_id}/checkpoints")).json()["checkpoints"]
    assert [c["checkpoint_id"] for c in listed] == ["weights/keep"]
    assert [p for p in root.rglob("keep") if p.is_dir()]

    expect_error(await api.http.delete(url, headers=api.headers()), 404, "checkpoint_id")
    info = {"tinker_path": f"tinker://{model_id}/weights/gone"}
    expect_error(await api.post("weights_info", info), 404, "tinker_path")
    load = {"model_id": model_id, "seq_id": 3, "path": info["tinker_path"]}
    expect_error(await api.post("load_weights", load), 404, "path")
    bad = await api.http.delete(
        f"/api/v1/training_runs/{model_id}/checkpoints/bogus/x", headers=api.headers()
    )
    expect_error(bad, 400, "checkpoint_id")


async def test_weights_info(api: Api) -> None:
    session_id = await api.session()
    model_id = await create_model(api, session_id, 0, lora_config={"rank": 8, "train_attn": False})
    saved = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "w", "seq_id": 1})
    )
    info = (await api.post("weights_info", {"tinker_path": saved.json()["path"]})).json()
    assert info == {
        "base_model": MODEL,
        "optimizer_config": {"type": "adamw"},
        "is_lora": True,
        "lora_rank": 8,
        "train_unembed": True,
        "train_mlp": True,
        "train_attn": False,
        "train_experts": None,
    }


async def test_sessions_list_and_get(api: Api) -> None:
    first = await api.session()
    second = (
        await api.post("create_session", {"tags": ["t"], "user_metadata": {"who": "me"}})
    ).json()["session_id"]
    model_a = await create_model(api, second, 0)
    model_b = await create_model(api, second, 1)
    base = await sampler(api, second, seq=0)
    snap = await api.result(
        await api.post(
            "save_weights_for_sampler",
            {"model_id": model_a, "seq_id": 1, "sampling_session_seq_id": 1},
        )
    )

    listed = (await api.get("sessions")).json()["sessions"]
    assert set(listed) == {first, second}
    paged = [(await api.get("sessions", params={"limit": 1, "offset": o})).json() for o in (0, 1)]
    assert {s for p in paged for s in p["sessions"]} == {first, second}

    got = (await api.get(f"sessions/{second}")).json()
    assert sorted(got["training_run_ids"]) == sorted([model_a, model_b])
    assert sorted(got["sampler_ids"]) == sorted([base, snap.json()["sampling_session_id"]])
    assert got["user_metadata"] == {"who": "me"}
    empty = (await api.get(f"sessions/{first}")).json()
    assert empty["training_run_ids"] == []
    assert empty["sampler_ids"] == []
    expect_error(await api.get("sessions/nope"), 404, "session_id")
    expect_error(await api.get("sessions", params={"limit": 0}), 400, "limit")


async def test_saving_over_a_name_needs_overwrite(api: Api) -> None:
    model_id = await api.model(await api.session())
    body = {"model_id": model_id, "path": "w"}
    first = await api.result(await api.post("save_weights", {**body, "seq_id": 1}))
    assert first.json()["path"] == f"tinker://{model_id}/weights/w"
    refused = await api.result(await api.post("save_weights", {**body, "seq_id": 2}))
    assert refused.json()["category"] == "user"
    assert "overwrite" in refused.json()["error"]
    again = await api.result(
        await api.post("save_weights", {**body, "seq_id": 3, "overwrite": True})
    )
    assert again.json()["path"] == first.json()["path"]
    listed = (await api.get(f"training_runs/{model_id}/checkpoints")).json()["checkpoints"]
    assert [c["checkpoint_id"] for c in listed] == ["weights/w"]


async def test_weights_info_reports_every_lora_target_group(api: Api) -> None:
    session_id = await api.session()
    lora = {"rank": 2, "train_attn": True, "train_mlp": True, "train_experts": False}
    model_id = await create_model(api, session_id, 0, lora_config=lora)
    saved = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "w", "seq_id": 1})
    )
    info = await api.post("weights_info", {"tinker_path": saved.json()["path"]})
    assert info.status_code == 200, info.text
    body = info.json()
    assert (body["lora_rank"], body["train_attn"], body["train_mlp"]) == (2, True, True)
    assert body["train_experts"] is False
