"""Parse a large protobuf message in pieces, so that no single call holds the GIL for long.

`ParseFromString` of a 64 MB forward_backward body is one C call of 10-50 ms that holds the
GIL throughout: a server decoding it on a worker thread answers no other request meanwhile.
Protobuf defines a message's encoding as the concatenation of its fields, and parsing a
concatenation as merging its parts, so the body is cut at its top-level field boundaries into
pieces of about `PIECE_BYTES` and merged piece by piece; between two pieces other threads run.

The result is the message `ParseFromString` gives. A body whose top-level framing does not scan
(a bad varint, a length past the end, a group), or a piece that fails to merge, is parsed whole
instead, so a malformed body raises exactly the error it always did.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError

# About 0.2 ms of parsing: well under the interpreter's 5 ms switch interval.
PIECE_BYTES = 1 << 20
# The scan is Python: a body of millions of tiny fields is parsed whole rather than scanned for
# seconds (a forward_backward body has a few fields per datum, at most a few thousand datums).
MAX_FIELDS = 1 << 16


def _varint(body: bytes, at: int) -> tuple[int, int]:
    """The varint at `at` and the offset after it; ValueError if it does not end in 10 bytes."""
    value = shift = 0
    for k in range(at, min(at + 10, len(body))):
        byte = body[k]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, k + 1
        shift += 7
    raise ValueError("unterminated varint")


def piece_ends(body: bytes, piece_bytes: int = PIECE_BYTES) -> list[int]:
    """Offsets where pieces of whole top-level fields end (the last is `len(body)`).

    ValueError if the top-level framing does not scan, or has over MAX_FIELDS fields."""
    ends: list[int] = []
    at = start = fields = 0
    size = len(body)
    while at < size:
        fields += 1
        if fields > MAX_FIELDS:
            raise ValueError(f"more than {MAX_FIELDS} fields")
        key, at = _varint(body, at)
        wire_type = key & 7
        if key >> 3 == 0:
            raise ValueError("field number 0")
        if wire_type == 0:
            _, at = _varint(body, at)
        elif wire_type == 1:
            at += 8
        elif wire_type == 2:
            length, at = _varint(body, at)
            at += length
        elif wire_type == 5:
            at += 4
        else:  # groups (3, 4) and undefined wire types: left to the parser
            raise ValueError(f"wire type {wire_type}")
        if at > size:
            raise ValueError("field past the end")
        if at - start >= piece_bytes:
            ends.append(at)
            start = at
    if not ends or ends[-1] != size:
        ends.append(size)
    return ends


def last_string_fields(body: bytes, numbers: tuple[int, ...]) -> dict[int, str] | None:
    """The values a parse would give the top-level string fields `numbers` (each its last
    occurrence; absent ones are left out), read by scanning the framing only. None where the
    framing does not scan (MAX_FIELDS, a group) or a value is not UTF-8: only a parse can tell."""
    at, fields = 0, 0
    found: dict[int, tuple[int, int]] = {}
    size = len(body)
    try:
        while at < size:
            fields += 1
            if fields > MAX_FIELDS:
                return None
            key, at = _varint(body, at)
            wire_type = key & 7
            if wire_type == 0:
                _, at = _varint(body, at)
            elif wire_type == 1:
                at += 8
            elif wire_type == 2:
                length, start = _varint(body, at)
                at = start + length
                if key >> 3 in numbers:
                    found[key >> 3] = (start, at)
            elif wire_type == 5:
                at += 4
            else:
                return None
            if at > size or key >> 3 == 0:
                return None
        return {number: body[a:b].decode() for number, (a, b) in found.items()}
    except ValueError:  # a bad varint, or not UTF-8 (UnicodeDecodeError)
        return None


def parse_in_pieces(message: Any, body: bytes, piece_bytes: int = PIECE_BYTES) -> None:
    """`message.ParseFromString(body)`, merged from pieces of about `piece_bytes`."""
    if len(body) < 2 * piece_bytes:
        message.ParseFromString(body)
        return
    try:
        ends = piece_ends(body, piece_bytes)
    except ValueError:
        message.ParseFromString(body)  # raises the parser's own error
        return
    view = memoryview(body)
    message.Clear()
    start = 0
    try:
        for end in ends:
            message.MergeFromString(view[start:end])
            start = end
    except DecodeError:
        message.ParseFromString(body)  # the whole body's error, as it always read


__all__ = ["MAX_FIELDS", "PIECE_BYTES", "last_string_fields", "parse_in_pieces", "piece_ends"]
