"""TrainingClient: one LoRA model on the server, driven in strict seq_id order.

Ordering: every request gets its seq_id(s) when the method is called (1, 2, 3, ...; the creating
request is 0), and its HTTP submission goes out only after the previous submission on this client
has returned a request_id. Waiting for results happens outside that turn-taking, so
`fb = tc.forward_backward(...); opt = tc.optim_step(...)` pipelines both on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from tuneloop._futures import APIFuture, ClientHolder, parse_json_model
from tuneloop._http import PROTOBUF
from tuneloop._tokenizer import get_tokenizer
from tuneloop.errors import TuneloopError
from tuneloop.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    GetInfoRequest,
    GetInfoResponse,
    LoadWeightsRequest,
    LoadWeightsResponse,
    OptimStepRequest,
    OptimStepResponse,
    SaveWeightsExternalRequest,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerRequest,
    SaveWeightsForSamplerResponse,
    SaveWeightsRequest,
    SaveWeightsResponse,
    TensorData,
    UntypedFuture,
)
from tuneloop.types._base import StrictBase
from tuneloop.types.codec import (
    ForwardBackwardRequest,
    decode_forward_backward_output,
    encode_forward_backward_request,
)

if TYPE_CHECKING:
    import torch

    from tuneloop.sampling_client import SamplingClient

__all__ = ["CustomLossFn", "TrainingClient", "combine_fwdbwd_outputs", "open_training_client"]

T = TypeVar("T")
# (data, per-datum logprobs tensors with requires_grad) -> (scalar loss tensor, metrics)
CustomLossFn = Callable[
    [list[Datum], list["torch.Tensor"]], tuple["torch.Tensor", dict[str, float]]
]


class _Turns:
    """Lets submissions go out strictly in seq_id order, whatever order their tasks run in."""

    def __init__(self, first_seq_id: int) -> None:
        self._next = first_seq_id
        self._cond: asyncio.Condition | None = None  # made on the loop, at first use

    @contextlib.asynccontextmanager
    async def turn(self, first_seq_id: int, count: int) -> AsyncIterator[None]:
        if self._cond is None:
            self._cond = asyncio.Condition()
        cond = self._cond
        async with cond:
            await cond.wait_for(lambda: self._next == first_seq_id)
        try:
            yield
        finally:
            # Advance even on failure, or every later request would wait forever.
            async with cond:
                self._next = first_seq_id + count
                cond.notify_all()


def combine_fwdbwd_outputs(
    outputs: Sequence[ForwardBackwardOutput], chunk_sizes: Sequence[int]
) -> ForwardBackwardOutput:
    """Merge per-chunk results: outputs concatenated, metrics reduced by their name suffix.

    `sum` adds, `mean` is weighted by datums per chunk, `min`/`max` as named, `slack` is
    max - weighted mean, `hash2` a 64-bit sum, `unique` keeps each chunk's value (key, key_2, ...).
    A key with no or an unknown suffix keeps the first chunk's value.
    """
    if len(outputs) == 1:
        return outputs[0]
    merged_outputs = [record for out in outputs for record in out.loss_fn_outputs]
    keys = list(dict.fromkeys(key for out in outputs for key in out.metrics))
    metrics: dict[str, float] = {}
    for key in keys:
        pairs = [
            (o.metrics[key], n)
            for o, n in zip(outputs, chunk_sizes, strict=True)
            if key in o.metrics
        ]
        values = [v for v, _ in pairs]
        weighted_mean = sum(v * n for v, n in pairs) / max(sum(n for _, n in pairs), 1)
        reduction = key.rsplit(":", 1)[1] if ":" in key else ""
        if reduction == "sum":
            metrics[key] = float(sum(values))
        elif reduction == "mean":
            metrics[key] = float(weighted_mean)
        elif reduction == "min":
            metrics[key] = float(min(values))
        elif reduction == "max":
            metrics[key] = float(max(values))
        elif reduction == "slack":
            metrics[key] = float(max(values) - weighted_mean)
        elif reduction == "hash2":
            metrics[key] = float(sum(int(v) for v in values) % 2**64)
        elif reduction == "unique":
            metrics[key] = values[0]
            for i, value in enumerate(values[1:], start=2):
                metrics[f"{key}_{i}"] = value
        else:
            metrics[key] = values[0]
    return ForwardBackwardOutput(
        loss_fn_output_type=outputs[0].loss_fn_output_type,
        loss_fn_outputs=merged_outputs,
        metrics=metrics,
    )


def _body(request: StrictBase) -> dict[str, Any]:
    return request.model_dump(mode="json", exclude_none=True)


class TrainingClient:
    """A trainable LoRA model. Made by `ServiceClient`; `model_id` names it on the server.

    Every call that does GPU work returns an `APIFuture` at once.
    """

    def __init__(
        self,
        holder: ClientHolder,
        model_id: str,
        info: GetInfoResponse,
        *,
        base_model: str | None = None,
    ) -> None:
        self.model_id = model_id
        self._holder = holder
        self._info = info
        self._base_model = base_model or info.model_data.model_name or info.model_name
        self._seq_lock = threading.Lock()
        self._next_seq_id = 1  # 0 was the request that created the model
        self._turns = _Turns(first_seq_id=1)
        self._poisoned: BaseException | None = None

    def __repr__(self) -> str:
        return f"TrainingClient(model_id={self.model_id!r})"

    # ---- plumbing ------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._poisoned is not None:
            raise TuneloopError(
                f"TrainingClient {self.model_id} is unusable: an earlier "
                f"forward_backward_custom failed ({self._poisoned!r}); create a new client"
            )

    def _reserve(self, count: int) -> int:
        """Take `count` consecutive seq_ids; returns the first."""
        self._check_usable()
        with self._seq_lock:
            first = self._next_seq_id
            self._next_seq_id += count
            return first

    def _chunks(self, data: list[Datum]) -> list[list[Datum]]:
        if not data:
            raise ValueError("data must hold at least one Datum")
        size = max(1, self._holder.config.fwdbwd_max_chunk_len)
        return [data[i : i + size] for i in range(0, len(data), size)]

    async def _skip_turn(self, first_seq_id: int, count: int) -> None:
        """Give up seq_ids that will never be sent, so later requests are not stuck behind them."""
        async with self._turns.turn(first_seq_id, count):
            pass

    async def _post_future(
        self, path: str, *, json_body: Any = None, content: bytes | None = None
    ) -> UntypedFuture:
        # Transient failures are retried with the same body, so the same seq_id: the server
        # deduplicates training submissions on (model_id, seq_id).
        response = await self._holder.http.request(
            "POST",
            path,
            json_body=json_body,
            content=content,
            content_type=PROTOBUF if content is not None else "application/json",
        )
        return parse_json_model(response, UntypedFuture)

    def _json_op(
        self,
        path: str,
        build: Callable[[int], StrictBase],
        decode: Callable[[Any], T],
        request_type: str,
    ) -> APIFuture[T]:
        self._check_usable()
        with self._seq_lock:
            seq_id = self._next_seq_id
            body = _body(build(seq_id))  # validates before the seq_id is spent
            self._next_seq_id += 1
        return self._holder.submit(self._run_json_op(seq_id, path, body, decode, request_type))

    async def _run_json_op(
        self,
        seq_id: int,
        path: str,
        body: dict[str, Any],
        decode: Callable[[Any], T],
        request_type: str,
    ) -> T:
        async with self._turns.turn(seq_id, 1):
            self._check_usable()
            future = await self._post_future(path, json_body=body)
        return await self._holder.retrieve(
            future.request_id, decode_json=decode, request_type=request_type
        )

    async def _run_fwdbwd(
        self,
        first_seq_id: int,
        chunks: list[list[Datum]],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None,
        forward_only: bool,
    ) -> ForwardBackwardOutput:
        try:
            bodies = [
                encode_forward_backward_request(
                    ForwardBackwardRequest(
                        model_id=self.model_id,
                        seq_id=first_seq_id + i,
                        data=chunk,
                        loss_fn=loss_fn,
                        loss_fn_config=dict(loss_fn_config or {}),
                        forward_only=forward_only,
                    )
                )
                for i, chunk in enumerate(chunks)
            ]
        except Exception:
            await self._skip_turn(first_seq_id, len(chunks))
            raise
        async with self._turns.turn(first_seq_id, len(chunks)):
            self._check_usable()
            request_ids = [
                (await self._post_future("/api/v1/forward_backward", content=body)).request_id
                for body in bodies
            ]
        request_type = "Forward" if forward_only else "ForwardBackward"
        outputs = await asyncio.gather(
            *(
                self._holder.retrieve(
                    rid, decode_proto=decode_forward_backward_output, request_type=request_type
                )
                for rid in request_ids
            )
        )
        return combine_fwdbwd_outputs(outputs, [len(c) for c in chunks])

    # ---- forward / backward --------------------------------------------------------------------

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """The loss and per-token logprobs, without gradients (forward_only=true)."""
        return self._fwdbwd(data, loss_fn, loss_fn_config, forward_only=True)

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Compute the loss and accumulate its gradient until the next `optim_step`.

        Large batches go as several requests of at most the server's `fwdbwd_max_chunk_len`
        datums; their outputs are concatenated and their metrics merged by suffix.
        """
        return self._fwdbwd(data, loss_fn, loss_fn_config, forward_only=False)

    def _fwdbwd(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None,
        *,
        forward_only: bool,
    ) -> APIFuture[ForwardBackwardOutput]:
        chunks = self._chunks(list(data))
        first = self._reserve(len(chunks))
        return self._holder.submit(
            self._run_fwdbwd(first, chunks, loss_fn, loss_fn_config, forward_only)
        )

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        """Train on any differentiable function of the per-token logprobs (needs torch).

        1. A forward-only cross_entropy pass returns each datum's logprobs (only target_tokens
           and weights leave the client; other loss_fn_inputs stay here for `loss_fn`).
        2. `loss_fn(data, logprobs)` runs here on tensors with requires_grad; its gradient
           g = dloss/dlogprobs is taken with torch.
        3. A cross_entropy forward_backward with weights = -g has the same gradient as `loss_fn`.

        The result's metrics are the user's, plus `loss:sum` = the custom loss and
        `surrogate_loss:sum` = the second pass's cross-entropy sum. If this fails before the
        second pass is sent, the client refuses later calls (the server would wait forever for
        the missing seq_ids).
        """
        data = list(data)
        for i, datum in enumerate(data):
            if "target_tokens" not in datum.loss_fn_inputs:
                raise ValueError(f"data[{i}]: forward_backward_custom needs target_tokens")
        n_chunks = len(self._chunks(data))
        first = self._reserve(2 * n_chunks)
        return self._holder.submit(self._run_custom(first, n_chunks, data, loss_fn))

    async def _run_custom(
        self, first: int, n_chunks: int, data: list[Datum], loss_fn: CustomLossFn
    ) -> ForwardBackwardOutput:
        second = first + n_chunks
        first_turn_used = False
        try:
            probe = [_ce_datum(d, d.loss_fn_inputs.get("weights")) for d in data]
            first_turn_used = True  # _run_fwdbwd takes its turn even when it fails
            forward = await self._run_fwdbwd(
                first, self._chunks(probe), "cross_entropy", None, forward_only=True
            )
            loss_value, user_metrics, weights = await asyncio.to_thread(
                _custom_loss_weights, data, forward, loss_fn
            )
            surrogate = [
                _ce_datum(d, TensorData.from_numpy(w)) for d, w in zip(data, weights, strict=True)
            ]
        except Exception as exc:
            self._poisoned = exc
            # Let queued requests see the poison instead of waiting for these seq_ids.
            if not first_turn_used:
                await self._skip_turn(first, n_chunks)
            await self._skip_turn(second, n_chunks)
            raise
        out = await self._run_fwdbwd(
            second, self._chunks(surrogate), "cross_entropy", None, forward_only=False
        )
        metrics = dict(out.metrics)
        metrics["surrogate_loss:sum"] = metrics.pop("loss:sum", 0.0)
        metrics.update(user_metrics)
        metrics["loss:sum"] = loss_value
        return ForwardBackwardOutput(
            loss_fn_output_type=out.loss_fn_output_type,
            loss_fn_outputs=out.loss_fn_outputs,
            metrics=metrics,
        )

    # ---- optimizer and checkpoints -------------------------------------------------------------

    def optim_step(self, adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        """Apply the accumulated gradients with AdamW and clear them."""
        params = adam_params or AdamParams()
        return self._json_op(
            "/api/v1/optim_step",
            lambda seq: OptimStepRequest(model_id=self.model_id, seq_id=seq, adam_params=params),
            OptimStepResponse.model_validate,
            "OptimStep",
        )

    def save_state(
        self, name: str, ttl_seconds: int | None = None
    ) -> APIFuture[SaveWeightsResponse]:
        """Save weights and optimizer state as `tinker://<model_id>/weights/<name>`."""
        return self._json_op(
            "/api/v1/save_weights",
            lambda seq: SaveWeightsRequest(
                model_id=self.model_id, path=name, seq_id=seq, ttl_seconds=ttl_seconds
            ),
            SaveWeightsResponse.model_validate,
            "SaveWeights",
        )

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Load weights from a `tinker://` checkpoint into this model; the optimizer restarts."""
        return self._load(path, optimizer=False)

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Load weights and optimizer state from a `tinker://` checkpoint into this model."""
        return self._load(path, optimizer=True)

    def _load(self, path: str, *, optimizer: bool) -> APIFuture[LoadWeightsResponse]:
        return self._json_op(
            "/api/v1/load_weights",
            lambda seq: LoadWeightsRequest(
                model_id=self.model_id, seq_id=seq, path=path, optimizer=optimizer
            ),
            LoadWeightsResponse.model_validate,
            "LoadWeights",
        )

    def save_weights_for_sampler(
        self, name: str, ttl_seconds: int | None = None
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Save sampler weights as `tinker://<model_id>/sampler_weights/<name>`."""
        return self._json_op(
            "/api/v1/save_weights_for_sampler",
            lambda seq: SaveWeightsForSamplerRequest(
                model_id=self.model_id, path=name, seq_id=seq, ttl_seconds=ttl_seconds
            ),
            SaveWeightsForSamplerResponse.model_validate,
            "SaveWeightsForSampler",
        )

    def save_weights_external(
        self, name: str, ttl_seconds: int | None = None
    ) -> APIFuture[SaveWeightsExternalResponse]:
        """Export the adapter for download as `tinker://<model_id>/external_weights/<name>`:
        the PEFT layout (`adapter_model.safetensors`, `adapter_config.json`), no optimizer
        state. Fetch it with `RestClient.download_checkpoint` (or its signed URLs with
        `RestClient.get_external_weights_urls`). `ttl_seconds`: an hour to ten years, or None.
        """
        return self._json_op(
            "/api/v1/save_weights_external",
            lambda seq: SaveWeightsExternalRequest(
                model_id=self.model_id, path=name, seq_id=seq, ttl_seconds=ttl_seconds
            ),
            SaveWeightsExternalResponse.model_validate,
            "SaveWeightsExternal",
        )

    async def save_weights_external_async(
        self, name: str, ttl_seconds: int | None = None
    ) -> SaveWeightsExternalResponse:
        return await self.save_weights_external(name, ttl_seconds)

    def save_weights_and_get_sampling_client(
        self, *, record_stability_info: bool = False
    ) -> SamplingClient:
        """Snapshot the current weights (no named checkpoint) and return a client sampling them.

        Blocks until the snapshot exists; `save_weights_and_get_sampling_client_async` awaits.
        `record_stability_info`: its samples can train with `stable_reinforce` (see
        `SamplingClient`).
        """
        return self._snapshot(record_stability_info).result()

    async def save_weights_and_get_sampling_client_async(
        self, *, record_stability_info: bool = False
    ) -> SamplingClient:
        return await self._snapshot(record_stability_info)

    def _snapshot(self, record_stability_info: bool) -> APIFuture[SamplingClient]:
        sampling_seq = self._holder.next_sampling_session_seq_id()
        future = self._json_op(
            "/api/v1/save_weights_for_sampler",
            lambda seq: SaveWeightsForSamplerRequest(
                model_id=self.model_id, seq_id=seq, sampling_session_seq_id=sampling_seq
            ),
            SaveWeightsForSamplerResponse.model_validate,
            "SaveWeightsForSampler",
        )
        return self._holder.submit(self._sampling_client_from(future, record_stability_info))

    async def _sampling_client_from(
        self, saved: APIFuture[SaveWeightsForSamplerResponse], record_stability_info: bool
    ) -> SamplingClient:
        from tuneloop.sampling_client import SamplingClient

        response = await saved
        if not response.sampling_session_id:
            raise TuneloopError("save_weights_for_sampler returned no sampling_session_id")
        return SamplingClient(
            self._holder,
            response.sampling_session_id,
            self._base_model,
            record_stability_info=record_stability_info,
        )

    def create_sampling_client(
        self, model_path: str, *, record_stability_info: bool = False
    ) -> SamplingClient:
        """A SamplingClient for a `tinker://.../sampler_weights/...` path (blocks)."""
        from tuneloop.sampling_client import create_sampling_client

        return create_sampling_client(
            self._holder,
            model_path,
            self._base_model,
            record_stability_info=record_stability_info,
        )

    # ---- info ----------------------------------------------------------------------------------

    def get_info(self) -> GetInfoResponse:
        """The model's info, fetched once when the client was created."""
        return self._info

    def get_base_model(self) -> str | None:
        return self._base_model

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer, fetched from the server once and cached on disk."""
        if not self._base_model:
            raise TuneloopError(f"the server did not name the base model of {self.model_id}")
        return get_tokenizer(self._holder, self._base_model)


async def open_training_client(
    holder: ClientHolder, model_id: str, base_model: str | None = None
) -> TrainingClient:
    """Fetch the model's info (get_info) and wrap it in a TrainingClient."""
    response = await holder.http.request(
        "POST", "/api/v1/get_info", json_body=_body(GetInfoRequest(model_id=model_id))
    )
    info = parse_json_model(response, GetInfoResponse)
    return TrainingClient(holder, model_id, info, base_model=base_model)


def _ce_datum(datum: Datum, weights: TensorData | None) -> Datum:
    """The datum with only target_tokens and weights (zeros when absent) as loss inputs."""
    targets = datum.loss_fn_inputs["target_tokens"]
    if weights is None:
        shape = targets.to_numpy().shape
        weights = TensorData.from_numpy(np.zeros(shape, dtype=np.float32))
    return Datum(
        model_input=datum.model_input,
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )


def _custom_loss_weights(
    data: list[Datum], forward: ForwardBackwardOutput, loss_fn: CustomLossFn
) -> tuple[float, dict[str, float], list[np.ndarray]]:
    """Run the user's loss on torch logprobs; return (loss, metrics, -dloss/dlogprobs per datum)."""
    try:
        import torch
    except ImportError as exc:
        raise TuneloopError("forward_backward_custom needs torch: pip install torch") from exc

    logprobs = [
        torch.tensor(np.array(out["logprobs"].to_numpy(), dtype=np.float32), requires_grad=True)
        for out in forward.loss_fn_outputs
    ]
    if len(logprobs) != len(data):
        raise TuneloopError(
            f"forward pass returned {len(logprobs)} logprob arrays for {len(data)} datums"
        )
    loss, metrics = loss_fn(data, logprobs)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError("the custom loss function must return a scalar torch.Tensor as its loss")
    loss.backward()
    weights = [
        (-lp.grad).numpy().astype(np.float32)
        if lp.grad is not None
        else np.zeros(tuple(lp.shape), dtype=np.float32)
        for lp in logprobs
    ]
    user_metrics = {
        k: float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
        for k, v in dict(metrics).items()
    }
    return float(loss.detach()), user_metrics, weights
