"""The official SDK's server-side custom loss and stable_reinforce against a tuneloop server:
`python -m tests.compat.official_losses URL KEY MODEL`.

1. A DPO-style loss created with `create_custom_loss` runs on the server in ONE forward_backward
   and gives the loss, metrics and gradients the SDK's client-side protocol (a forward, then a
   second forward_backward with the surrogate weights) gives, on two adapters of one seed.
   Gradients are compared through one optimizer step with eps = 1 and learning rate 1 (the
   largest the server accepts): the first AdamW step is then g / (|g| + 1) ~= g for the small
   gradients here, so the step is nearly the gradient itself.
   The passes are counted by the server's usage meter.
2. Hostile graphs are refused with a 400 naming the node.
3. stable_reinforce: sampled with record_stability_info, datums with provenance train; a datum
   without provenance, with an unknown sequence or with tokens that were not sampled is a 400
   naming the field.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
import torch.nn.functional as F  # noqa: N812

types = tinker.types
BETA = 0.1


def dpo_style(logprobs, ref_logprobs, weights, sign):  # type: ignore[no-untyped-def]
    margin = ((logprobs - ref_logprobs) * weights).sum()
    loss = -F.logsigmoid(BETA * sign * margin)
    return loss, {
        "custom/reward:mean": (BETA * margin).detach(),
        "custom/tokens:sum": weights.sum(),
    }


RANKS = {"logprobs": 1, "ref_logprobs": 1, "weights": 1, "sign": 0}


def client_side(data: list[Any], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """The same loss as a plain callable: the SDK runs it on the client (two passes)."""
    total: Any = 0
    reward = tokens = 0.0
    for datum, lp in zip(data, logprobs, strict=True):
        inputs = [datum.loss_fn_inputs[k].to_torch() for k in ("ref_logprobs", "weights", "sign")]
        loss, metrics = dpo_style(lp, *inputs)
        total = total + loss
        reward += float(metrics["custom/reward:mean"]) / len(data)
        tokens += float(metrics["custom/tokens:sum"])
    return total, {"custom/reward:mean": reward, "custom/tokens:sum": tokens}


def pairs(tokenizer: Any) -> list[Any]:
    rng = np.random.default_rng(0)
    data = []
    for i, text in enumerate(["two plus two is four", "the sky is green", "cats purr softly"]):
        ids = tokenizer.encode(text)
        n = len(ids) - 1
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": ids[1:],
                    "ref_logprobs": types.TensorData.from_numpy(
                        rng.normal(-5.0, 0.5, size=n).astype(np.float32)
                    ),
                    "weights": types.TensorData.from_numpy(np.ones(n, dtype=np.float32)),
                    "sign": types.TensorData.from_numpy(
                        np.asarray(1.0 if i % 2 == 0 else -1.0, dtype=np.float32)
                    ),
                },
            )
        )
    return data


def usage(url: str, key: str, model_id: str) -> dict[str, int]:
    report = httpx.get(
        f"{url}/api/v1/usage",
        params={"training_run_id": model_id},
        headers={"X-API-Key": key},
        timeout=30,
    ).json()
    by_op = report["by_operation"].items()
    return {op: counts["requests"] for op, counts in by_op if counts["requests"]}


def post_raw(url: str, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/{path}", json=body, headers={"X-API-Key": key}, timeout=30)


def custom_losses(url: str, key: str, model: str) -> None:
    service = tinker.ServiceClient(base_url=url, api_key=key)
    server_side = service.create_lora_training_client(base_model=model, rank=4, seed=3).result()
    client = service.create_lora_training_client(base_model=model, rank=4, seed=3).result()
    data = pairs(server_side.get_tokenizer())

    handle = service.create_custom_loss(dpo_style, RANKS).result()
    assert handle.loss_id is not None, "the server advertises custom_loss_server_side"
    on_server = server_side.forward_backward_custom(data, handle).result()
    on_client = client.forward_backward_custom(data, client_side).result()

    loss, expected = on_server.metrics["loss:sum"], on_client.metrics["loss:sum"]
    assert loss == pytest.approx(expected, rel=1e-5, abs=1e-6), (loss, expected)
    for name in ("custom/reward:mean", "custom/tokens:sum"):
        assert on_server.metrics[name] == pytest.approx(on_client.metrics[name], rel=1e-5, abs=1e-6)
    assert "surrogate_loss:sum" not in on_server.metrics  # no surrogate: the loss ran there
    for a, b in zip(on_server.loss_fn_outputs, on_client.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6)

    passes_server = usage(url, key, server_side.model_id)
    passes_client = usage(url, key, client.model_id)
    assert passes_server == {"forward_backward": 1}, passes_server
    assert passes_client == {"forward": 1, "forward_backward": 1}, passes_client

    step = types.AdamParams(learning_rate=1.0, eps=1.0, beta1=0.0, beta2=0.0)
    scored = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]},
        )
        for d in data
    ]
    before = client.forward(scored, "cross_entropy").result()
    server_side.optim_step(step).result()
    client.optim_step(step).result()
    after_server = server_side.forward(scored, "cross_entropy").result()
    after_client = client.forward(scored, "cross_entropy").result()
    moved = diff = 0.0
    for a, b, c in zip(
        after_server.loss_fn_outputs, after_client.loss_fn_outputs, before.loss_fn_outputs,
        strict=True,
    ):  # fmt: skip
        lp_a, lp_b = a["logprobs"].to_numpy(), b["logprobs"].to_numpy()
        moved = max(moved, float(np.abs(lp_b - c["logprobs"].to_numpy()).max()))
        diff = max(diff, float(np.abs(lp_a - lp_b).max()))
    assert moved > 1e-3, f"the step did not move the model ({moved})"
    assert diff <= 1e-5 * max(1.0, moved), f"server-side step differs by {diff} (moved {moved})"

    session = server_side.holder.get_session_id()

    def call(name: str, target: str, *args: Any) -> dict[str, Any]:
        return {"op": "call_function", "name": name, "target": target, "args": list(args)}

    lp = {"ref": "logprobs"}
    hostile = {
        "os.system": call("boom", "os.system", "id"),
        "getattr": call("cls", "builtins.getattr", lp, "__class__"),
        "torch.ones": call("big", "torch.ones", 1 << 40),
        "unknown": call("f", "scipy.special.expit", lp),
    }
    for seq, (what, node) in enumerate(hostile.items(), start=100):
        nodes = [
            {"op": "placeholder", "name": "logprobs", "target": "logprobs"},
            node,
            {
                "op": "output", "name": "output", "target": "output",
                "args": [{"tuple": [{"ref": node["name"]}, {"dict": {}}]}],
            },
        ]  # fmt: skip
        answer = post_raw(
            url,
            key,
            "create_custom_loss",
            {
                "session_id": session,
                "custom_loss_seq_id": seq,
                "name": "evil",
                "inputs": [{"name": "logprobs", "rank": 1}],
                "graph": {"format": 1, "nodes": nodes},
            },
        )
        assert answer.status_code == 400, (what, answer.status_code, answer.text)
        assert answer.json()["field"] == "graph.nodes[1]", (what, answer.json())
        assert node["name"] in answer.json()["detail"], answer.json()


def _provenance(datum: Any, sequence_id: str, prompt_len: int, sampled: int) -> Any:
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, length=prompt_len),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=sampled - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=prompt_len - 1),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=sampled),
        ],
    )


def stable_reinforce(url: str, key: str, model: str) -> None:
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=model, rank=4, seed=1).result()
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True)
    prompt = training.get_tokenizer().encode("one two three")
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])
    sample = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()

    def datum(seq: Any, advantage: float, tokens: list[int] | None = None) -> Any:
        sampled = tokens if tokens is not None else list(seq.tokens)
        full = prompt + sampled
        return types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={
                "target_tokens": full[1:],
                "logprobs": [0.0] * (len(prompt) - 1) + list(seq.logprobs),
                "advantages": [0.0] * (len(prompt) - 1) + [advantage] * len(sampled),
            },
        )

    data = []
    for seq, advantage in zip(sample.sequences, (1.0, -1.0), strict=True):
        plain = datum(seq, advantage)
        data.append(_provenance(plain, seq.sequence_id, len(prompt), len(seq.tokens)))
    out = training.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.01}).result()
    lp = np.concatenate([o["logprobs"].to_numpy()[len(prompt) - 1 :] for o in out.loss_fn_outputs])
    q = np.concatenate([np.asarray(s.logprobs) for s in sample.sequences])
    # on policy: the learner scores the sampled tokens as the sampler did
    np.testing.assert_allclose(lp, q, atol=2e-3)
    adv = np.repeat([1.0, -1.0], [len(s.tokens) for s in sample.sequences])
    # L = -sum m [min(r, 2) A lp - kl/2 (lp - q)^2], r = exp(lp - q) with the recorded q
    ratio = np.minimum(np.exp(lp - q), 2.0)
    expected = -float((ratio * adv * lp - 0.005 * (lp - q) ** 2).sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    seq = sample.sequences[0]
    plain = datum(seq, 1.0)
    bad = {
        "data[0].loss_fn_input_spans": plain,
        "data[0].model_input_spans[0].sequence_id": _provenance(
            plain, "no-such-sequence", len(prompt), len(seq.tokens)
        ),
    }
    other = [(t + 1) % 200 for t in seq.tokens]
    forged = datum(seq, 1.0, other)
    bad["data[0].model_input_spans[1]"] = _provenance(
        forged, seq.sequence_id, len(prompt), len(seq.tokens)
    )
    for field, wrong in bad.items():
        with pytest.raises(tinker.BadRequestError, match=re.escape(field)):
            training.forward_backward([wrong], "stable_reinforce").result()


if __name__ == "__main__":
    url, key, model = sys.argv[1:4]
    custom_losses(url, key, model)
    stable_reinforce(url, key, model)
    print("official SDK losses: OK")
