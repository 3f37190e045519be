"""SamplingClient: generate from a base model or a saved LoRA snapshot.

Sampling requests are not ordered against each other: each `sample` call is submitted and polled
concurrently. Each carries a seq_id (0, 1, 2, ... per client) so the server can deduplicate
retried submissions.
"""

from __future__ import annotations

import threading
import urllib.parse
from typing import Any

from tuneloop._futures import APIFuture, ClientHolder, parse_json_model
from tuneloop._tokenizer import get_tokenizer
from tuneloop.errors import APIResponseValidationError
from tuneloop.types import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    ModelInput,
    SampleRequest,
    SampleResponse,
    SamplingParams,
    UntypedFuture,
)
from tuneloop.types.codec import decode_sample_response

__all__ = ["SamplingClient", "create_sampling_client", "start_sampling_client"]


class SamplingClient:
    """Samples from one sampling session. Made by `ServiceClient.create_sampling_client` or
    `TrainingClient.save_weights_and_get_sampling_client`.

    Made with `record_stability_info=True` (as in the official SDK, a property of the client),
    every sample asks the server to keep what it drew per `sequence_id`, so datums built from
    the sequences (`Datum.with_provenance`) can train with the `stable_reinforce` loss.
    """

    def __init__(
        self,
        holder: ClientHolder,
        sampling_session_id: str,
        base_model: str | None,
        *,
        record_stability_info: bool = False,
    ):
        self.sampling_session_id = sampling_session_id
        self._holder = holder
        self._base_model = base_model
        self._record_stability_info = record_stability_info
        self._seq_lock = threading.Lock()
        self._next_seq_id = 0

    def __repr__(self) -> str:
        return f"SamplingClient(sampling_session_id={self.sampling_session_id!r})"

    @property
    def record_stability_info(self) -> bool:
        """Whether this client's samples are recorded for `stable_reinforce`."""
        return self._record_stability_info

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> APIFuture[SampleResponse]:
        """Draw `num_samples` continuations of `prompt`.

        Each returned sequence has tokens, per-token logprobs and a `sequence_id` (what
        provenance spans name; the server keeps the sample for `stable_reinforce` only when the
        client records stability info). With
        `include_prompt_logprobs`, the response's `prompt_logprobs` scores the prompt (entry 0 is
        None); `topk_prompt_logprobs=k` adds the top k alternatives per prompt position.
        """
        body = self._request_body(
            prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs
        )
        return self._holder.submit(self._run_sample(body))

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """Logprob of each prompt token given the ones before it; entry 0 is None."""
        body = self._request_body(prompt, 1, SamplingParams(max_tokens=1), True, 0)
        return self._holder.submit(self._run_logprobs(body))

    def _request_body(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: SamplingParams,
        include_prompt_logprobs: bool,
        topk_prompt_logprobs: int,
    ) -> dict[str, Any]:
        with self._seq_lock:
            request = SampleRequest(
                num_samples=num_samples,
                prompt=prompt,
                sampling_params=sampling_params,
                sampling_session_id=self.sampling_session_id,
                seq_id=self._next_seq_id,
                prompt_logprobs=include_prompt_logprobs,
                topk_prompt_logprobs=topk_prompt_logprobs,
                record_stability_info=self._record_stability_info,
            )
            self._next_seq_id += 1
        return request.model_dump(mode="json", exclude_none=True)

    async def _run_sample(self, body: dict[str, Any]) -> SampleResponse:
        # 429 on asample is backpressure: the transport backs off and resubmits the same seq_id.
        response = await self._holder.http.request(
            "POST",
            "/api/v1/asample",
            json_body=body,
            headers={"X-Tinker-Sampling-Backpressure": "1"},
        )
        future = parse_json_model(response, UntypedFuture)
        result = await self._holder.retrieve(
            future.request_id, decode_proto=decode_sample_response, request_type="Sample"
        )
        ids = future.sample_sequence_ids or []
        if ids and len(ids) == len(result.sequences):
            for sequence, sequence_id in zip(result.sequences, ids, strict=True):
                sequence.sequence_id = sequence_id
        return result

    async def _run_logprobs(self, body: dict[str, Any]) -> list[float | None]:
        result = await self._run_sample(body)
        if result.prompt_logprobs is None:
            raise APIResponseValidationError("the server returned no prompt_logprobs")
        return result.prompt_logprobs

    def get_base_model(self) -> str | None:
        return self._base_model

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer, fetched from the server once and cached on disk."""
        if not self._base_model:
            raise APIResponseValidationError("the base model of this sampler is unknown")
        return get_tokenizer(self._holder, self._base_model)


def check_sampler_args(model_path: str | None, base_model: str | None) -> None:
    if model_path is None and base_model is None:
        raise ValueError("pass model_path or base_model")
    if model_path is not None and not model_path.startswith("tinker://"):
        raise ValueError(f"model_path must start with tinker://, got {model_path!r}")


def _session_request(
    holder: ClientHolder, model_path: str | None, base_model: str | None
) -> CreateSamplingSessionRequest:
    # Takes the session-wide sampling_session_seq_id at call time.
    check_sampler_args(model_path, base_model)
    return CreateSamplingSessionRequest(
        session_id=holder.require_session(),
        sampling_session_seq_id=holder.next_sampling_session_seq_id(),
        base_model=base_model,
        model_path=model_path,
    )


async def _open_sampling_session(
    holder: ClientHolder, request: CreateSamplingSessionRequest, record_stability_info: bool
) -> SamplingClient:
    """create_sampling_session, then (for a model_path alone) GET the sampler's base model."""
    response = await holder.http.request(
        "POST",
        "/api/v1/create_sampling_session",
        json_body=request.model_dump(mode="json", exclude_none=True),
    )
    session_id = parse_json_model(response, CreateSamplingSessionResponse).sampling_session_id
    base_model = request.base_model
    if base_model is None:
        quoted = urllib.parse.quote(session_id, safe=":")
        sampler = await holder.http.request("GET", f"/api/v1/samplers/{quoted}")
        base_model = parse_json_model(sampler, GetSamplerResponse).base_model
    return SamplingClient(
        holder, session_id, base_model, record_stability_info=record_stability_info
    )


def start_sampling_client(
    holder: ClientHolder,
    model_path: str | None,
    base_model: str | None,
    *,
    record_stability_info: bool = False,
) -> APIFuture[SamplingClient]:
    """Validate and schedule the creation of a SamplingClient; returns at once."""
    request = _session_request(holder, model_path, base_model)
    return holder.submit(_open_sampling_session(holder, request, record_stability_info))


def create_sampling_client(
    holder: ClientHolder,
    model_path: str | None,
    base_model: str | None,
    *,
    record_stability_info: bool = False,
) -> SamplingClient:
    return start_sampling_client(
        holder, model_path, base_model, record_stability_info=record_stability_info
    ).result()
