"""The shared field types: 64-bit integers, strict wire parsing, bounded metadata and tags."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from tuneloop.types import CreateModelRequest, CreateSessionRequest, SampleRequest, SamplingParams
from tuneloop.types.fields import (
    INT64_MAX,
    INT64_MIN,
    MAX_METADATA_BYTES,
    MAX_TAG_LENGTH,
    MAX_TAGS,
    parse_json,
)
from tuneloop.types.model_input import ModelInput


def _loc(exc: pytest.ExceptionInfo[ValidationError]) -> tuple[int | str, ...]:
    return tuple(exc.value.errors()[0]["loc"])


def _model(**fields: object) -> bytes:
    return json.dumps({"session_id": "s", "base_model": "m", **fields}).encode()


@pytest.mark.parametrize("value", ["1", 1.0, True, 2**63, -1])
def test_wire_ids_are_strict_integers(value: object) -> None:
    with pytest.raises(ValidationError) as exc:
        parse_json(CreateModelRequest, _model(model_seq_id=value))
    assert _loc(exc) == ("model_seq_id",)


def test_wire_ids_in_range_parse() -> None:
    assert parse_json(CreateModelRequest, _model(model_seq_id=INT64_MAX)).model_seq_id == INT64_MAX


@pytest.mark.parametrize("token", [INT64_MAX + 1, INT64_MIN - 1])
def test_tokens_outside_64_bits_are_refused_by_field(token: int) -> None:
    body = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, token]}]},
        "sampling_params": {"max_tokens": 1},
    }
    with pytest.raises(ValidationError) as exc:
        parse_json(SampleRequest, json.dumps(body).encode())
    assert _loc(exc) == ("prompt", "chunks", 0, "encoded_text", "tokens", 1)


def test_sdk_users_keep_numpy_integers() -> None:
    # Built in Python (the SDK), not parsed from the wire: NumPy integers still convert.
    params = SamplingParams(max_tokens=np.int64(4), seed=np.int32(3), top_k=np.int64(5))
    assert (params.max_tokens, params.seed, params.top_k) == (4, 3, 5)
    assert ModelInput.from_ints(np.arange(3)).to_ints() == [0, 1, 2]


def test_metadata_and_tags_are_bounded() -> None:
    at_limit = {"k": "x" * (MAX_METADATA_BYTES - len('{"k":""}'))}
    CreateSessionRequest(user_metadata=at_limit)
    with pytest.raises(ValidationError) as exc:
        CreateSessionRequest(user_metadata={"k": "x" * MAX_METADATA_BYTES})
    assert _loc(exc) == ("user_metadata",)
    CreateSessionRequest(tags=["t" * MAX_TAG_LENGTH] * MAX_TAGS)
    with pytest.raises(ValidationError) as exc:
        CreateSessionRequest(tags=["t"] * (MAX_TAGS + 1))
    assert _loc(exc) == ("tags",)
    with pytest.raises(ValidationError) as exc:
        CreateSessionRequest(tags=["t" * (MAX_TAG_LENGTH + 1)])
    assert _loc(exc) == ("tags", 0)
