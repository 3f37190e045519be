"""What `stable_reinforce` needs from the SDK, as the official SDK offers it: sampling clients
that record stability info (on the wire: `record_stability_info` on every asample), the
`sequence_id` of each sampled sequence, and datums carrying provenance spans."""

from __future__ import annotations

import asyncio

import pytest

from tuneloop import (
    Datum,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
    SamplingParams,
)
from tuneloop.recipes import rl


def _sample(sampler) -> list[str | None]:  # type: ignore[no-untyped-def]
    out = sampler.sample(ModelInput.from_ints([1, 2, 3]), 2, SamplingParams(max_tokens=2))
    return [s.sequence_id for s in out.result(5).sequences]


def test_record_stability_info_goes_on_every_sample_of_a_recording_client(service, server):
    tc = service.create_lora_training_client("tiny-base")
    plain = tc.save_weights_and_get_sampling_client()
    recording = [
        tc.save_weights_and_get_sampling_client(record_stability_info=True),
        asyncio.run(tc.save_weights_and_get_sampling_client_async(record_stability_info=True)),
        tc.create_sampling_client("tinker://x/sampler_weights/a", record_stability_info=True),
        service.create_sampling_client(base_model="tiny-base", record_stability_info=True),
        asyncio.run(
            service.create_sampling_client_async(base_model="tiny-base", record_stability_info=True)
        ),
    ]
    assert not plain.record_stability_info
    assert all(s.record_stability_info for s in recording)
    ids = _sample(plain)
    for sampler in recording:
        ids += _sample(sampler)
    bodies = server.bodies("/api/v1/asample")
    assert [b["record_stability_info"] for b in bodies] == [False] + [True] * len(recording)
    # Each sequence carries the id the server gave it when the sample was submitted.
    assert ids == [f"seq-{b['seq_id']}-{i}" for b in bodies for i in range(2)]


def _datum(prompt: list[int], sampled: list[int]) -> Datum:
    tokens = prompt + sampled
    n = len(tokens) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "advantages": [0.5] * n},
    )


def test_with_provenance_checks_the_tiling_and_the_spans_travel(service, server):
    plain = _datum([1, 2, 3], [7, 8])
    model_spans = [
        PromptProvenanceSpan(sequence_id="s", length=3),
        SampledProvenanceSpan(sequence_id="s", length=1),
    ]
    target_spans = [
        PromptProvenanceSpan(sequence_id="s", offset=1, length=2),
        SampledProvenanceSpan(sequence_id="s", length=2),
    ]
    datum = plain.with_provenance(model_input=model_spans, loss_fn_inputs=target_spans)
    assert plain.model_input_spans is None  # a copy; the original keeps no provenance
    assert datum.model_input_spans == tuple(model_spans)
    assert datum.loss_fn_input_spans == tuple(target_spans)

    with pytest.raises(ValueError, match="model_input spans cover 3 positions but the field has 4"):
        plain.with_provenance(model_input=model_spans[:1], loss_fn_inputs=target_spans)
    with pytest.raises(ValueError, match="loss_fn_inputs spans cover 2 positions"):
        plain.with_provenance(model_input=model_spans, loss_fn_inputs=target_spans[1:])
    with pytest.raises(TypeError, match="got dict"):
        plain.with_provenance(model_input=[{"sequence_id": "s"}], loss_fn_inputs=target_spans)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="as a pair"):
        Datum(model_input=plain.model_input, model_input_spans=tuple(model_spans))
    for bad in ({"sequence_id": "", "length": 1}, {"sequence_id": "s", "length": -1}):
        with pytest.raises(ValueError, match="SampledProvenanceSpan"):
            SampledProvenanceSpan(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="offset must be >= 0"):
        PromptProvenanceSpan(sequence_id="s", offset=-1, length=1)

    tc = service.create_lora_training_client("tiny-base")
    tc.forward_backward([datum, plain], "stable_reinforce").result(5)
    sent = server.fwdbwd_requests[-1]
    assert sent.loss_fn == "stable_reinforce"
    assert sent.data[0].model_input_spans == tuple(model_spans)
    assert sent.data[0].loss_fn_input_spans == tuple(target_spans)
    assert sent.data[1].model_input_spans is None  # no provenance: none on the wire


def _spans(spans) -> list[tuple[str, int, int]]:  # type: ignore[no-untyped-def]
    return [(type(s).__name__[:6], s.offset, s.length) for s in spans]


def test_recipe_provenance_is_the_cookbooks_layout():
    # tinker-cookbook's rl_loop.with_sampled_provenance: input = prompt + sampled[:-1],
    # targets = prompt[1:] + sampled.
    datum = rl.with_sampled_provenance(_datum([1, 2, 3], [7, 8, 9]), 3, 3, "s")
    assert _spans(datum.model_input_spans) == [("Prompt", 0, 3), ("Sample", 0, 2)]
    assert _spans(datum.loss_fn_input_spans) == [("Prompt", 1, 2), ("Sample", 0, 3)]
    assert {s.sequence_id for s in datum.model_input_spans or ()} == {"s"}
    # Nothing sampled (the sampler stopped at once): prompt positions only.
    empty = rl.with_sampled_provenance(_datum([1, 2, 3], []), 3, 0, "s")
    assert _spans(empty.model_input_spans) == [("Prompt", 0, 2)]
    assert _spans(empty.loss_fn_input_spans) == [("Prompt", 1, 2)]

    turn = rl.Turn([1, 2, 3], [7, 8], [-0.5, -0.25], "", sequence_id="s")
    named = rl.datum(turn, 1.0, provenance=True)
    assert _spans(named.loss_fn_input_spans) == [("Prompt", 1, 2), ("Sample", 0, 2)]
    assert rl.datum(turn, 1.0).loss_fn_input_spans is None
    with pytest.raises(ValueError, match="sequence_id"):
        rl.datum(rl.Turn([1, 2], [7], [-0.5], ""), 1.0, provenance=True)
