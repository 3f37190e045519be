"""Turn wire requests into engine work, rejecting anything the engine should not see.

Every error names its field (e.g. `data[2].loss_fn_inputs.advantages`) so the user can fix it;
the engine then trusts its inputs.
"""

from __future__ import annotations

import math

import numpy as np

from tuneloop.server.api.errors import ApiError, bad_request
from tuneloop.server.engine.loss_specs import LOSS_SPECS, UNSUPPORTED_LOSSES
from tuneloop.server.engine.types import (
    AdamStep,
    Example,
    ForwardBackwardWork,
    ModelSpec,
    SampleWork,
)
from tuneloop.types import EncodedTextChunk, ModelInput, OptimStepRequest, SampleRequest
from tuneloop.types.codec import DecodeLimits, ForwardBackwardRequest
from tuneloop.types.tensor import TensorData

MAX_DATUMS_PER_REQUEST = 4096


def tokens_of(model_input: ModelInput, spec: ModelSpec, field: str) -> np.ndarray:
    """The input's tokens as one int64 array, checked against the model's vocabulary and
    context length. A chunk's tokens may be a list of ints (JSON) or an int32 array (a protobuf
    body decoded with `token_arrays`): arrays are joined without a Python int per token."""
    parts: list[np.ndarray] = []
    count = 0
    for j, chunk in enumerate(model_input.chunks):
        if not isinstance(chunk, EncodedTextChunk):
            raise bad_request(
                f"{field}.chunks[{j}]: {chunk.type} chunks are not supported by {spec.name}",
                f"{field}.chunks[{j}]",
            )
        count += len(chunk.tokens)
        if count > spec.max_context_length:  # before the array is built
            raise bad_request(
                f"{field}: more than {spec.max_context_length} tokens exceed the context length",
                field,
            )
        tokens = chunk.tokens
        parts.append(
            tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)
        )
    if not count:
        raise bad_request(f"{field}: must hold at least one token", field)
    array = parts[0].astype(np.int64) if len(parts) == 1 else np.concatenate(parts, dtype=np.int64)
    bad = np.flatnonzero((array < 0) | (array >= spec.vocab_size))
    if bad.size:
        raise bad_request(
            f"{field}: token id {int(array[bad[0]])} at position {int(bad[0])} is outside the "
            f"vocabulary [0, {spec.vocab_size})",
            field,
        )
    return array


def _loss_config(request: ForwardBackwardRequest) -> dict[str, float]:
    spec = LOSS_SPECS[request.loss_fn]
    config: dict[str, float] = {}
    for key, value in request.loss_fn_config.items():
        field = f"loss_fn_config.{key}"
        if key not in spec.config_defaults:
            allowed = ", ".join(sorted(spec.config_defaults)) or "none"
            raise bad_request(f"{field}: unknown key for {spec.name} (allowed: {allowed})", field)
        if isinstance(value, str) or not math.isfinite(value):
            raise bad_request(f"{field}: must be a finite number", field)
        config[key] = float(value)
    return config


def _check_input(
    name: str, tensor: TensorData, n: int, two_d_ok: bool, field: str, max_width: int
) -> np.ndarray:
    # The whole shape first: a sparse tensor's dense form is allocated from it (2**40 columns,
    # or 200,000 rows, would ask for gigabytes before any other check).
    shape = tensor.dense_shape
    if len(shape) == 2 and two_d_ok and name in ("target_tokens", "weights"):
        if shape[1] > max_width:
            raise bad_request(f"{field}: {shape[1]} columns, at most {max_width}", field)
        if shape[0] != n:
            raise bad_request(f"{field}: {shape[0]} rows, but model_input has {n} tokens", field)
    elif len(shape) != 1 or shape[0] != n:
        raise bad_request(
            f"{field}: shape {list(shape)} does not match model_input length {n}", field
        )
    array = tensor.to_numpy()
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise bad_request(f"{field}: contains NaN or infinity", field)
    return array


