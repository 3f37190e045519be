"""Sampling routes: sampling sessions (samplers) and asample."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from tuneloop.server.api.deps import State, Tenant, json_body, read_json
from tuneloop.server.api.errors import ApiError, bad_request, not_found
from tuneloop.server.api.futures_feed import CLONE_STRIDE
from tuneloop.server.api.restarts import require_held
from tuneloop.server.api.stability import StabilityRecords
from tuneloop.server.api.state import ServerState, fingerprint
from tuneloop.server.api.taken_ids import insert_new
from tuneloop.server.api.validation import sample_work
from tuneloop.server.engine.operations import CreateSampler, DeleteSampler
from tuneloop.server.engine.types import EngineError, SampleResult
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
    await state.live_session(body.session_id, tenant)
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    existing = await state.db(state.registry.sampler, sampler_id, tenant)
    weights_dir: Path | None = None
    if body.model_path is not None:
        # The caller's checkpoint, or one another tenant published.
        _path, ckpt, run = await state.readable_checkpoint(tenant, body.model_path, "model_path")
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
    field = "sampling_session_seq_id"
    if existing is not None:
        if existing.model_path != body.model_path or existing.base_model != base_model:
            raise ApiError(
                409,
                f"sampling_session_seq_id {body.sampling_session_seq_id} is "
                "already used in this session",
                field,
            )
        require_held(
            existing.created_at,
            state.futures.started_at,
            f"sampler {sampler_id!r}",
            field,
            "create it with a new sampling_session_seq_id",
        )
        return {"sampling_session_id": sampler_id}
    if sampler_id in state.pending_samplers:
        raise ApiError(
            409,
            f"sampling_session_seq_id {body.sampling_session_seq_id}: sampler {sampler_id!r} "
            "is being created by another request",
            field,
        )
    if weights_dir is not None and not weights_dir.is_dir():
        raise _checkpoint_gone(body.model_path)
    state.pending_samplers.add(sampler_id)
    try:
        await _create_sampler(state, tenant, sampler_id, base_model, body.model_path, weights_dir)
        row = SamplerRow(
            id=sampler_id,
            tenant=tenant,
            session_id=body.session_id,
            base_model=base_model,
            model_path=body.model_path,
        )
        if await insert_new(state, row) is not None:  # taken meanwhile (the checks above saw none)
            raise ApiError(409, f"sampler {sampler_id!r} already exists", field)
    finally:
        state.pending_samplers.discard(sampler_id)
    return {"sampling_session_id": sampler_id}


def _checkpoint_gone(model_path: str | None, reason: str = "") -> ApiError:
    return ApiError(
        410,
        f"model_path: the files of checkpoint {model_path!r} are gone (deleted or expired)"
        + reason,
        "model_path",
    )


async def _create_sampler(
    state: ServerState,
    tenant: str,
    sampler_id: str,
    base_model: str,
    model_path: str | None,
    weights_dir: Path | None,
) -> None:
    """Create the engine's sampler. A checkpoint deleted meanwhile (its row or its files) is
    the caller's 404 or 410, not the engine's error; no sampler is left behind then."""
    try:
        await state.engine.perform(CreateSampler(sampler_id, base_model, weights_dir=weights_dir))
    except (OSError, ValueError, EngineError) as exc:
        if model_path is None:
            raise
        if not await _still_readable(state, tenant, model_path):
            raise not_found(f"checkpoint {model_path!r}", "model_path") from None
        if isinstance(exc, EngineError) and exc.category == "user":
            # Its weights are there but unusable (e.g. non-finite): the caller's error.
            raise bad_request(f"model_path: {exc}", "model_path") from None
        # The row remains but its files are gone or cut short (removed by hand, a full disk).
        raise _checkpoint_gone(model_path, f": {exc}") from None
    if model_path is not None and not await _still_readable(state, tenant, model_path):
        # Deleted while its weights were read: do not hand out a sampler of a deleted checkpoint.
        await state.engine.perform(DeleteSampler(sampler_id))
        raise not_found(f"checkpoint {model_path!r}", "model_path")


async def _still_readable(state: ServerState, tenant: str, model_path: str) -> bool:
    """Whether the caller may still read `model_path` (its own, or published to it), after a
    read that may have raced a delete or an unpublish."""
    try:
        await state.readable_checkpoint(tenant, model_path, "model_path")
    except ApiError:
        return False
    return True


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, state: State, tenant: Tenant) -> dict[str, Any]:
    row = await state.db(state.registry.sampler, sampler_id, tenant)
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


def _recording_outcome(
    records: StabilityRecords, tenant: str, sequence_ids: list[str], prompt: np.ndarray
) -> Callable[[SampleResult], Outcome]:
    """The outcome of a record_stability_info request: what the sampler drew, kept per
    sequence id for stable_reinforce (api/stability.py), then the usual answer."""

    def finish(result: SampleResult) -> Outcome:
        records.record(tenant, sequence_ids, prompt, result.sequences)
        return _sample_outcome(result)

    return finish


@router.post("/asample", openapi_extra=json_body(SampleRequest))
async def asample(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, raw = await read_json(request, SampleRequest)
    if body.sampling_session_id is None:
        raise bad_request("sampling_session_id: required", "sampling_session_id")
    sampler, session = await state.db(state.sampler_activity, body.sampling_session_id, tenant)
    if sampler is None:
        raise not_found(f"sampler {body.sampling_session_id!r}", "sampling_session_id")
    state.check_live(sampler.session_id, session)
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
    # Its own cancel key, so that revoking the caller's key can stop it past the queue too.
    work = dataclasses.replace(work, cancel_key=request_id)
    state.revocations.track(request_id, request_id)
    sequence_ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
    if key is not None:
        state.sample_submissions[key] = (digest, request_id, sequence_ids)
    outcome: Callable[[SampleResult], Outcome] = _sample_outcome
    if body.record_stability_info:
        outcome = _recording_outcome(state.stability, tenant, sequence_ids, work.prompt)
    # The official SDK's clones number their seq_ids from CLONE_STRIDE * clone id.
    state.feeds.watch(request_id, sampler.id, (body.seq_id or 0) // CLONE_STRIDE)
    state.traces.submitted(request_id, sampler.session_id, "Sample", sampler.id, body.seq_id)
    state.queue.submit_sample(Operation(request_id, "sample", work, outcome, tenant=tenant))
    state.engine.notify("sample")
    return {"request_id": request_id, "sample_sequence_ids": sequence_ids}
