"""Protobuf <-> wire types, for the three messages that travel as protobuf.

Decoding raises `WireFormatError` naming the offending field, so a server can answer 400.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from tuneloop.types import proto
from tuneloop.types.datum import Datum
from tuneloop.types.model_input import EncodedTextChunk, ImageChunk, ModelInput
from tuneloop.types.proto_pieces import parse_in_pieces
from tuneloop.types.provenance import PromptProvenanceSpan, ProvenanceSpan, SampledProvenanceSpan
from tuneloop.types.sampling import TOPK_SENTINEL, SampledSequence, SampleResponse, TopkRow
from tuneloop.types.tensor import TensorData, TensorDtype
from tuneloop.types.training import ForwardBackwardOutput

_DTYPE_TO_PROTO = {"float32": proto.DTYPE_FLOAT32, "int64": proto.DTYPE_INT64}
_PROTO_TO_NUMPY: dict[int, np.dtype[Any]] = {
    proto.DTYPE_FLOAT32: np.dtype("<f4"),
    proto.DTYPE_INT64: np.dtype("<i8"),
    proto.DTYPE_INT32: np.dtype("<i4"),
}


class WireFormatError(ValueError):
    """A protobuf body that does not decode, or decodes to inconsistent tensors."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


# ---- tensors -------------------------------------------------------------------------------


def _tensor_to_proto(tensor: TensorData, out: Any) -> None:
    msg = out
    msg.dtype = _DTYPE_TO_PROTO[tensor.dtype]
    shape = tensor.shape if tensor.shape is not None else [tensor.values.size]
    msg.shape.extend(shape)
    values = tensor.values.astype(tensor.values.dtype.newbyteorder("<"), copy=False).tobytes()
    if tensor.is_sparse:
        csr = msg.sparse_csr
        csr.values = values
        csr.crow_indices = np.asarray(tensor.sparse_crow_indices, dtype="<i8").tobytes()
        csr.col_indices = np.asarray(tensor.sparse_col_indices, dtype="<i8").tobytes()
    else:
        msg.dense = values


def _serialized(msg: Any) -> bytes:
    """`msg`'s bytes with map entries in key order: protobuf's default order follows the
    map's hash table, whose seed differs per process, so the same request could encode to
    different bytes (a decode and re-encode of a body was not always the body)."""
    return bytes(msg.SerializeToString(deterministic=True))