def decode_limits(spec: ModelSpec, max_request_bytes: int) -> DecodeLimits:
    """What the tensors of a forward_backward body for `spec` may declare (see DecodeLimits)."""
    return DecodeLimits(
        max_rows=spec.max_context_length,
        max_columns=spec.vocab_size,
        max_dense_cells=max_request_bytes // 4,
    )


def forward_backward_work(
    request: ForwardBackwardRequest, spec: ModelSpec, adapter_id: str
) -> ForwardBackwardWork:
    if request.loss_fn in UNSUPPORTED_LOSSES:
        raise bad_request(
            f"loss_fn: {request.loss_fn!r} is not supported: {UNSUPPORTED_LOSSES[request.loss_fn]}",
            "loss_fn",
        )
    if request.loss_fn not in LOSS_SPECS:
        raise bad_request(
            f"loss_fn: unknown loss {request.loss_fn!r} (known: {', '.join(LOSS_SPECS)})",
            "loss_fn",
        )
    if request.seq_id < 1:
        raise bad_request("seq_id: must be >= 1 (seq 0 is the model's creation)", "seq_id")
    if not request.data:
        raise bad_request("data: must hold at least one datum", "data")
    if len(request.data) > MAX_DATUMS_PER_REQUEST:
        raise bad_request(f"data: at most {MAX_DATUMS_PER_REQUEST} datums per request", "data")
    loss = LOSS_SPECS[request.loss_fn]
    config = _loss_config(request)
    examples = []
    for i, datum in enumerate(request.data):
        tokens = tokens_of(datum.model_input, spec, f"data[{i}].model_input")
        inputs: dict[str, np.ndarray] = {}
        for key in datum.loss_fn_inputs:
            if key not in loss.inputs:
                raise bad_request(
                    f"data[{i}].loss_fn_inputs.{key}: not an input of {loss.name} "
                    f"(inputs: {', '.join(loss.inputs)})",
                    f"data[{i}].loss_fn_inputs.{key}",
                )
        for key in loss.required_inputs:
            if key not in datum.loss_fn_inputs:
                raise bad_request(
                    f"data[{i}].loss_fn_inputs.{key}: required by {loss.name}",
                    f"data[{i}].loss_fn_inputs.{key}",
                )
        for key, tensor in datum.loss_fn_inputs.items():
            inputs[key] = _check_input(
                key,
                tensor,
                tokens.size,
                loss.allows_2d_targets,
                f"data[{i}].loss_fn_inputs.{key}",
                spec.vocab_size,  # top-K targets: K can be no wider than the vocabulary
            )
        targets = inputs["target_tokens"].astype(np.int64)
        field = f"data[{i}].loss_fn_inputs.target_tokens"
        if ((targets < 0) | (targets >= spec.vocab_size)).any():
            raise bad_request(f"{field}: token ids must be in [0, {spec.vocab_size})", field)
        weights = inputs.get("weights")
        if weights is not None and weights.shape != targets.shape:
            raise bad_request(
                f"data[{i}].loss_fn_inputs.weights: shape {list(weights.shape)} differs from "
                f"target_tokens {list(targets.shape)}",
                f"data[{i}].loss_fn_inputs.weights",
            )
        inputs["target_tokens"] = targets
        examples.append(Example(tokens, inputs))
    return ForwardBackwardWork(
        adapter_id, tuple(examples), request.loss_fn, config, request.forward_only
    )


