"""What a second run of the server on the same data dir and database answers about the first's
requests, adapters and samplers (in process; tests/integration/test_restart.py kills a real one).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.server.harness import (
    Api,
    datum,
    decode_output,
    expect_error,
    optim_step,
    sample_body,
    sampler,
    serve,
)
from tuneloop.server.scheduler.futures import FutureTable

TOKENS = [5, 17, 33, 90, 120, 7]


def test_request_ids_carry_the_boot_id() -> None:
    table = FutureTable()
    request_id = table.create("alice", "Sample")
    assert re.fullmatch(rf"req-{table.boot_id}-[0-9a-f]{{24}}", request_id)
    assert not table.issued_earlier(request_id)
    later = FutureTable()
    assert later.boot_id != table.boot_id
    assert later.issued_earlier(request_id)
    assert later.issued_earlier("req-" + "ab" * 12)  # an id of a version before boot ids
    for never_issued in ("req-nope", "req-1", f"req-{later.boot_id}-{'0' * 24}x", "x" * 40):
        assert not later.issued_earlier(never_issued)
    with pytest.raises(ValueError, match="boot_id"):
        FutureTable(boot_id="not-hex!")


async def _first_run(api: Api) -> dict[str, str]:
    """A session with a trained model, a checkpoint, a sampler and a request left in flight."""
    session_id = await api.session()
    model_id = await api.model(session_id)
    trained = await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    assert trained.status_code == 200, trained.text
    assert (await optim_step(api, model_id, 2)).status_code == 200
    save = {"model_id": model_id, "seq_id": 3, "path": "before-restart"}
    saved = await api.result(await api.post("save_weights", save))
    assert saved.status_code == 200, saved.text
    sampler_id = await sampler(api, session_id)
    # seq 5 waits for a seq 4 that never comes: in flight when the server goes.
    waiting = await api.forward_backward(model_id, 5, [datum(TOKENS)])
    assert waiting.status_code == 200, waiting.text
    return {
        "session_id": session_id,
        "model_id": model_id,
        "checkpoint": saved.json()["path"],
        "sampler_id": sampler_id,
        "request_id": waiting.json()["request_id"],
    }


async def test_second_run_answers_410_for_what_the_first_held_and_keeps_the_records(
    tmp_path: Path, db_url: str
) -> None:
    async with serve(tmp_path, db_url=db_url) as api:
        first = await _first_run(api)

    async with serve(tmp_path, db_url=db_url) as api:
        # The in-flight request: a clear, final answer at once, not 404 and not a wait.
        lost = await api.post("retrieve_future", {"request_id": first["request_id"]})
        body = expect_error(lost, 410, "request_id")
        assert body["reason"] == "server_restarted"
        assert "submit the request again" in body["detail"]
        expect_error(
            await api.post("retrieve_future", {"request_id": "req-nope"}), 404, "request_id"
        )

        # The adapter and the sampler lived in the first process only.
        model_id = first["model_id"]
        body = expect_error(
            await api.forward_backward(model_id, 6, [datum(TOKENS)]), 410, "model_id"
        )
        assert body["reason"] == "server_restarted"
        assert "create_training_client_from_state_with_optimizer" in body["detail"]
        step = {"model_id": model_id, "seq_id": 7, "adam_params": {"learning_rate": 0.1}}
        expect_error(await api.post("optim_step", step), 410, "model_id")
        asample = await api.post("asample", sample_body(first["sampler_id"], TOKENS[:3]))
        body = expect_error(asample, 410, "sampling_session_id")
        assert body["reason"] == "server_restarted"

        # The records are intact and the session is still live.
        session_id = first["session_id"]
        assert (await api.post("session_heartbeat", {"session_id": session_id})).status_code == 200
        children = (await api.get(f"sessions/{session_id}")).json()
        assert model_id in children["training_run_ids"]
        assert first["sampler_id"] in children["sampler_ids"]
        assert (await api.get(f"training_runs/{model_id}")).json()["lora_rank"] == 4
        listed = (await api.get(f"training_runs/{model_id}/checkpoints")).json()
        assert [c["tinker_path"] for c in listed["checkpoints"]] == [first["checkpoint"]]

        # The client carries on from its checkpoint in a new training run of the same session.
        load = {
            "session_id": session_id,
            "model_seq_id": 1,
            "path": first["checkpoint"],
            "optimizer": True,
        }
        loaded = await api.result(await api.post("load_weights", load))
        assert loaded.status_code == 200, loaded.text
        resumed = loaded.json()["model_id"]
        assert resumed != model_id
        step = await api.result(await api.forward_backward(resumed, 1, [datum(TOKENS)]))
        assert step.status_code == 200, step.text
        assert decode_output(step.content).metrics["loss:sum"] > 0
        assert (await optim_step(api, resumed, 2)).status_code == 200
        fresh = await sampler(api, session_id, seq=1)
        sampled = await api.result(await api.post("asample", sample_body(fresh, TOKENS[:3])))
        assert sampled.status_code == 200, sampled.text