def _frombuffer(raw: bytes, dtype: np.dtype[Any], where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise WireFormatError(f"{where}: {len(raw)} bytes is not a whole number of {dtype}", where)
    return np.frombuffer(raw, dtype=dtype)


@dataclass
class DecodeLimits:
    """Bounds a server checks on each tensor's declared shape before any array is built.

    `max_rows`: the model's context length (a per-token input has one row per token);
    `max_columns`: the vocabulary (top-K targets are no wider); `max_dense_cells`: what all
    sparse tensors of the request may expand to together. A sparse tensor is a compression of
    a dense one, so its dense form may hold no more cells than a dense body within the size
    limit could carry (4 bytes a cell): a 1.6 MB body then cannot ask for 400 MB.
    """

    max_rows: int
    max_columns: int
    max_dense_cells: int

    def check_shape(self, shape: list[int], sparse: bool, where: str) -> None:
        if len(shape) not in (1, 2):
            raise WireFormatError(f"{where}: shape {shape} must be 1-D or 2-D", where)
        if shape[0] > self.max_rows:
            raise WireFormatError(
                f"{where}: {shape[0]} rows exceed the context length {self.max_rows}", where
            )
        if len(shape) == 2 and shape[1] > self.max_columns:
            raise WireFormatError(
                f"{where}: {shape[1]} columns, at most {self.max_columns} (the vocabulary)",
                where,
            )
        if sparse:
            cells = math.prod(shape)
            if cells > self.max_dense_cells:
                raise WireFormatError(
                    f"{where}: a sparse tensor of shape {shape} would expand to {cells} cells; "
                    f"the request's sparse tensors may expand to {self.max_dense_cells} "
                    "(what the body size limit carries densely)",
                    where,
                )
            self.max_dense_cells -= cells


def tensor_from_proto(msg: Any, where: str, limits: DecodeLimits | None = None) -> TensorData:
    dtype_code = msg.dtype
    np_dtype = _PROTO_TO_NUMPY.get(dtype_code)
    if np_dtype is None:
        raise WireFormatError(f"{where}: unsupported dtype {dtype_code}", where)
    wire_dtype: TensorDtype = "float32" if np_dtype.kind == "f" else "int64"
    shape = [int(s) for s in msg.shape]
    sparse = msg.WhichOneof("encoding") == "sparse_csr"
    if limits is not None:
        if not shape:  # dense and shapeless: one row per value
            shape = [len(msg.dense) // np_dtype.itemsize]
        limits.check_shape(shape, sparse, where)
    try:
        if sparse:
            csr = msg.sparse_csr
            return TensorData(
                _frombuffer(csr.values, np_dtype, where),
                wire_dtype,
                shape,
                _frombuffer(csr.crow_indices, np.dtype("<i8"), where),
                _frombuffer(csr.col_indices, np.dtype("<i8"), where),
            )
        values = _frombuffer(msg.dense, np_dtype, where)
        return TensorData(values, wire_dtype, shape or [values.size])
    except ValueError as exc:
        if isinstance(exc, WireFormatError):
            raise
        raise WireFormatError(f"{where}: {exc}", where) from exc


# ---- forward_backward request ----------------------------------------------------------------


def encode_forward_backward_request(request: ForwardBackwardRequest) -> bytes:
    msg = proto.ForwardBackwardRequestProto(
        model_id=request.model_id,
        seq_id=request.seq_id,
        loss_fn=request.loss_fn,
        forward_only=request.forward_only,
    )
    for key, value in request.loss_fn_config.items():
        if isinstance(value, str):
            msg.loss_fn_config_v2[key].text = value
        else:
            msg.loss_fn_config[key] = float(value)
            msg.loss_fn_config_v2[key].number = float(value)
    for datum in request.data:
        out = msg.data.add()
        for chunk in datum.model_input.chunks:
            chunk_msg = out.model_input.add()
            if isinstance(chunk, EncodedTextChunk):
                chunk_msg.encoded_text.tokens = np.asarray(chunk.tokens, dtype="<i4").tobytes()
            else:
                chunk_msg.image.data = base64.b64decode(chunk.data)
                chunk_msg.image.format = chunk.format
                if chunk.expected_tokens is not None:
                    chunk_msg.image.expected_tokens = chunk.expected_tokens
        for key, tensor in datum.loss_fn_inputs.items():
            _tensor_to_proto(tensor, out.loss_fn_inputs[key])
        _spans_to_proto(datum.model_input_spans, out.model_input_spans)
        _spans_to_proto(datum.loss_fn_input_spans, out.loss_fn_input_spans)
    return _serialized(msg)


def _spans_to_proto(spans: tuple[ProvenanceSpan, ...] | None, out: Any) -> None:
    for span in spans or ():
        kind = "prompt_tokens" if isinstance(span, PromptProvenanceSpan) else "sampled_tokens"
        target = getattr(out.add(), kind)
        target.sequence_id = span.sequence_id
        target.offset = span.offset
        target.length = span.length


def _spans_from_proto(spans: Any, where: str) -> tuple[ProvenanceSpan, ...]:
    decoded: list[ProvenanceSpan] = []
    for k, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise WireFormatError(f"{where}[{k}]: a span of no kind", f"{where}[{k}]")
        inner = getattr(span, kind)
        if inner.offset < 0 or inner.length < 0:
            raise WireFormatError(f"{where}[{k}]: offset and length must be >= 0", f"{where}[{k}]")
        if not inner.sequence_id:
            field = f"{where}[{k}].sequence_id"
            raise WireFormatError(f"{field}: must be non-empty", field)
        cls = PromptProvenanceSpan if kind == "prompt_tokens" else SampledProvenanceSpan
        decoded.append(
            cls(sequence_id=inner.sequence_id, offset=int(inner.offset), length=int(inner.length))
        )
    return tuple(decoded)


def parse_forward_backward_request(body: bytes) -> Any:
    """The protobuf message of a forward_backward body (its model_id names the model whose
    limits `forward_backward_request_from_proto` then checks)."""
    msg = proto.ForwardBackwardRequestProto()
    try:
        parse_in_pieces(msg, body)  # a large body: no one call holds the GIL for long
    except DecodeError as exc:
        raise WireFormatError(f"malformed ForwardBackwardRequest protobuf: {exc}", "body") from exc
    return msg


def decode_forward_backward_request(
    body: bytes, limits: DecodeLimits | None = None, *, token_arrays: bool = False
) -> ForwardBackwardRequest:
    return forward_backward_request_from_proto(
        parse_forward_backward_request(body), limits, token_arrays=token_arrays
    )


def forward_backward_request_from_proto(
    msg: Any, limits: DecodeLimits | None = None, *, token_arrays: bool = False
) -> ForwardBackwardRequest:
    """The request a protobuf message holds; `WireFormatError` names a bad field.

    With `token_arrays`, each text chunk's `tokens` is the int32 NumPy array read from the
    packed field, not a list of ints (a server's decode: building 4 million Python ints for a
    64 MB body, and an array from them again, held the GIL for most of the decode; see
    `tuneloop.server.api.validation.tokens_of`, which takes either)."""
    data: list[Datum] = []
    for i, datum in enumerate(msg.data):
        chunks: list[EncodedTextChunk | ImageChunk] = []
        tokens_in_datum = 0
        for j, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk")
            where = f"data[{i}].model_input[{j}]"
            if kind == "encoded_text":
                tokens = _frombuffer(chunk.encoded_text.tokens, np.dtype("<i4"), where)
                tokens_in_datum += tokens.size
                if limits is not None and tokens_in_datum > limits.max_rows:
                    raise WireFormatError(
                        f"data[{i}].model_input: more than {limits.max_rows} tokens (the "
                        "context length)",
                        f"data[{i}].model_input",
                    )
                # int32 values from the buffer: valid by construction, so not validated again
                # (half the decoding time of a large body).
                chunks.append(
                    EncodedTextChunk.model_construct(
                        tokens=tokens if token_arrays else tokens.tolist()
                    )
                )
            elif kind == "image":
                fmt = chunk.image.format
                if fmt not in ("png", "jpeg"):
                    raise WireFormatError(f"{where}.format: must be png or jpeg", where)
                if chunk.image.expected_tokens < 0:  # int32 on the wire: may be negative
                    raise WireFormatError(
                        f"{where}.expected_tokens: must be >= 0", f"{where}.expected_tokens"
                    )
                chunks.append(
                    ImageChunk(
                        data=base64.b64encode(chunk.image.data).decode(),
                        format=fmt,
                        expected_tokens=chunk.image.expected_tokens or None,
                    )
                )
            else:
                raise WireFormatError(f"{where}: unsupported chunk type {kind}", where)
        inputs = {
            key: tensor_from_proto(tensor, f"data[{i}].loss_fn_inputs[{key!r}]", limits)
            for key, tensor in datum.loss_fn_inputs.items()
        }
        # proto3 cannot tell an empty span list from none: no spans at all means no provenance.
        has_spans = bool(datum.model_input_spans) or bool(datum.loss_fn_input_spans)
        data.append(
            Datum(
                model_input=ModelInput(chunks=chunks),
                loss_fn_inputs=inputs,
                model_input_spans=(
                    _spans_from_proto(datum.model_input_spans, f"data[{i}].model_input_spans")
                    if has_spans
                    else None
                ),
                loss_fn_input_spans=(
                    _spans_from_proto(datum.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans")
                    if has_spans
                    else None
                ),
            )
        )
    # The v2 map carries strings too and wins where both are present (spec 3, common conventions).
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind == "text":
            config[key] = value.text
        elif kind == "number":
            config[key] = value.number
    return ForwardBackwardRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        data=data,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
    )


# ---- forward_backward output -----------------------------------------------------------------


def encode_forward_backward_output(output: ForwardBackwardOutput) -> bytes:
    msg = proto.ForwardBackwardOutputProto(loss_fn_output_type=output.loss_fn_output_type)
    for key, value in output.metrics.items():
        msg.metrics[key] = float(value)
    if output.loss_fn_outputs:
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord")
        record.num_datums = len(output.loss_fn_outputs)
        for key in output.loss_fn_outputs[0]:
            arrays = [outputs[key].to_numpy() for outputs in output.loss_fn_outputs]
            dtype = arrays[0].dtype
            wire_dtype = "float32" if dtype.kind == "f" else "int64"
            np_dtype = np.dtype("<f4") if wire_dtype == "float32" else np.dtype("<i8")
            chunks = [a.astype(np_dtype).tobytes() for a in arrays]
            offsets = np.concatenate([[0], np.cumsum([len(c) for c in chunks])]).astype("<i8")
            batched = record.fields[key]
            batched.data = b"".join(chunks)
            batched.offsets = offsets.tobytes()
            batched.dtype = _DTYPE_TO_PROTO[wire_dtype]
            batched.trailing_shape.extend(arrays[0].shape[1:])
    return _serialized(msg)


def decode_forward_backward_output(body: bytes) -> ForwardBackwardOutput:
    msg = proto.ForwardBackwardOutputProto()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise WireFormatError(f"malformed ForwardBackwardOutput protobuf: {exc}", "body") from exc
    outputs: list[dict[str, TensorData]] = []
    for record in msg.loss_fn_outputs:
        per_datum: list[dict[str, TensorData]] = [{} for _ in range(record.num_datums)]
        for key, batched in record.fields.items():
            np_dtype = _PROTO_TO_NUMPY[batched.dtype]
            offsets = np.frombuffer(batched.offsets, dtype="<i8")
            trailing = [int(s) for s in batched.trailing_shape]
            for i in range(record.num_datums):
                raw = np.frombuffer(batched.data[offsets[i] : offsets[i + 1]], dtype=np_dtype)
                per_datum[i][key] = TensorData.from_numpy(
                    raw.reshape([-1, *trailing]).astype(
                        np.float32 if np_dtype.kind == "f" else np.int64
                    )
                )
        outputs.extend(per_datum)
    return ForwardBackwardOutput(
        loss_fn_output_type=msg.loss_fn_output_type or "ArrayRecord",
        loss_fn_outputs=outputs,
        metrics=dict(msg.metrics),
    )


# ---- sample response -------------------------------------------------------------------------


def _topk_to_proto(rows: list[TopkRow], out: Any) -> None:
    k = max((len(r) for r in rows if r), default=0)
    ids = np.full((len(rows), k), TOPK_SENTINEL[0], dtype="<i4")
    lps = np.full((len(rows), k), TOPK_SENTINEL[1], dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, lp) in enumerate(row or []):
            ids[i, j], lps[i, j] = token, lp
    out.token_ids = ids.tobytes()
    out.logprobs = lps.tobytes()
    out.k = k
    out.length = len(rows)


def _topk_from_proto(msg: Any) -> list[TopkRow] | None:
    n, k = msg.length, msg.k
    if n == 0 or k == 0:
        return None
    ids = np.frombuffer(msg.token_ids, dtype="<i4").reshape(n, k)
    lps = np.frombuffer(msg.logprobs, dtype="<f4").reshape(n, k)
    rows: list[TopkRow] = []
    for i in range(n):
        row = [
            (int(t), float(lp))
            for t, lp in zip(ids[i], lps[i], strict=True)
            if not (t == TOPK_SENTINEL[0] and lp == TOPK_SENTINEL[1])
        ]
        rows.append(row or None)
    return rows


def encode_sample_response(response: SampleResponse) -> bytes:
    msg = proto.SampleResponseProto(prompt_cache_hit_tokens=response.prompt_cache_hit_tokens)
    for seq in response.sequences:
        out = msg.sequences.add()
        out.stop_reason = (
            proto.STOP_REASON_STOP if seq.stop_reason == "stop" else proto.STOP_REASON_LENGTH
        )
        out.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        if seq.logprobs is not None:
            out.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        if seq.topk_logprobs is not None:
            _topk_to_proto(seq.topk_logprobs, out.topk_sampled_logprobs)
    if response.prompt_logprobs is not None:
        prompt_logprobs = response.prompt_logprobs_np
        assert prompt_logprobs is not None
        msg.prompt_logprobs = prompt_logprobs.astype("<f4").tobytes()
    if response.topk_prompt_logprobs is not None:
        _topk_to_proto(response.topk_prompt_logprobs, msg.topk_prompt_logprobs)
    return _serialized(msg)


def decode_sample_response(body: bytes) -> SampleResponse:
    msg = proto.SampleResponseProto()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise WireFormatError(f"malformed SampleResponse protobuf: {exc}", "body") from exc
    sequences = [
        SampledSequence(
            stop_reason="stop" if seq.stop_reason == proto.STOP_REASON_STOP else "length",
            tokens=np.frombuffer(seq.tokens, dtype="<i4").tolist(),
            logprobs=np.frombuffer(seq.logprobs, dtype="<f4").tolist() if seq.logprobs else None,
            topk_logprobs=(
                _topk_from_proto(seq.topk_sampled_logprobs)
                if seq.HasField("topk_sampled_logprobs")
                else None
            ),
        )
        for seq in msg.sequences
    ]
    prompt_logprobs: list[float | None] | None = None
    if msg.prompt_logprobs:
        raw = np.frombuffer(msg.prompt_logprobs, dtype="<f4")
        prompt_logprobs = [None if np.isnan(v) else float(v) for v in raw]
    return SampleResponse(
        sequences=sequences,
        prompt_logprobs=prompt_logprobs,
        topk_prompt_logprobs=(
            _topk_from_proto(msg.topk_prompt_logprobs)
            if msg.HasField("topk_prompt_logprobs")
            else None
        ),
        prompt_cache_hit_tokens=msg.prompt_cache_hit_tokens,
    )
