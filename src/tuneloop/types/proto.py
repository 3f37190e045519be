"""The protobuf schema of the wire (forward_backward requests and results, sample results).

Built from a compact table at import time instead of generated code, so there is no protoc
step and no generated-code/runtime version coupling. Field numbers follow the wire spec 4.5.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
    "double": _F.TYPE_DOUBLE,
    "bool": _F.TYPE_BOOL,
}
_ENUMS = {
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
}
# message -> [(name, number, type, label)], label: "" | "repeated" | "map:<value type>" |
# "oneof:<group>"
_MESSAGES: dict[str, list[tuple[str, int, str, str]]] = {
    "LossConfigValue": [
        ("number", 1, "double", "oneof:value"),
        ("text", 2, "string", "oneof:value"),
    ],
    "EncodedTextChunk": [("tokens", 1, "bytes", "")],
    "ImageDimensions": [("width", 1, "uint32", ""), ("height", 2, "uint32", "")],
    "ImageChunk": [
        ("data", 1, "bytes", ""),
        ("format", 2, "string", ""),
        ("expected_tokens", 3, "int32", ""),
        ("override_dimensions", 4, "ImageDimensions", ""),
    ],
    "DmelChunk": [("dmel", 1, "bytes", "")],
    "Chunk": [
        ("encoded_text", 1, "EncodedTextChunk", "oneof:chunk"),
        ("image", 2, "ImageChunk", "oneof:chunk"),
        ("dmel", 3, "DmelChunk", "oneof:chunk"),
    ],
    "PromptProvenanceSpan": [
        ("sequence_id", 1, "string", ""),
        ("offset", 2, "int64", ""),
        ("length", 3, "int64", ""),
    ],
    "SampledProvenanceSpan": [
        ("sequence_id", 1, "string", ""),
        ("offset", 2, "int64", ""),
        ("length", 3, "int64", ""),
    ],
    "ProvenanceSpan": [
        ("prompt_tokens", 1, "PromptProvenanceSpan", "oneof:span"),
        ("sampled_tokens", 2, "SampledProvenanceSpan", "oneof:span"),
    ],
    "SparseCsr": [
        ("values", 1, "bytes", ""),
        ("crow_indices", 2, "bytes", ""),
        ("col_indices", 3, "bytes", ""),
    ],
    "Tensor": [
        ("dense", 1, "bytes", "oneof:encoding"),
        ("sparse_csr", 2, "SparseCsr", "oneof:encoding"),
        ("dtype", 3, "DType", ""),
        ("shape", 4, "int64", "repeated"),
    ],
    "Datum": [
        ("model_input", 1, "Chunk", "repeated"),
        ("loss_fn_inputs", 2, "Tensor", "map:string"),
        ("model_input_spans", 3, "ProvenanceSpan", "repeated"),
        ("loss_fn_input_spans", 4, "ProvenanceSpan", "repeated"),
    ],
    "ForwardBackwardRequest": [
        ("model_id", 1, "string", ""),
        ("seq_id", 2, "int32", ""),
        ("data", 3, "Datum", "repeated"),
        ("loss_fn", 4, "string", ""),
        ("loss_fn_config", 5, "double", "map:string"),
        ("forward_only", 6, "bool", ""),
        ("loss_fn_config_v2", 7, "LossConfigValue", "map:string"),
    ],
    "BatchedTensor": [
        ("data", 1, "bytes", ""),
        ("offsets", 2, "bytes", ""),
        ("dtype", 3, "DType", ""),
        ("trailing_shape", 4, "int64", "repeated"),
    ],
    "ArrayRecord": [
        ("type_tag", 1, "string", ""),
        ("fields", 2, "BatchedTensor", "map:string"),
        ("num_datums", 3, "int64", ""),
    ],
    "ForwardBackwardOutput": [
        ("loss_fn_output_type", 1, "string", ""),
        ("loss_fn_outputs", 2, "ArrayRecord", "repeated"),
        ("metrics", 3, "double", "map:string"),
    ],
    "TopkLogprobs": [
        ("token_ids", 1, "bytes", ""),
        ("logprobs", 2, "bytes", ""),
        ("k", 3, "uint32", ""),
        ("length", 4, "uint32", ""),
    ],
    "SampledSequence": [
        ("stop_reason", 1, "StopReason", ""),
        ("tokens", 2, "bytes", ""),
        ("logprobs", 3, "bytes", ""),
        ("topk_sampled_logprobs", 4, "TopkLogprobs", ""),
    ],
    "PromptAltTokens": [("tokens", 1, "Tensor", ""), ("logprobs", 2, "Tensor", "")],
    "SampleResponse": [
        ("sequences", 1, "SampledSequence", "repeated"),
        ("prompt_logprobs", 2, "bytes", ""),
        ("topk_prompt_logprobs", 3, "TopkLogprobs", ""),
        ("prompt_cache_hit_tokens", 4, "int32", ""),
        ("target_prompt_logprobs", 5, "Tensor", ""),
        ("prompt_alt_tokens", 6, "PromptAltTokens", ""),
    ],
}
_PACKAGE = "tuneloop.wire"


def _set_type(field: descriptor_pb2.FieldDescriptorProto, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    elif type_name in _ENUMS:
        field.type = _F.TYPE_ENUM
        field.type_name = f".{_PACKAGE}.{type_name}"
    else:
        field.type = _F.TYPE_MESSAGE
        field.type_name = f".{_PACKAGE}.{type_name}"


def _build_file() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(
        name="tuneloop_wire.proto", package=_PACKAGE, syntax="proto3"
    )
    for enum_name, values in _ENUMS.items():
        enum = file.enum_type.add(name=enum_name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for msg_name, fields in _MESSAGES.items():
        msg = file.message_type.add(name=msg_name)
        oneofs: dict[str, int] = {}
        for name, number, type_name, label in fields:
            field = msg.field.add(name=name, number=number, label=_F.LABEL_OPTIONAL)
            if label.startswith("map:"):
                entry_name = "".join(p.capitalize() for p in name.split("_")) + "Entry"
                entry = msg.nested_type.add(name=entry_name)
                entry.options.map_entry = True
                key = entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL)
                _set_type(key, label.split(":", 1)[1])
                value = entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL)
                _set_type(value, type_name)
                field.label = _F.LABEL_REPEATED
                field.type = _F.TYPE_MESSAGE
                field.type_name = f".{_PACKAGE}.{msg_name}.{entry_name}"
                continue
            _set_type(field, type_name)
            if label == "repeated":
                field.label = _F.LABEL_REPEATED
            elif label.startswith("oneof:"):
                group = label.split(":", 1)[1]
                if group not in oneofs:
                    oneofs[group] = len(msg.oneof_decl)
                    msg.oneof_decl.add(name=group)
                field.oneof_index = oneofs[group]
    return file


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_build_file())


def message_class(name: str) -> Any:
    """The generated message class for one schema message, e.g. `message_class("Tensor")`."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


DTYPE_FLOAT32 = 1
DTYPE_INT64 = 2
DTYPE_INT32 = 3
DTYPE_BFLOAT16 = 4
STOP_REASON_STOP = 0
STOP_REASON_LENGTH = 1

ForwardBackwardRequestProto = message_class("ForwardBackwardRequest")
ForwardBackwardOutputProto = message_class("ForwardBackwardOutput")
SampleResponseProto = message_class("SampleResponse")
TensorProto = message_class("Tensor")
