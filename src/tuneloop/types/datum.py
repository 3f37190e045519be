"""Datum: one training example, a ModelInput plus the loss function's per-token inputs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tuneloop.types.model_input import ModelInput
from tuneloop.types.provenance import ProvenanceSpan
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
    model_input_spans: tuple[ProvenanceSpan, ...] | None = None
    loss_fn_input_spans: tuple[ProvenanceSpan, ...] | None = None

    def __post_init__(self) -> None:
        converted = {k: to_tensor_data(k, v) for k, v in self.loss_fn_inputs.items()}
        object.__setattr__(self, "loss_fn_inputs", converted)
