"""Finishing a session frees its adapters and samplers in the backend; checkpoints stay."""

from __future__ import annotations

from typing import Any

from tests.unit.server.harness import Api, datum
from tuneloop.server.storage.keys import KeyStore

TOKENS = [5, 17, 33, 90, 120, 7, 64, 200]


async def test_finish_frees_adapters_and_samplers_but_keeps_checkpoints(
    api: Api, server: tuple[Any, KeyStore]
) -> None:
    app, _ = server
    backend = app.state.tuneloop.engine.backend
    session_id = await api.session()
    model_id = await api.model(session_id)
    await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    saved = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "keep", "seq_id": 2})
    )
    snapshot = await api.result(
        await api.post(
            "save_weights_for_sampler",
            {"model_id": model_id, "seq_id": 3, "sampling_session_seq_id": 0},
        )
    )
    sampler_id = snapshot.json()["sampling_session_id"]
    prompt = {"chunks": [{"tokens": TOKENS[:3], "type": "encoded_text"}]}
    sampled = await api.post(
        "asample",
        {
            "sampling_session_id": sampler_id,
            "seq_id": 0,
            "prompt": prompt,
            "sampling_params": {"max_tokens": 2},
        },
    )
    await api.result(sampled)
    assert (sampler_id, 0) in app.state.tuneloop.sample_submissions
    # Queued behind a seq that never comes: it must fail when the session finishes, not hang.
    stuck = await api.forward_backward(model_id, 9, [datum(TOKENS)])
    assert model_id in backend._adapters
    assert sampler_id in backend._samplers

    finished = await api.post(f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
    assert finished.status_code == 200
    assert model_id not in backend._adapters
    assert sampler_id not in backend._samplers
    assert not any(k[0] == sampler_id for k in app.state.tuneloop.sample_submissions)
    failed = await api.result(stuck)
    assert "finished" in failed.json()["error"]

    # The checkpoint outlives the session: a new session can train from it.
    other = await api.session()
    loaded = await api.result(
        await api.post(
            "load_weights",
            {
                "session_id": other,
                "model_seq_id": 0,
                "path": saved.json()["path"],
                "optimizer": True,
            },
        )
    )
    assert loaded.json()["model_id"] == f"{other}:train:0"
