"""Stability records (stable_reinforce): lifetime of a day restarted by each use, a token bound
with least-recently-used eviction, tenants apart; provenance checked against the records; the
spans travel in the protobuf body."""

from __future__ import annotations

import numpy as np
import pytest

from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.stability import DAY_S, StabilityRecords, attach_stability
from tuneloop.server.engine.types import Example, ForwardBackwardWork, SampledTokens
from tuneloop.types import (
    Datum,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
)
from tuneloop.types.codec import (
    ForwardBackwardRequest,
    decode_forward_backward_request,
    encode_forward_backward_request,
)

PROMPT = np.array([3, 4, 5], dtype=np.int64)
SAMPLED = SampledTokens(tokens=[7, 8, 9], logprobs=[-0.5, -1.25, -2.0], stop_reason="length")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def records(max_tokens: int = 1000) -> tuple[StabilityRecords, Clock]:
    clock = Clock()
    return StabilityRecords(max_tokens=max_tokens, clock=clock), clock


def test_a_record_lives_a_day_and_each_use_restarts_it() -> None:
    store, clock = records()
    store.record("alice", ["s0"], PROMPT, [SAMPLED])
    clock.now = DAY_S - 1
    assert store.lookup("alice", "s0") is not None  # used: a new day from here
    clock.now = 2 * DAY_S - 2
    rec = store.lookup("alice", "s0")
    assert rec is not None
    np.testing.assert_array_equal(rec.logprobs, np.float32(SAMPLED.logprobs))
    clock.now = 3 * DAY_S
    assert store.lookup("alice", "s0") is None
    assert len(store) == 0
    assert store.tokens == 0


def test_tenants_do_not_see_each_others_records() -> None:
    store, _ = records()
    store.record("alice", ["s0"], PROMPT, [SAMPLED])
    assert store.lookup("bob", "s0") is None
    assert store.lookup("alice", "s0") is not None


def test_the_token_bound_evicts_least_recently_used() -> None:
    store, _ = records(max_tokens=6 * 3)  # three records of 3 prompt + 3 sampled tokens
    store.record("alice", ["a", "b", "c"], PROMPT, [SAMPLED] * 3)
    assert store.lookup("alice", "a") is not None  # a is now the most recent
    store.record("alice", ["d"], PROMPT, [SAMPLED])
    assert store.lookup("alice", "b") is None
    assert all(store.lookup("alice", s) is not None for s in "acd")
    assert store.tokens == 18


def _datum(tokens: list[int], targets: list[int], spans_in: tuple, spans_out: tuple) -> Datum:
    return Datum(
        ModelInput.from_ints(tokens),
        {
            "target_tokens": np.asarray(targets, dtype=np.int64),
            "advantages": np.ones(len(targets), dtype=np.float32),
        },
        model_input_spans=spans_in,
        loss_fn_input_spans=spans_out,
    )


def _cookbook_datum(sequence_id: str, sampled: list[int] | None = None) -> Datum:
    """As the cookbook builds it: input = prompt + sampled[:-1], targets = prompt[1:] + sampled."""
    sampled = sampled if sampled is not None else SAMPLED.tokens
    full = [*PROMPT.tolist(), *sampled]
    return _datum(
        full[:-1],
        full[1:],
        (
            PromptProvenanceSpan(sequence_id=sequence_id, length=3),
            SampledProvenanceSpan(sequence_id=sequence_id, length=2),
        ),
        (
            PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=2),
            SampledProvenanceSpan(sequence_id=sequence_id, length=3),
        ),
    )


def _work(data: list[Datum]) -> ForwardBackwardWork:
    examples = tuple(
        Example(
            np.asarray(d.model_input.to_ints(), dtype=np.int64),
            {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()},
        )
        for d in data
    )
    return ForwardBackwardWork("m", examples, "stable_reinforce", {}, False)


def test_provenance_gives_the_recorded_logprobs_of_sampled_targets() -> None:
    store, _ = records()
    store.record("alice", ["s0"], PROMPT, [SAMPLED])
    data = [_cookbook_datum("s0")]
    [example] = attach_stability(_work(data), data, store, "alice").examples
    np.testing.assert_array_equal(example.inputs["sampled_mask"], [0, 0, 1, 1, 1])
    np.testing.assert_array_equal(
        example.inputs["recorded_logprobs"], np.float32([0, 0, *SAMPLED.logprobs])
    )


@pytest.mark.parametrize(
    ("case", "field"),
    [
        ("no spans", "data[0].loss_fn_input_spans"),
        ("other tenant", "data[0].model_input_spans[0].sequence_id"),
        ("forged tokens", "data[0].model_input_spans[1]"),
        ("too long", "data[0].loss_fn_input_spans[1]"),
        ("bad tiling", "data[0].model_input_spans"),
    ],
)
def test_bad_provenance_is_a_400_naming_the_field(case: str, field: str) -> None:
    store, _ = records()
    store.record("alice", ["s0"], PROMPT, [SAMPLED])
    tenant = "bob" if case == "other tenant" else "alice"
    datum = _cookbook_datum("s0", [7, 9, 9] if case == "forged tokens" else None)
    if case == "no spans":
        datum = Datum(datum.model_input, datum.loss_fn_inputs)
    if case == "too long":
        spans = (
            PromptProvenanceSpan(sequence_id="s0", offset=1, length=1),
            SampledProvenanceSpan(sequence_id="s0", offset=1, length=4),
        )
        datum = _datum([3, 4, 5, 7, 8], [4, 8, 9, 9, 9], datum.model_input_spans, spans)
    if case == "bad tiling":
        datum = _datum(
            datum.model_input.to_ints(),
            [4, 5, 7, 8, 9],
            (SampledProvenanceSpan(sequence_id="s0", length=2),),
            datum.loss_fn_input_spans,
        )
    with pytest.raises(ApiError) as info:
        attach_stability(_work([datum]), [datum], store, tenant)
    assert info.value.status == 400
    assert info.value.field == field, info.value.detail


def test_spans_travel_in_the_protobuf_body() -> None:
    data = [_cookbook_datum("req-1:0"), Datum(ModelInput.from_ints([1, 2]), {})]
    request = ForwardBackwardRequest("m", 1, data, "stable_reinforce", {"kl_coeff": 0.1})
    decoded = decode_forward_backward_request(encode_forward_backward_request(request))
    assert decoded.data[0].model_input_spans == data[0].model_input_spans
    assert decoded.data[0].loss_fn_input_spans == data[0].loss_fn_input_spans
    assert decoded.data[1].model_input_spans is None
    assert decoded.data[1].loss_fn_input_spans is None
