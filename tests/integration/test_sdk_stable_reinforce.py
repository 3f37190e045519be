"""Our SDK trains with `stable_reinforce` against a real `tuneloop serve` (fake engine and the
torch engine's tiny model), as the official SDK does (tests/compat/official_losses.py): a
recording sampler, datums naming their sequences, and field-named 400s, surfaced as
`BadRequestError`, for datums without valid provenance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tuneloop
from tuneloop import (
    AdamParams,
    BadRequestError,
    Datum,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
    SampledSequence,
    SamplingParams,
)
from tuneloop._local_server import live_server

pytestmark = pytest.mark.integration
BACKENDS = {"fake": "tuneloop/fake-tiny", "torch": "tuneloop/tiny-qwen3"}


def _plain(prompt: list[int], seq: SampledSequence, advantage: float, tokens: list[int]) -> Datum:
    full = prompt + tokens
    n_prompt = len(prompt) - 1
    return Datum(
        model_input=ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * n_prompt + list(seq.logprobs or []),
            "advantages": [0.0] * n_prompt + [advantage] * len(tokens),
        },
    )


def _named(datum: Datum, sequence_id: str, prompt_len: int, sampled: int) -> Datum:
    return datum.with_provenance(
        model_input=[
            PromptProvenanceSpan(sequence_id=sequence_id, length=prompt_len),
            SampledProvenanceSpan(sequence_id=sequence_id, length=sampled - 1),
        ],
        loss_fn_inputs=[
            PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=prompt_len - 1),
            SampledProvenanceSpan(sequence_id=sequence_id, length=sampled),
        ],
    )


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_our_sdk_trains_with_stable_reinforce(backend: str, tmp_path: Path) -> None:
    model = BACKENDS[backend]
    with (
        live_server(tmp_path, backend=backend, models=(model,)) as live,
        tuneloop.ServiceClient(base_url=live.url, api_key=live.key) as service,
    ):
        training = service.create_lora_training_client(model, rank=4, seed=1)
        sampler = training.save_weights_and_get_sampling_client(record_stability_info=True)
        prompt = [int(t) for t in training.get_tokenizer().encode("one two three")]
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])
        sample = sampler.sample(ModelInput.from_ints(prompt), 2, params).result(timeout=120)
        assert len({s.sequence_id for s in sample.sequences}) == 2

        data = [
            _named(
                _plain(prompt, seq, adv, list(seq.tokens)),
                str(seq.sequence_id),
                len(prompt),
                len(seq.tokens),
            )
            for seq, adv in zip(sample.sequences, (1.0, -1.0), strict=True)
        ]
        out = training.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.01})
        result = out.result(timeout=120)
        lp = np.concatenate(
            [o["logprobs"].to_numpy()[len(prompt) - 1 :] for o in result.loss_fn_outputs]
        )
        q = np.concatenate([np.asarray(s.logprobs) for s in sample.sequences])
        np.testing.assert_allclose(lp, q, atol=2e-3)  # on policy: scored as sampled
        adv = np.repeat([1.0, -1.0], [len(s.tokens) for s in sample.sequences])
        # docs/losses.md: L = -sum m [min(r, 2) A lp - kl/2 (lp - q)^2], q = the recorded logprob
        expected = -float(
            (np.minimum(np.exp(lp - q), 2.0) * adv * lp - 0.005 * (lp - q) ** 2).sum()
        )
        assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
        training.optim_step(AdamParams(learning_rate=1e-2)).result(timeout=120)
        after = training.forward(data, "stable_reinforce").result(timeout=120)
        moved = np.concatenate(
            [o["logprobs"].to_numpy()[len(prompt) - 1 :] for o in after.loss_fn_outputs]
        )
        assert float(np.abs(moved - lp).max()) > 1e-4  # the step trained the adapter

        seq = sample.sequences[0]
        plain = _plain(prompt, seq, 1.0, list(seq.tokens))
        forged = [(t + 1) % 200 for t in seq.tokens]
        bad: dict[str, Any] = {
            "data[0].loss_fn_input_spans": plain,
            "data[0].model_input_spans[0].sequence_id": _named(
                plain, "no-such-sequence", len(prompt), len(seq.tokens)
            ),
            "data[0].model_input_spans[1]": _named(
                _plain(prompt, seq, 1.0, forged), str(seq.sequence_id), len(prompt), len(forged)
            ),
        }
        # A sequence sampled by a client that does not record has no record to train on.
        unrecorded = training.save_weights_and_get_sampling_client()
        other = unrecorded.sample(ModelInput.from_ints(prompt), 1, params).result(timeout=120)
        oseq = other.sequences[0]
        bad["data[1].model_input_spans[0].sequence_id"] = [
            data[0],
            _named(
                _plain(prompt, oseq, 1.0, list(oseq.tokens)),
                str(oseq.sequence_id),
                len(prompt),
                len(oseq.tokens),
            ),
        ]
        for field, wrong in bad.items():
            batch = wrong if isinstance(wrong, list) else [wrong]
            with pytest.raises(BadRequestError) as caught:
                training.forward_backward(batch, "stable_reinforce").result(timeout=120)
            assert caught.value.status_code == 400
            assert caught.value.body["field"] == field, caught.value.body
            assert f"(field: {field})" in str(caught.value)
        # The refusals left the session usable.
        again = training.forward_backward(data, "stable_reinforce").result(timeout=120)
        assert np.isfinite(again.metrics["loss:sum"])
