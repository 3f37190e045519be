"""Datum: one training example, a ModelInput plus the loss function's per-token inputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tuneloop.types.model_input import ModelInput
from tuneloop.types.provenance import PromptProvenanceSpan, ProvenanceSpan, SampledProvenanceSpan
from tuneloop.types.tensor import TensorData, TensorDtype

# Plain lists get their dtype from the key; other keys must arrive as arrays or TensorData.
LOSS_INPUT_DTYPES: dict[str, TensorDtype] = {
    "target_tokens": "int64",
    "weights": "float32",
    "logprobs": "float32",
    "advantages": "float32",
    "sequence_ratio_mask": "float32",
    "clip_low_threshold": "float32",
    "clip_high_threshold": "float32",
}
# 2-D target_tokens/weights (top-K cross-entropy) are mostly padding, so they travel as CSR.
_SPARSIFIED_KEYS = ("target_tokens", "weights")


def to_tensor_data(key: str, value: Any) -> TensorData:
    """Convert one loss input (TensorData, NumPy, torch or a plain list) to TensorData."""
    if isinstance(value, TensorData):
        return value
    if type(value).__module__.startswith("torch"):
        if value.dim() == 2 and key in _SPARSIFIED_KEYS:
            return TensorData.from_torch_sparse(value)
        return TensorData.from_torch(value)
    if isinstance(value, np.ndarray):
        return TensorData.from_numpy(value)
    if isinstance(value, list | tuple):
        if key not in LOSS_INPUT_DTYPES:
            raise ValueError(f"loss_fn_inputs[{key!r}]: pass a NumPy array or TensorData")
        array = np.asarray(
            value, dtype=np.float32 if LOSS_INPUT_DTYPES[key] == "float32" else np.int64
        )
        return TensorData(array.reshape(-1), LOSS_INPUT_DTYPES[key], list(array.shape))
    raise TypeError(f"loss_fn_inputs[{key!r}]: unsupported type {type(value).__name__}")


@dataclass(frozen=True)
class Datum:
    model_input: ModelInput
    loss_fn_inputs: Mapping[str, TensorData] = field(default_factory=dict)
    # Provenance (stable_reinforce): both set or neither; see tuneloop.types.provenance.
    # Attach with `with_provenance`, which checks that the spans tile their fields.
    model_input_spans: tuple[ProvenanceSpan, ...] | None = None
    loss_fn_input_spans: tuple[ProvenanceSpan, ...] | None = None

    def __post_init__(self) -> None:
        converted = {k: to_tensor_data(k, v) for k, v in self.loss_fn_inputs.items()}
        object.__setattr__(self, "loss_fn_inputs", converted)
        for name in ("model_input_spans", "loss_fn_input_spans"):
            spans = getattr(self, name)
            if spans is not None:
                object.__setattr__(self, name, _span_tuple(name, spans))
        if (self.model_input_spans is None) != (self.loss_fn_input_spans is None):
            raise ValueError(
                "provenance comes as a pair: set both model_input_spans and "
                "loss_fn_input_spans, or neither"
            )

    def with_provenance(
        self,
        model_input: Sequence[ProvenanceSpan],
        loss_fn_inputs: Sequence[ProvenanceSpan],
    ) -> Datum:
        """A copy carrying provenance (what `stable_reinforce` needs), as the official SDK's
        `Datum.with_provenance`: `model_input` spans tile the input tokens, `loss_fn_inputs`
        spans tile `loss_fn_inputs["target_tokens"]`, in order. A miscount fails here, not as
        a 400 from the server."""
        model_spans = _span_tuple("model_input", model_input)
        target_spans = _span_tuple("loss_fn_inputs", loss_fn_inputs)
        _check_tiling("model_input", model_spans, self.model_input.length)
        targets = self.loss_fn_inputs.get("target_tokens")
        shape = None if targets is None else targets.to_numpy().shape
        if shape is not None and len(shape) == 1:
            _check_tiling("loss_fn_inputs", target_spans, shape[0])
        return replace(self, model_input_spans=model_spans, loss_fn_input_spans=target_spans)


def _span_tuple(name: str, spans: Sequence[ProvenanceSpan]) -> tuple[ProvenanceSpan, ...]:
    out = tuple(spans)
    for span in out:
        if not isinstance(span, PromptProvenanceSpan | SampledProvenanceSpan):
            raise TypeError(
                f"{name} entries must be PromptProvenanceSpan or SampledProvenanceSpan, "
                f"got {type(span).__name__}"
            )
    return out


def _check_tiling(name: str, spans: tuple[ProvenanceSpan, ...], expected: int) -> None:
    total = sum(span.length for span in spans)
    if total != expected:
        raise ValueError(
            f"with_provenance {name} spans cover {total} positions but the field has "
            f"{expected}; the spans must tile it exactly"
        )
