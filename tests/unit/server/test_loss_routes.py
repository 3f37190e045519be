"""The loss routes through the HTTP API (fake engine): create_custom_loss (idempotent per
seq id, 409 on a different loss, per session and per tenant) and loss_fn="custom"; sampling
with record_stability_info feeding stable_reinforce, tenants apart."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from tests.unit.server.harness import (
    Api,
    datum,
    decode_output,
    expect_error,
    sample,
    sample_body,
    sampler,
)
from tuneloop.types import PromptProvenanceSpan, SampledProvenanceSpan
from tuneloop.types.codec import decode_sample_response

TOKENS = [5, 17, 33, 90, 120, 7]
N = len(TOKENS) - 1


def weighted_nll(name: str = "neg_ll", scale: float = 1.0) -> dict[str, Any]:
    """`-(logprobs * weights).sum() * scale` as the official SDK encodes its fx graph."""

    def call(op: str, name: str, target: str, *args: Any) -> dict[str, Any]:
        return {"op": op, "name": name, "target": target, "args": list(args)}

    metrics = {"custom/nll:sum": {"ref": "out"}, "custom/w:mean": {"ref": "sum_1"}}
    nodes = [
        {"op": "placeholder", "name": "logprobs", "target": "logprobs"},
        {"op": "placeholder", "name": "weights", "target": "weights"},
        call("call_function", "mul", "operator.mul", {"ref": "logprobs"}, {"ref": "weights"}),
        call("call_method", "sum_1", "sum", {"ref": "mul"}),
        call("call_function", "neg", "operator.neg", {"ref": "sum_1"}),
        call("call_function", "out", "operator.mul", {"ref": "neg"}, scale),
        call("output", "output", "output", {"tuple": [{"ref": "out"}, {"dict": metrics}]}),
    ]
    return {
        "name": name,
        "inputs": [{"name": "logprobs", "rank": 1}, {"name": "weights", "rank": 1}],
        "graph": {"format": 1, "nodes": nodes},
    }


async def create(api: Api, session_id: str, seq: int, loss: dict[str, Any]) -> Any:
    body = {"session_id": session_id, "custom_loss_seq_id": seq, **loss}
    return await api.post("create_custom_loss", body)


async def test_custom_loss_runs_in_one_forward_backward(api: Api, other_tenant: Api) -> None:
    session = await api.session()
    model = await api.model(session)
    done = await api.result(await create(api, session, 0, weighted_nll()))
    loss_id = done.json()["loss_id"]
    again = await api.result(await create(api, session, 0, weighted_nll()))
    assert again.json()["loss_id"] == loss_id
    expect_error(await create(api, session, 0, weighted_nll(scale=2.0)), 409, "custom_loss_seq_id")

    weights = np.linspace(0.5, 2.0, N).astype(np.float32)
    data = [datum(TOKENS, weights=weights), datum(TOKENS[:4], weights=np.ones(3, np.float32))]
    ce = decode_output(
        (
            await api.result(
                await api.forward_backward(model, 1, data, "cross_entropy", forward_only=True)
            )
        ).content
    )
    out = decode_output(
        (
            await api.result(
                await api.forward_backward(model, 2, data, "custom", {"loss_id": loss_id})
            )
        ).content
    )
    assert out.metrics["loss:sum"] == pytest.approx(ce.metrics["loss:sum"], rel=1e-5)
    assert out.metrics["custom/nll:sum"] == pytest.approx(ce.metrics["loss:sum"], rel=1e-5)
    lps = [o["logprobs"].to_numpy() for o in ce.loss_fn_outputs]
    mean_w = np.mean(
        [
            float((lp * d.loss_fn_inputs["weights"].to_numpy()).sum())
            for lp, d in zip(lps, data, strict=True)
        ]
    )
    assert out.metrics["custom/w:mean"] == pytest.approx(mean_w, rel=1e-5)

    wrong_rank = [datum(TOKENS, weights=np.ones((N, 2), np.float32))]
    expect_error(
        await api.forward_backward(model, 3, wrong_rank, "custom", {"loss_id": loss_id}),
        400,
        "data[0].loss_fn_inputs.weights",
    )
    missing = [datum(TOKENS)]
    expect_error(
        await api.forward_backward(model, 4, missing, "custom", {"loss_id": loss_id}),
        400,
        "data[0].loss_fn_inputs.weights",
    )
    # another session of the same tenant may not use it; another tenant cannot see it
    other_session = await api.session()
    other_model = await api.model(other_session)
    expect_error(
        await api.forward_backward(other_model, 1, data, "custom", {"loss_id": loss_id}),
        400,
        "loss_fn_config.loss_id",
    )
    bob_session = await other_tenant.session()
    bob_model = await other_tenant.model(bob_session)
    expect_error(
        await other_tenant.forward_backward(bob_model, 1, data, "custom", {"loss_id": loss_id}),
        404,
        "loss_fn_config.loss_id",
    )


async def test_hostile_graph_is_a_400_naming_the_node(api: Api) -> None:
    session = await api.session()
    loss = weighted_nll()
    loss["graph"]["nodes"][3] = {
        "op": "call_function",
        "name": "sum_1",
        "target": "os.system",
        "args": ["id"],
    }
    body = expect_error(await create(api, session, 1, loss), 400, "graph.nodes[3]")
    assert "sum_1" in body["detail"]


async def test_recorded_samples_train_with_stable_reinforce(api: Api, other_tenant: Api) -> None:
    session = await api.session()
    model = await api.model(session)
    sampler_id = await sampler(api, session)
    prompt = TOKENS[:3]
    body = sample_body(sampler_id, prompt, num_samples=2, max_tokens=4, seed=3, stop=[])
    response = await api.post("asample", {**body, "record_stability_info": True})
    ids = response.json()["sample_sequence_ids"]
    done = await api.result(response)
    seqs = decode_sample_response(done.content).sequences
    data = []
    for sequence_id, seq in zip(ids, seqs, strict=True):
        full = prompt + list(seq.tokens)
        d = datum(full, advantages=np.ones(len(full) - 1, np.float32))
        spans_in = (
            PromptProvenanceSpan(sequence_id=sequence_id, length=3),
            SampledProvenanceSpan(sequence_id=sequence_id, length=3),
        )
        spans_out = (
            PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=2),
            SampledProvenanceSpan(sequence_id=sequence_id, length=4),
        )
        data.append(replace(d, model_input_spans=spans_in, loss_fn_input_spans=spans_out))
    out = decode_output(
        (await api.result(await api.forward_backward(model, 1, data, "stable_reinforce"))).content
    )
    lp = np.concatenate([o["logprobs"].to_numpy()[2:] for o in out.loss_fn_outputs])
    q = np.concatenate([np.asarray(s.logprobs) for s in seqs])
    ratio = np.minimum(np.exp(lp - q), 2.0)
    assert out.metrics["loss:sum"] == pytest.approx(-float((ratio * lp).sum()), rel=1e-4)

    # not recorded without the flag; bob cannot name alice's sequences
    plain = await sample(api, sampler_id, prompt, max_tokens=4, seed=3, stop=[])
    assert plain.sequences
    bob_model = await other_tenant.model(await other_tenant.session())
    expect_error(
        await other_tenant.forward_backward(bob_model, 1, data, "stable_reinforce"),
        400,
        "data[0].model_input_spans[0].sequence_id",
    )
