"""A zoo model through the official `tinker` SDK: `python -m` this module URL KEY MODEL OUT.

Trains (the loss falls), samples (the sampled tokens' logprobs are the forward pass's), saves
the state with its optimizer and resumes it in a second client (the next step's loss is the
same), and downloads the PEFT export into OUT with the served logprobs beside it, for the test
to load with peft.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import tinker

types = tinker.types
ATOL = 2e-4


def _datum(tokens: list[int]) -> Any:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:]},
    )


def _logprobs(training: Any, data: list[Any]) -> list[np.ndarray]:
    out = training.forward(data, "cross_entropy").result()
    return [np.asarray(o["logprobs"].tolist()) for o in out.loss_fn_outputs]


def _step(training: Any, data: list[Any]) -> float:
    out = training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=0.02)).result()
    return float(np.mean([-np.asarray(o["logprobs"].tolist()).mean() for o in out.loss_fn_outputs]))


def run(url: str, key: str, model: str, out: str) -> None:
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 256, size=12).tolist() for _ in range(3)]
    data = [_datum(s) for s in sequences]
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=model, rank=4, seed=1)
    losses = [_step(training, data) for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05, losses

    sampler = training.save_weights_and_get_sampling_client("s1")
    prompt = sequences[0][:7]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    [sampled] = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences
    [scored] = _logprobs(training, [_datum(prompt + list(sampled.tokens))])
    np.testing.assert_allclose(sampled.logprobs, scored[len(prompt) - 1 :], atol=ATOL)

    state = training.save_state("w1").result().path
    resumed = service.create_training_client_from_state_with_optimizer(state)
    assert abs(_step(training, data) - _step(resumed, data)) < 1e-6

    served = _logprobs(training, data[:1])[0]
    export = training.save_weights_external("e1").result().path
    signed = service.create_rest_client().get_external_weights_urls(export).result()
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    for name, file_url in signed.urls.items():
        with urllib.request.urlopen(file_url, timeout=30) as response:
            (root / name).write_bytes(response.read())
    (root / "served.json").write_text(
        json.dumps({"tokens": sequences[0], "logprobs": served.tolist()})
    )
    service.close("success").result()
    print("official SDK zoo flow: OK")


if __name__ == "__main__":
    run(*sys.argv[1:5])
