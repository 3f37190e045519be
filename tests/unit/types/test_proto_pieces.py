"""A large protobuf body parsed in pieces is the message parsed whole, errors included."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from tuneloop.types import Datum, ModelInput, proto, proto_pieces
from tuneloop.types.codec import (
    ForwardBackwardRequest,
    decode_forward_backward_request,
    encode_forward_backward_request,
)
from tuneloop.types.proto_pieces import parse_in_pieces, piece_ends

PIECE = 4096  # small pieces: a body of a few hundred KiB is cut many times


def _body(datums: int = 60, tokens: int = 300) -> bytes:
    rng = np.random.default_rng(1)
    data = []
    for _ in range(datums):
        ids = rng.integers(0, 250, tokens + 1)
        inputs = {
            "target_tokens": ids[1:].astype(np.int64),
            "weights": rng.random(tokens).astype(np.float32),
        }
        data.append(Datum(ModelInput.from_ints(ids[:-1].tolist()), inputs))
    request = ForwardBackwardRequest("m:train:0", 7, data, "ppo", {"clip_low_threshold": 0.8})
    return encode_forward_backward_request(request)


def _whole(body: bytes) -> bytes:
    msg = proto.ForwardBackwardRequestProto()
    msg.ParseFromString(body)
    return bytes(msg.SerializeToString(deterministic=True))


def _pieces(body: bytes) -> bytes:
    msg = proto.ForwardBackwardRequestProto()
    parse_in_pieces(msg, body, PIECE)
    return bytes(msg.SerializeToString(deterministic=True))


def test_pieces_end_on_field_boundaries_and_cover_the_body() -> None:
    body = _body()
    ends = piece_ends(body, PIECE)
    assert len(ends) > 10
    assert ends == sorted(ends)
    assert ends[-1] == len(body)
    # Each piece parses by itself: it holds whole fields.
    start = 0
    for end in ends:
        proto.ForwardBackwardRequestProto().ParseFromString(body[start:end])
        start = end


def test_the_message_parsed_in_pieces_is_the_message_parsed_whole() -> None:
    body = _body()
    assert _pieces(body) == _whole(body)


def test_repeated_and_merged_fields_come_out_as_parsed_whole() -> None:
    """A scalar sent twice keeps the last value, map entries and repeated fields accumulate,
    and the order of fields across pieces is kept."""
    first = proto.ForwardBackwardRequestProto(model_id="first", seq_id=1)
    first.loss_fn_config["a"] = 1.0
    last = proto.ForwardBackwardRequestProto(model_id="last", seq_id=9, loss_fn="ppo")
    last.loss_fn_config["a"] = 2.0
    last.loss_fn_config["b"] = 3.0
    body = _body(30) + first.SerializeToString() + _body(30) + last.SerializeToString()
    assert _pieces(body) == _whole(body)
    msg = proto.ForwardBackwardRequestProto()
    parse_in_pieces(msg, body, PIECE)
    assert (msg.model_id, msg.seq_id, len(msg.data)) == ("last", 9, 60)
    assert dict(msg.loss_fn_config) == {"clip_low_threshold": 0.8, "a": 2.0, "b": 3.0}


def test_a_message_reused_for_parsing_is_cleared_first() -> None:
    msg = proto.ForwardBackwardRequestProto(model_id="stale")
    msg.data.add()
    body = _body()
    parse_in_pieces(msg, body, PIECE)
    assert bytes(msg.SerializeToString(deterministic=True)) == _whole(body)


def _outcome(in_pieces: bool, body: bytes) -> tuple[str, str | bytes]:
    """("error", the parser's message) or ("parsed", the message, re-encoded)."""
    msg = proto.ForwardBackwardRequestProto()
    try:
        if in_pieces:
            parse_in_pieces(msg, body, PIECE)
        else:
            msg.ParseFromString(body)
    except DecodeError as exc:
        return "error", str(exc)
    return "parsed", bytes(msg.SerializeToString(deterministic=True))


@pytest.mark.parametrize(
    "damage",
    [
        "truncated",
        "length_past_end",
        "bad_nested_datum",
        "group_wire_type",
        "field_number_zero",
        "unterminated_varint",
    ],
)
def test_a_malformed_or_odd_body_comes_out_as_parsed_whole(damage: str) -> None:
    body = bytearray(_body())
    if damage == "truncated":
        body = body[: len(body) - 3]
    elif damage == "length_past_end":
        body += b"\x22\xff\xff\x03"  # data, 65535 bytes long, none there
    elif damage == "bad_nested_datum":
        # A datum (field 3) whose own fields do not scan, between two good halves.
        body = bytearray(_body(30) + b"\x1a\x04\xff\xff\xff\xff" + _body(30))
    elif damage == "group_wire_type":
        body += b"\x0b\x0c"
    elif damage == "field_number_zero":
        body += b"\x00\x00"
    else:
        body += b"\x80" * 11
    raw = bytes(body)
    whole = _outcome(False, raw)
    assert _outcome(True, raw) == whole
    # A group (wire type 3) is an unknown field to this schema, not an error: kept either way.
    assert whole[0] == ("parsed" if damage == "group_wire_type" else "error")


def test_a_body_of_very_many_tiny_fields_is_parsed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proto_pieces, "MAX_FIELDS", 100)
    tiny = proto.ForwardBackwardRequestProto(seq_id=3).SerializeToString()
    body = tiny * 5000
    with pytest.raises(ValueError, match="more than 100 fields"):
        piece_ends(body, PIECE)
    assert _pieces(body) == _whole(body)


def test_a_small_body_is_parsed_in_one_call() -> None:
    body = _body(2, 10)
    assert len(body) < 2 * PIECE
    assert _pieces(body) == _whole(body)


def test_the_codec_decodes_a_large_body_as_before() -> None:
    body = _body(200, 1000)
    assert len(body) > 2 * proto_pieces.PIECE_BYTES
    decoded = decode_forward_backward_request(body)
    assert len(decoded.data) == 200
    assert decoded.loss_fn == "ppo"
    assert decoded.seq_id == 7
    assert encode_forward_backward_request(decoded) == body
