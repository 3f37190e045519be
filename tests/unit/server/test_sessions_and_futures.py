"""Session life cycle, futures and long-polling, and the small client routes."""

from __future__ import annotations

import base64
import hashlib
import time
from pathlib import Path

from tests.unit.server.harness import MODEL, Api, datum, decode_output, expect_error, serve

TOKENS = [5, 17, 33, 90, 120, 7]


async def test_heartbeat_ok(api: Api) -> None:
    session_id = await api.session()
    response = await api.post("session_heartbeat", {"session_id": session_id})
    assert response.status_code == 200
    assert response.json() == {"type": "session_heartbeat"}
    expect_error(
        await api.post("session_heartbeat", {"session_id": "no-such-session"}), 404, "session_id"
    )


async def test_finish_is_first_wins_and_then_gone(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    first = await api.post(f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
    assert first.status_code == 200, first.text
    assert first.json() == {"session_id": session_id, "finished": True, "first": True}
    second = await api.post(f"sessions/{session_id}/finish", {"reason": {"type": "errored"}})
    assert second.json()["first"] is False

    expect_error(await api.post("session_heartbeat", {"session_id": session_id}), 410, "session_id")
    create = {"session_id": session_id, "model_seq_id": 1, "base_model": MODEL}
    expect_error(await api.post("create_model", create), 410, "session_id")
    expect_error(await api.forward_backward(model_id, 1, [datum(TOKENS)]), 410, "session_id")
    step = {"model_id": model_id, "seq_id": 1, "adam_params": {}}
    expect_error(await api.post("optim_step", step), 410, "session_id")
    # Reading is still allowed after finishing.
    assert (await api.get(f"sessions/{session_id}")).status_code == 200
    assert (await api.get(f"training_runs/{model_id}")).status_code == 200

    # Other sessions are unaffected.
    other = await api.session()
    assert (await api.post("session_heartbeat", {"session_id": other})).status_code == 200


async def test_finish_unknown_session_is_404(api: Api) -> None:
    expect_error(await api.post("sessions/nope/finish", {}), 404, "session_id")


async def test_retrieve_future_long_polls_then_408_try_again(tmp_path: Path) -> None:
    async with serve(tmp_path, long_poll_s=0.2) as api:
        model_id = await api.model(await api.session())
        # seq 2 waits for a seq 1 that has not arrived.
        waiting = await api.forward_backward(model_id, 2, [datum(TOKENS)])
        request_id = waiting.json()["request_id"]
        started = time.monotonic()
        polled = await api.post("retrieve_future", {"request_id": request_id})
        held = time.monotonic() - started
        assert polled.status_code == 408
        body = polled.json()
        assert body["type"] == "try_again"
        assert body["request_id"] == request_id
        assert body["queue_state"] == "active"
        assert "error" not in body
        assert held >= 0.15  # it was held, not answered at once

        await api.forward_backward(model_id, 1, [datum(TOKENS)])
        done = await api.result(waiting)
        assert done.headers["content-type"] == "application/x-protobuf"


async def test_retrieve_future_answers_as_soon_as_ready(tmp_path: Path) -> None:
    async with serve(tmp_path, long_poll_s=5.0) as api:
        model_id = await api.model(await api.session())
        waiting = await api.forward_backward(model_id, 2, [datum(TOKENS)])
        await api.forward_backward(model_id, 1, [datum(TOKENS)])
        started = time.monotonic()
        done = await api.post("retrieve_future", {"request_id": waiting.json()["request_id"]})
        assert done.status_code == 200
        assert time.monotonic() - started < 2.0


async def test_unknown_request_id_is_404(api: Api) -> None:
    expect_error(await api.post("retrieve_future", {"request_id": "req-nope"}), 404, "request_id")


async def test_results_can_be_fetched_again(api: Api) -> None:
    model_id = await api.model(await api.session())
    submitted = await api.forward_backward(model_id, 1, [datum(TOKENS)])
    first = await api.result(submitted)
    again = await api.result(submitted)
    assert again.status_code == 200
    assert again.content == first.content
    assert decode_output(again.content).metrics["loss:sum"] > 0


async def test_failed_future_is_200_error_body(api: Api) -> None:
    model_id = await api.model(await api.session())
    # Loading weights that the registry knows but whose files are gone fails in the engine.
    saved = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "w", "seq_id": 1})
    )
    path = saved.json()["path"]
    run_dirs = list((api.keys.path.parent / "checkpoints").rglob("w"))
    assert len(run_dirs) == 1
    for f in run_dirs[0].iterdir():
        f.unlink()
    failed = await api.result(
        await api.post("load_weights", {"model_id": model_id, "seq_id": 2, "path": path})
    )
    assert failed.status_code == 200
    body = failed.json()
    assert set(body) == {"error", "category"}
    assert body["category"] == "user"
    assert body["error"]
    # The model's stream continues after a failed operation.
    out = await api.result(await api.forward_backward(model_id, 3, [datum(TOKENS)]))
    assert decode_output(out.content).metrics["loss:sum"] > 0


