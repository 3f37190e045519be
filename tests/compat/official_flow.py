"""The official `tinker` SDK's whole flow against a tuneloop server: `python -m` this module.

It runs in its own process because the official SDK keeps a background event-loop thread for
the life of the process; isolating it keeps its sockets out of every other test.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import tinker
import torch

types = tinker.types
MODEL = "tuneloop/fake-tiny"  # overridden by the third argument


def _datum(tokens: list[int], **inputs: object) -> object:
    inputs.setdefault("target_tokens", tokens[1:])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def run(url: str, key: str) -> None:
    service = tinker.ServiceClient(base_url=url, api_key=key)
    caps = service.get_server_capabilities()
    assert MODEL in [m.model_name for m in caps.supported_models]

    training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
    info = training.get_info()
    assert info.model_data.model_name == MODEL
    tokenizer = training.get_tokenizer()  # local folder from get_info: no hub
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    n = len(ids) - 1
    ce = _datum(ids, weights=[1.0] * n)

    first = training.forward_backward([ce], "cross_entropy").result()
    assert first.loss_fn_outputs[0]["logprobs"].shape == [n]
    expected = -np.sum(first.loss_fn_outputs[0]["logprobs"].to_numpy())
    assert first.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)

    # 2-D (top-K) cross entropy with soft targets; torch tensors travel sparse.
    targets_2d = torch.tensor([[t, (t + 1) % 259] for t in ids[1:]])
    weights_2d = torch.tensor([[0.75, 0.25]] * n)
    top_k = training.forward_backward(
        [_datum(ids, target_tokens=targets_2d, weights=weights_2d)], "cross_entropy"
    ).result()
    assert top_k.loss_fn_outputs[0]["logprobs"].shape == [n, 2]

    rl = _datum(ids, logprobs=[-4.0] * n, advantages=[1.0] * n)
    is_out = training.forward_backward([rl], "importance_sampling").result()
    assert is_out.metrics["loss:sum"] < 0

    def custom_loss(data: list[object], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        loss = sum((-lp * 0.5).sum() for lp in logprobs)
        return loss, {"custom_metric:sum": 1.0}

    custom = training.forward_backward_custom([ce], custom_loss).result()
    assert "surrogate_loss:sum" in custom.metrics
    assert custom.metrics["custom_metric:sum"] == 1.0

    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    after = training.forward([ce], "cross_entropy").result()
    assert after.metrics["loss:sum"] < first.metrics["loss:sum"]

    state = training.save_state("step1").result()
    assert state.path.endswith("/weights/step1")
    training.load_state_with_optimizer(state.path).result()
    restored = service.create_training_client_from_state(state.path).result()
    same = restored.forward([ce], "cross_entropy").result()
    assert same.metrics["loss:sum"] == pytest.approx(after.metrics["loss:sum"], rel=1e-6)
    with_optimizer = service.create_training_client_from_state_with_optimizer(state.path).result()
    with_optimizer.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    sampler = training.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(ids[:6])
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    sample = sampler.sample(prompt, 3, params).result()
    assert len(sample.sequences) == 3
    for seq in sample.sequences:
        assert len(seq.logprobs) == len(seq.tokens) > 0
    logprobs = sampler.compute_logprobs(prompt).result()
    assert logprobs[0] is None
    assert len(logprobs) == 6

    named = training.save_weights_for_sampler("s1").result()
    from_path = service.create_sampling_client(model_path=named.path)
    assert from_path.compute_logprobs(prompt).result() == pytest.approx(logprobs)

    rest = tinker.RestClient(base_url=url, api_key=key)
    run = rest.get_training_run(training.model_id).result()
    assert run.base_model == MODEL
    kinds = {
        c.checkpoint_type for c in rest.list_checkpoints(training.model_id).result().checkpoints
    }
    assert kinds == {"training", "sampler"}
    assert any(
        r.training_run_id == training.model_id
        for r in rest.list_training_runs().result().training_runs
    )
    rest.delete_checkpoint_from_tinker_path(named.path).result()
    remaining = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [c.checkpoint_type for c in remaining] == ["training"]
    service.close("success").result()


if __name__ == "__main__":
    # The SDK warns about its own deprecated methods (load_state*), which this flow exercises.
    warnings.simplefilter("ignore", FutureWarning)
    if len(sys.argv) > 3:
        MODEL = sys.argv[3]
    run(sys.argv[1], sys.argv[2])
    print("official SDK flow: OK")
