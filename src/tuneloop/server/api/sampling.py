"""Sampling routes: sampling sessions (samplers) and asample."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from tuneloop.server.api.deps import State, Tenant, json_body, read_json
from tuneloop.server.api.errors import ApiError, bad_request, not_found
from tuneloop.server.api.futures_feed import CLONE_STRIDE
from tuneloop.server.api.restarts import require_held
from tuneloop.server.api.state import fingerprint
from tuneloop.server.api.validation import sample_work
from tuneloop.server.engine.types import SampleResult
from tuneloop.server.scheduler.futures import Outcome
from tuneloop.server.scheduler.queue import Operation
from tuneloop.server.storage.registry import SamplerRow
from tuneloop.types import (
    CreateSamplingSessionRequest,
    GetSamplerResponse,
    SampledSequence,
    SampleRequest,
    SampleResponse,
)
from tuneloop.types.codec import encode_sample_response

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session", openapi_extra=json_body(CreateSamplingSessionRequest))
async def create_sampling_session(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, _ = await read_json(request, CreateSamplingSessionRequest)
    state.live_session(body.session_id, tenant)
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    existing = state.registry.sampler(sampler_id, tenant)
    weights_dir: Path | None = None
    if body.model_path is not None:
        # The caller's checkpoint, or one another tenant published.
        _path, ckpt, run = state.readable_checkpoint(tenant, body.model_path, "model_path")
        if ckpt.checkpoint_type not in ("training", "sampler"):  # a merged export: no adapter
            raise bad_request(f"model_path: a {ckpt.kind} package holds no adapter", "model_path")
        if body.base_model is not None and body.base_model != run.base_model:
            raise bad_request(
                f"base_model: {body.model_path} was trained on {run.base_model!r}", "base_model"
            )
        base_model = run.base_model
        weights_dir = Path(ckpt.directory)
    else:
        assert body.base_model is not None
        base_model = body.base_model
    state.model_spec(base_model)
    if existing is not None:
        if existing.model_path != body.model_path or existing.base_model != base_model:
            raise ApiError(
                409,
                f"sampling_session_seq_id {body.sampling_session_seq_id} is "
                "already used in this session",
                "sampling_session_seq_id",
            )
        return {"sampling_session_id": sampler_id}
    await state.engine.call(
        state.engine.backend.create_sampler, sampler_id, base_model, weights_dir=weights_dir
    )
    state.registry.add(
        SamplerRow(
            id=sampler_id,
            tenant=tenant,
            session_id=body.session_id,
            base_model=base_model,
            model_path=body.model_path,
        )
    )
    return {"sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, state: State, tenant: Tenant) -> dict[str, Any]:
    row = state.registry.sampler(sampler_id, tenant)
    if row is None:
        raise not_found(f"sampler {sampler_id!r}", "sampler_id")
    return GetSamplerResponse(
        sampler_id=row.id, base_model=row.base_model, model_path=row.model_path
    ).model_dump()


def _sample_outcome(result: SampleResult) -> Outcome:
    response = SampleResponse(
        sequences=[
            SampledSequence(
                stop_reason=s.stop_reason,
                tokens=s.tokens,
                logprobs=s.logprobs,
                topk_logprobs=s.topk,
            )
            for s in result.sequences
        ],
        prompt_logprobs=result.prompt_logprobs,
        topk_prompt_logprobs=result.topk_prompt_logprobs,
    )
    return Outcome(encode_sample_response(response), "application/x-protobuf")


@router.post("/asample", openapi_extra=json_body(SampleRequest))
async def asample(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, raw = await read_json(request, SampleRequest)
    if body.sampling_session_id is None:
        raise bad_request("sampling_session_id: required", "sampling_session_id")
    sampler = state.registry.sampler(body.sampling_session_id, tenant)
    if sampler is None:
        raise not_found(f"sampler {body.sampling_session_id!r}", "sampling_session_id")
    state.live_session(sampler.session_id, tenant)
    require_held(
        sampler.created_at,
        state.futures.started_at,
        f"sampler {sampler.id!r}",
        "sampling_session_id",
        "create a new sampling client (from a saved checkpoint or the base model)",
    )
    work = sample_work(body, state.model_spec(sampler.base_model), sampler.id)
    digest = fingerprint(raw)
    key = (sampler.id, body.seq_id) if body.seq_id is not None else None
    if key is not None and key in state.sample_submissions:
        seen_digest, request_id, sequence_ids = state.sample_submissions[key]
        if seen_digest == digest:
            return {"request_id": request_id, "sample_sequence_ids": sequence_ids}
    state.quotas.check_inflight(tenant)
    request_id = state.futures.create(tenant, "Sample")
    sequence_ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
    if key is not None:
        state.sample_submissions[key] = (digest, request_id, sequence_ids)
    # The official SDK's clones number their seq_ids from CLONE_STRIDE * clone id.
    state.feeds.watch(request_id, sampler.id, (body.seq_id or 0) // CLONE_STRIDE)
    state.traces.submitted(request_id, sampler.session_id, "Sample", sampler.id, body.seq_id)
    state.queue.submit_sample(Operation(request_id, "sample", work, _sample_outcome))
    state.engine.notify("sample")
    return {"request_id": request_id, "sample_sequence_ids": sequence_ids}
