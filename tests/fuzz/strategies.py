"""Hypothesis strategies for the bodies a schema cannot describe well: protobuf messages built
from the wire schema with random field values (then cut, garbled or wrongly compressed), and
JSON bodies that are structurally valid but carry hostile values."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import zstandard
from hypothesis import strategies as st

from tuneloop.types import proto

# ---- protobuf ---------------------------------------------------------------------------------

LOSS_NAMES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "custom"]
INPUT_KEYS = ["target_tokens", "weights", "advantages", "logprobs", "mask", ""]
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
# Mostly small, sometimes extreme: shapes and token ids near the vocabulary are the interesting
# part, and the extremes find overflow.
SMALL_OR_EXTREME = st.one_of(st.integers(-3, 300), INT64)
# float32 on the wire: wider values would only overflow in the test itself
FLOATS = st.one_of(st.floats(width=32), st.floats(-10, 10, width=32))


def _ints_bytes(draw: Any, dtype_width: int, length: int) -> bytes:
    values = draw(st.lists(st.integers(-3, 300) | INT32, min_size=length, max_size=length))
    width = "<i4" if dtype_width == 4 else "<i8"
    import numpy as np

    return np.asarray(values, dtype=np.int64).astype(width).tobytes()


@st.composite
def tensors(draw: Any, out: Any, n: int) -> None:
    """Fill the Tensor message `out`: right or wrong dtype, shape, length, dense or CSR."""
    import numpy as np

    out.dtype = draw(st.sampled_from([1, 2, 2, 3, 1, 2, 0, 4, 7]))
    length = draw(st.sampled_from([n, n, 0, n + 1, max(n - 1, 0)]))
    shape_kind = draw(st.sampled_from(["none", "right", "random"]))
    if shape_kind == "right":
        out.shape.extend([length])
    elif shape_kind == "random":
        out.shape.extend(draw(st.lists(SMALL_OR_EXTREME, max_size=3)))
    if draw(st.booleans()):
        values = draw(st.lists(FLOATS, min_size=length, max_size=length))
        raw = np.asarray(values, dtype="<f4").tobytes()
    else:
        raw = _ints_bytes(draw, draw(st.sampled_from([4, 8])), length)
    raw += draw(st.sampled_from([b""] * 5 + [b"\x01"]))  # sometimes not a whole number of items
    if draw(st.integers(0, 3)) == 0:
        # CSR with the right counts (else decoding stops early) but hostile contents: row
        # pointers out of order, columns out of range, a width of 2**40.
        del out.shape[:]
        rows, nnz = draw(st.integers(0, 4)), draw(st.integers(0, 4))
        out.shape.extend([rows, draw(st.integers(0, 8) | SMALL_OR_EXTREME)])
        pointers = st.lists(st.integers(-1, nnz + 1), min_size=rows + 1, max_size=rows + 1)
        crow = draw(pointers.map(sorted) | pointers)
        cols = draw(st.lists(st.integers(-2, 9), min_size=nnz, max_size=nnz))
        csr = out.sparse_csr
        csr.values = np.asarray(draw(st.lists(FLOATS, min_size=nnz, max_size=nnz)), "<f4").tobytes()
        if out.dtype == 2:
            csr.values = np.arange(nnz, dtype="<i8").tobytes()
        csr.crow_indices = np.asarray(crow, dtype="<i8").tobytes()
        csr.col_indices = np.asarray(cols, dtype="<i8").tobytes()
    else:
        out.dense = raw


@st.composite
def forward_backward_messages(draw: Any, model_ids: list[str]) -> bytes:
    """A ForwardBackwardRequest built from the schema with random (often hostile) values."""
    import numpy as np

    msg = proto.ForwardBackwardRequestProto()
    msg.model_id = draw(st.sampled_from(model_ids) | st.text(max_size=20))
    msg.seq_id = draw(st.one_of(st.integers(-2, 40), INT32))
    msg.loss_fn = draw(st.sampled_from(["cross_entropy"] * 4 + [*LOSS_NAMES, "", "nope"]))
    msg.forward_only = draw(st.booleans())
    for key, value in draw(
        st.dictionaries(st.sampled_from(["clip_low_threshold", "beta", "x"]), FLOATS, max_size=2)
    ).items():
        msg.loss_fn_config[key] = value
    for key in draw(st.lists(st.sampled_from(["clip_high_threshold", "y"]), max_size=2)):
        if draw(st.booleans()):
            msg.loss_fn_config_v2[key].text = draw(st.text(max_size=5))
        else:
            msg.loss_fn_config_v2[key].number = draw(FLOATS)
    for _ in range(draw(st.integers(0, 3))):
        datum = msg.data.add()
        n = 0
        for _ in range(draw(st.integers(0, 3))):
            chunk = datum.model_input.add()
            kind = draw(st.sampled_from(["text"] * 8 + ["image", "dmel", "unset"]))
            if kind == "text":
                count = draw(st.integers(0, 12))
                # Mostly valid ids, so that requests get past the token check to the tensors.
                token = draw(st.sampled_from([st.integers(0, 250)] * 3 + [st.integers(-2, 300)]))
                tokens = draw(
                    st.lists(token | INT32 if count > 11 else token, min_size=count, max_size=count)
                )
                chunk.encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes() + draw(
                    st.sampled_from([b""] * 5 + [b"\x00"])
                )
                n += count
            elif kind == "image":
                chunk.image.data = draw(st.binary(max_size=8))
                chunk.image.format = draw(st.sampled_from(["png", "jpeg", "gif", ""]))
                chunk.image.expected_tokens = draw(INT32)
            elif kind == "dmel":
                chunk.dmel.dmel = draw(st.binary(max_size=8))
            else:
                chunk.SetInParent()
        keys = draw(st.lists(st.sampled_from(INPUT_KEYS), max_size=3, unique=True))
        if draw(st.integers(0, 3)) and "target_tokens" not in keys:
            keys.insert(0, "target_tokens")  # required by every loss
        for key in keys:
            draw(tensors(datum.loss_fn_inputs[key], n))
    return bytes(msg.SerializeToString())


@dataclass(frozen=True)
class ProtoRequest:
    body: bytes  # as sent
    plain: bytes  # before compression, to tell an echo of the caller's input from a leak
    headers: dict[str, str]


@st.composite
def protobuf_requests(draw: Any, model_ids: list[str]) -> list[ProtoRequest]:
    """The message as is, plus one damaged variant: cut, garbled, wrongly (de)compressed."""
    raw = draw(forward_backward_messages(model_ids))
    ctype = {"content-type": "application/x-protobuf"}
    zstd = {**ctype, "content-encoding": "zstd"}
    out = [ProtoRequest(raw, raw, ctype)]
    damage = draw(
        st.sampled_from(["cut", "flip", "zstd", "bad-zstd", "zstd-no-header", "gzip", "json"])
    )
    if damage == "cut":
        cut = raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
        out.append(ProtoRequest(cut, cut, ctype))
    elif damage == "flip" and raw:
        at = draw(st.integers(0, len(raw) - 1))
        flipped = raw[:at] + bytes([raw[at] ^ draw(st.integers(1, 255))]) + raw[at + 1 :]
        out.append(ProtoRequest(flipped, flipped, ctype))
    elif damage == "zstd":
        out.append(ProtoRequest(zstandard.ZstdCompressor().compress(raw), raw, zstd))
    elif damage == "bad-zstd":
        packed = zstandard.ZstdCompressor().compress(raw)
        out.append(ProtoRequest(packed[: len(packed) // 2] + b"\xff" * 3, raw, zstd))
    elif damage == "zstd-no-header":
        out.append(ProtoRequest(zstandard.ZstdCompressor().compress(raw), raw, ctype))
    elif damage == "gzip":
        out.append(ProtoRequest(raw, raw, {**ctype, "content-encoding": "gzip"}))
    else:
        out.append(ProtoRequest(raw, raw, {"content-type": "application/json"}))
    return out


# ---- hostile JSON -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """A JSON fragment sent verbatim (what json.dumps cannot write: deep nesting, lone
    surrogates, huge exponents)."""

    text: str


def dumps(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value, allow_nan=True)  # NaN, Infinity: not JSON, but sent by some
    return json.dumps(value)


def _deep(depth: int, kind: str) -> Raw:
    open_, close = ("[", "]") if kind == "list" else ('{"a":', "}")
    return Raw(open_ * depth + "1" + close * depth)


HOSTILE = st.one_of(
    st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -1, -(2**31), 0]),
    st.integers(),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0]),
    st.sampled_from(
        [
            Raw("1e400"),
            Raw("-1e400"),
            Raw('"\\ud800"'),
            Raw('"\\u0000"'),
            Raw("9" * 5000),
            "",
            "\u202e\u0000\U0001f600",
            "tinker://",
            "../../etc/passwd",
            "x" * 20_000,
        ]
    ),
    st.text(max_size=30),
    st.builds(_deep, st.sampled_from([50, 500, 5000]), st.sampled_from(["list", "dict"])),
    st.sampled_from([[], {}, None, True, [[]], [None]]),
    st.lists(st.integers(-5, 300), max_size=40),
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location in a template: dict keys and list items, nested."""
    out: list[tuple[Any, ...]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append((*prefix, k))
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.append((*prefix, i))
            out.extend(_paths(v, (*prefix, i)))
    return out


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    copied = list(value)
    copied[head] = _replace(copied[head], rest, new)
    return copied


@st.composite
def hostile_bodies(draw: Any, template: Any) -> Any:
    """`template` with one to three of its values swapped for hostile ones, lists emptied or
    lengthened, or keys dropped (a structurally valid body with bad values)."""
    body = template
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(body)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["value", "value", "value", "empty", "grow", "drop"]))
        current: Any = body
        for part in path:
            current = current[part]
        if action == "empty" and isinstance(current, list | dict):
            body = _replace(body, path, type(current)())
        elif action == "grow" and isinstance(current, list):
            body = _replace(body, path, current * draw(st.integers(2, 50)))
        elif action == "drop" and isinstance(path[-1], str):
            parent: Any = body
            for part in path[:-1]:
                parent = parent[part]
            pruned = {k: v for k, v in parent.items() if k != path[-1]}
            body = _replace(body, path[:-1], pruned)
        else:
            body = _replace(body, path, draw(HOSTILE))
    return body