async def test_dynamic_config_and_telemetry(api: Api) -> None:
    config = await api.post("client/dynamic_config", {})
    assert config.status_code == 200
    assert config.json()["sample_cancel_enabled"] is False
    telemetry = await api.post(
        "telemetry",
        {"events": [{"event": "x", "n": 1}], "platform": "linux", "sdk_version": "0.38.0"},
    )
    assert telemetry.status_code == 200
    assert telemetry.json() == {"status": "accepted"}


async def test_healthz_needs_no_key(api: Api) -> None:
    response = await api.http.get("/api/v1/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


async def test_client_config_flags(api: Api) -> None:
    response = await api.post("client/config", {"sdk_version": "0.38.0"})
    assert response.status_code == 200
    flags = response.json()
    assert flags["pjwt_auth_enabled"] is False
    assert flags["sample_use_retrieve_futures"] is True
    assert flags["sample_join_sampling_session"] is True
    assert flags["custom_loss_server_side"] is True
    assert flags["proto_compress_fwdbwd"] is True
    assert flags["fwdbwd_max_chunk_len"] > 0


async def test_capabilities_list_the_fake_model(api: Api) -> None:
    response = await api.get("get_server_capabilities")
    assert response.status_code == 200
    models = response.json()["supported_models"]
    assert models == [
        {
            "model_name": MODEL,
            "max_context_length": 2048,
            "trainable": True,
            "sampleable": True,
            "arch": "bigram",
            # The fake backend has no layers to report LoRA coverage for.
            "num_parameters": None,
            "lora_groups": None,
            "lora_coverage": None,
            "lora_parameters_per_rank": None,
        }
    ]


async def test_tokenizer_route_returns_files_and_sha256(api: Api) -> None:
    response = await api.get("tokenizer", params={"base_model": MODEL})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["base_model"] == MODEL
    assert "tokenizer.json" in body["files"]
    digest = hashlib.sha256()
    for name, encoded in body["files"].items():
        digest.update(name.encode() + b"\0" + base64.b64decode(encoded))
    assert body["sha256"] == digest.hexdigest()
    again = await api.get("tokenizer", params={"base_model": MODEL})
    assert again.json()["sha256"] == body["sha256"]
    expect_error(await api.get("tokenizer", params={"base_model": "nope"}), 400, "base_model")


def tokenizer_file_exists(folder: str) -> bool:
    return (Path(folder) / "tokenizer.json").is_file()


async def test_get_info(api: Api) -> None:
    model_id = await api.model(await api.session(), rank=8)
    info = (await api.post("get_info", {"model_id": model_id})).json()
    assert info["model_id"] == model_id
    assert info["lora_rank"] == 8
    assert info["model_data"]["model_name"] == MODEL
    assert tokenizer_file_exists(info["model_data"]["tokenizer_id"])