def sample_work(request: SampleRequest, spec: ModelSpec, sampler_id: str) -> SampleWork:
    prompt = tokens_of(request.prompt, spec, "prompt")
    params = request.sampling_params
    for name in ("prompt_alt_tokens_k", "prompt_logprobs_last_n", "target_prompt_logprobs"):
        if getattr(request, name):
            raise bad_request(f"{name}: not supported by this server", name)
    room = spec.max_context_length - prompt.size
    max_tokens = params.max_tokens if params.max_tokens is not None else room
    if max_tokens < 1:
        raise bad_request("sampling_params.max_tokens: must be >= 1", "sampling_params.max_tokens")
    if max_tokens > room:
        raise bad_request(
            f"sampling_params.max_tokens: prompt ({prompt.size}) + max_tokens ({max_tokens}) "
            f"exceeds the context length {spec.max_context_length}",
            "sampling_params.max_tokens",
        )
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise bad_request(
            "sampling_params.temperature: must be >= 0", "sampling_params.temperature"
        )
    if not (0 < params.top_p <= 1):
        raise bad_request("sampling_params.top_p: must be in (0, 1]", "sampling_params.top_p")
    if params.top_k == 0 or params.top_k < -1:
        raise bad_request(
            "sampling_params.top_k: must be -1 (no limit) or >= 1", "sampling_params.top_k"
        )
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    if params.stop is None:
        stop_ids = (spec.eos_token_id,)
    elif isinstance(params.stop, str):
        stop_strings = (params.stop,)
    elif all(isinstance(s, int) for s in params.stop):
        stop_ids = tuple(int(s) for s in params.stop)
        if any(not 0 <= s < spec.vocab_size for s in stop_ids):
            raise bad_request(
                "sampling_params.stop: token id outside the vocabulary", "sampling_params.stop"
            )
    else:
        stop_strings = tuple(str(s) for s in params.stop)
        if any(not s for s in stop_strings):
            raise bad_request("sampling_params.stop: empty stop string", "sampling_params.stop")
    return SampleWork(
        sampler_id=sampler_id,
        prompt=prompt,
        num_samples=request.num_samples,
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_k=-1 if params.top_k >= spec.vocab_size else params.top_k,  # k >= V: no limit
        top_p=params.top_p,
        seed=params.seed,
        stop_token_ids=stop_ids,
        stop_strings=stop_strings,
        prompt_logprobs=bool(request.prompt_logprobs),
        topk_prompt_logprobs=request.topk_prompt_logprobs,
        topk_sample_logprobs=request.topk_sample_logprobs,
    )


__all__ = [
    "ApiError",
    "adam_step",
    "decode_limits",
    "forward_backward_work",
    "sample_work",
    "tokens_of",
]


# AdamW's hyperparameters, each finite and within what a step can take without overflowing:
# a learning rate of 1e308 (or Infinity) would make the adapter non-finite in one step. The
# engine also skips any step that would still come out non-finite (engine/optim.py).
ADAM_LIMITS: dict[str, tuple[float, float, bool]] = {
    # field: (lowest, highest, highest included)
    "learning_rate": (0.0, 1.0, True),
    "beta1": (0.0, 1.0, False),
    "beta2": (0.0, 1.0, False),
    "eps": (1e-30, 1.0, True),
    "weight_decay": (0.0, 1.0, True),
    "grad_clip_norm": (0.0, 1e6, True),  # 0 = no clipping
}


def adam_step(request: OptimStepRequest) -> AdamStep:
    """The engine's `AdamStep` of an optim_step request; a 400 names a value out of range."""
    name = next(
        (n for n in ("adam_params", "optimizer_params", "optim_params") if getattr(request, n)),
        "adam_params",
    )
    params = request.params
    for key, (low, high, high_ok) in ADAM_LIMITS.items():
        value = float(getattr(params, key))
        inside = (
            math.isfinite(value) and low <= value and (value <= high if high_ok else value < high)
        )
        if not inside:
            bound = f"<= {high:g}" if high_ok else f"< {high:g}"
            raise bad_request(
                f"{name}.{key}: {value!r} is out of range: must be finite, >= {low:g} and {bound}",
                f"{name}.{key}",
            )
    return AdamStep(
        params.learning_rate,
        params.beta1,
        params.beta2,
        params.eps,
        params.weight_decay,
        params.grad_clip_norm,
    )
