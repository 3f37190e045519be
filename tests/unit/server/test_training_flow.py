"""The training stream end to end over HTTP: create, forward_backward, optim_step, save, load."""

from __future__ import annotations

import numpy as np

from tests.unit.server.harness import Api, datum, decode_output

TOKENS = [5, 17, 33, 90, 120, 7, 64, 200]


async def test_cross_entropy_trains_and_loss_goes_down(api: Api) -> None:
    model_id = await api.model(await api.session())
    losses = []
    seq = 1
    for _ in range(4):
        out = await api.result(await api.forward_backward(model_id, seq, [datum(TOKENS)]))
        assert out.headers["content-type"] == "application/x-protobuf"
        result = decode_output(out.content)
        losses.append(result.metrics["loss:sum"])
        assert result.loss_fn_outputs[0]["logprobs"].to_numpy().shape == (len(TOKENS) - 1,)
        step = await api.post(
            "optim_step",
            {"model_id": model_id, "seq_id": seq + 1, "adam_params": {"learning_rate": 0.05}},
        )
        assert (await api.result(step)).json()["metrics"]["grad_norm"] > 0
        seq += 2
    assert losses[-1] < losses[0] - 1.0


async def test_loss_sum_equals_minus_sum_of_weighted_logprobs(api: Api) -> None:
    model_id = await api.model(await api.session())
    weights = np.array([1.0, 0.5, 0.0, -1.0, 2.0, 1.0, 0.25], dtype=np.float32)
    out = await api.result(
        await api.forward_backward(model_id, 1, [datum(TOKENS, weights=weights)])
    )
    result = decode_output(out.content)
    lp = result.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.isclose(result.metrics["loss:sum"], -(weights * lp).sum(), rtol=1e-5)


async def test_requests_run_in_seq_order_even_when_they_arrive_out_of_order(api: Api) -> None:
    model_id = await api.model(await api.session())
    # seq 2 (optim_step) arrives before seq 1 (forward_backward): it must wait for it.
    late_step = await api.post(
        "optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.1}}
    )
    first = await api.forward_backward(model_id, 1, [datum(TOKENS)])
    step = (await api.result(late_step)).json()
    assert step["metrics"]["grad_norm"] > 0  # had gradients: seq 1 ran first
    before = decode_output((await api.result(first)).content).metrics["loss:sum"]
    after_resp = await api.forward_backward(model_id, 3, [datum(TOKENS)], forward_only=True)
    after = decode_output((await api.result(after_resp)).content).metrics["loss:sum"]
    assert after < before


async def test_retry_of_same_seq_returns_same_request_and_conflict_is_409(api: Api) -> None:
    model_id = await api.model(await api.session())
    first = await api.forward_backward(model_id, 1, [datum(TOKENS)])
    again = await api.forward_backward(model_id, 1, [datum(TOKENS)])
    assert first.json()["request_id"] == again.json()["request_id"]
    other = await api.forward_backward(model_id, 1, [datum(TOKENS[:-1])])
    assert other.status_code == 409
    assert other.json()["field"] == "seq_id"
    await api.result(first)


async def test_save_and_load_state_restores_weights(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    await api.result(
        await api.post(
            "optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.1}}
        )
    )
    saved = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "s1", "seq_id": 3})
    )
    path = saved.json()["path"]
    assert path == f"tinker://{model_id}/weights/s1"
    reference = decode_output(
        (
            await api.result(
                await api.forward_backward(model_id, 4, [datum(TOKENS)], forward_only=True)
            )
        ).content
    ).metrics["loss:sum"]

    loaded = await api.result(
        await api.post(
            "load_weights",
            {
                "session_id": session_id,
                "model_seq_id": 1,
                "path": path,
                "optimizer": True,
            },
        )
    )
    clone = loaded.json()["model_id"]
    assert clone == f"{session_id}:train:1"
    value = decode_output(
        (
            await api.result(
                await api.forward_backward(clone, 1, [datum(TOKENS)], forward_only=True)
            )
        ).content
    ).metrics["loss:sum"]
    assert np.isclose(value, reference)
