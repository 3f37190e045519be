"""Training routes: create/load a model, forward_backward, optim_step, save weights.

Each route validates its request and builds the typed engine operation it queues in the
model's ordered stream (`submission.py`); what a success stores is in `training_finish.py`.
The file runs past 400 lines because it holds every route of that one stream, whose checks
(seq_id, liveness, taken ids, checkpoint targets) read best side by side.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import zstandard
from fastapi import APIRouter, Request

from tuneloop.server.api.custom_losses import custom_loss_work
from tuneloop.server.api.decode_pool import (
    CUSTOM,
    PROCESS_BYTES,
    routing_fields,
    spans_as_data,
)
from tuneloop.server.api.deps import (
    State,
    Tenant,
    json_body,
    off_loop,
    protobuf_body,
    read_json,
    require_content_type,
)
from tuneloop.server.api.errors import ApiError, bad_request, not_found
from tuneloop.server.api.packages import check_ttl
from tuneloop.server.api.seq_guard import consumes_seq
from tuneloop.server.api.stability import attach_stability
from tuneloop.server.api.state import ServerState, fingerprint
from tuneloop.server.api.submission import TrainingSubmission
from tuneloop.server.api.taken_ids import (
    insert_new,
    is_retry,
    refuse_taken_model,
    refuse_taken_sampler,
)
from tuneloop.server.api.training_finish import (
    checkpoint_target,
    checkpoint_writer,
    json_outcome,
    register_run,
)
from tuneloop.server.api.validation import adam_step, decode_limits, forward_backward_work
from tuneloop.server.api.zstd_body import DecompressedTooLargeError, decompress_bounded
from tuneloop.server.engine.isolation import SKIPPED
from tuneloop.server.engine.operations import (
    CreateAdapter,
    CreateSampler,
    LoadAdapter,
    LoadState,
    OptimStep,
    SaveSamplerWeights,
    SaveState,
)
from tuneloop.server.engine.types import (
    AdapterSpec,
    ForwardBackwardResult,
    ForwardBackwardWork,
    lora_info,
)
from tuneloop.server.scheduler.futures import Outcome
from tuneloop.server.storage.registry import (
    PACKAGE_KINDS,
    SamplerRow,
)
from tuneloop.types import (
    CreateModelRequest,
    ForwardBackwardOutput,
    GetInfoRequest,
    GetInfoResponse,
    LoadWeightsRequest,
    LoraConfig,
    ModelData,
    OptimStepRequest,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    TensorData,
    WireFormatError,
)
from tuneloop.types.codec import (
    DecodeLimits,
    ForwardBackwardRequest,
    encode_forward_backward_output,
    forward_backward_request_from_proto,
    parse_forward_backward_request,
)

router = APIRouter(prefix="/api/v1")


def _model_id(session_id: str, model_seq_id: int) -> str:
    # The official SDK computes this itself on the create-from-checkpoint path (spec 2.8).
    return f"{session_id}:train:{model_seq_id}"


@router.post("/create_model", openapi_extra=json_body(CreateModelRequest))
async def create_model(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, raw = await read_json(request, CreateModelRequest)
    await state.live_session(body.session_id, tenant)
    state.model_spec(body.base_model)
    lora = body.lora_config or LoraConfig()
    seed = lora.seed if lora.seed is not None else secrets.randbelow(2**31)
    adapter = AdapterSpec(
        adapter_id=_model_id(body.session_id, body.model_seq_id),
        base_model=body.base_model,
        rank=lora.rank,
        seed=seed,
        train_mlp=lora.train_mlp,
        train_attn=lora.train_attn,
        train_unembed=lora.train_unembed,
        train_experts=lora.train_experts,
    )

    await refuse_taken_model(state, tenant, adapter.adapter_id, raw)

    async def finish(_result: None) -> Outcome:
        taken = await register_run(state, tenant, adapter, body.session_id, body.user_metadata)
        return taken or json_outcome({"model_id": adapter.adapter_id, "type": "create_model"})

    return state.submit_training(
        TrainingSubmission(
            tenant,
            adapter.adapter_id,
            0,
            CreateAdapter(adapter),
            finish,
            "CreateModel",
            fingerprint(raw),
        )
    )


@router.post("/get_info", openapi_extra=json_body(GetInfoRequest))
async def get_info(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, _ = await read_json(request, GetInfoRequest)
    run = await state.db(state.registry.training_run, body.model_id, tenant)
    if run is None:
        raise not_found(f"model {body.model_id!r}", "model_id")
    spec = state.model_spec(run.base_model)
    return GetInfoResponse(
        model_id=run.id,
        # tokenizer_id is a local folder (the official SDK loads it with no hub on this host),
        # or with `serve --tokenizer-id name` the model's name (for a client whose HF cache holds
        # it: tuneloop.hf_cache); our SDK fetches the files over GET /api/v1/tokenizer.
        model_data=ModelData(
            arch=spec.arch,
            model_name=run.base_model,
            tokenizer_id=(
                run.base_model if state.config.tokenizer_id == "name" else str(spec.tokenizer_dir)
            ),
            **lora_info(
                spec,
                run.lora_rank,
                run.train_attn,
                run.train_mlp,
                run.train_unembed,
                run.train_experts,
            ),
        ),
        optimizer_config={"type": "adamw"},
        is_lora=True,
        lora_rank=run.lora_rank,
        model_name=run.base_model,
    ).model_dump()


@router.post("/load_weights", openapi_extra=json_body(LoadWeightsRequest))
@consumes_seq
async def load_weights(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, raw = await read_json(request, LoadWeightsRequest)
    # The caller's checkpoint, or one another tenant published (read only: loading copies it).
    path, ckpt, source = await state.readable_checkpoint(tenant, body.path, "path")
    # A PEFT export (kind "adapter") holds an adapter too; a merged model does not.
    if (
        ckpt.checkpoint_type not in ("training", "sampler")
        and ckpt.kind != PACKAGE_KINDS["external"]
    ):
        raise bad_request(
            f"path: a {ckpt.kind or ckpt.checkpoint_type} package holds no adapter to load",
            "path",
        )
    if body.optimizer and ckpt.checkpoint_type != "training":
        raise bad_request(
            "optimizer: only training checkpoints (weights/...) hold optimizer state", "optimizer"
        )
    directory = Path(ckpt.directory)
    result = {"path": str(path), "type": "load_weights"}

    if body.session_id is not None and body.model_seq_id is not None:
        await state.live_session(body.session_id, tenant)
        if body.base_model is not None and body.base_model != source.base_model:
            raise bad_request(
                f"base_model: checkpoint was trained on {source.base_model!r}", "base_model"
            )
        state.model_spec(source.base_model)
        adapter = AdapterSpec(
            adapter_id=_model_id(body.session_id, body.model_seq_id),
            base_model=source.base_model,
            rank=source.lora_rank,
            seed=source.lora_seed,
            train_mlp=source.train_mlp,
            train_attn=source.train_attn,
            train_unembed=source.train_unembed,
            train_experts=source.train_experts,
        )

        await refuse_taken_model(state, tenant, adapter.adapter_id, raw)

        async def finish_create(_r: None) -> Outcome:
            metadata = (
                body.user_metadata
                if body.user_metadata is not None or source.tenant != tenant
                else source.user_metadata
            )
            taken = await register_run(
                state, tenant, adapter, body.session_id or "", metadata, origin=ckpt
            )
            return taken or json_outcome({**result, "model_id": adapter.adapter_id})

        return state.submit_training(
            TrainingSubmission(
                tenant,
                adapter.adapter_id,
                0,
                LoadAdapter(adapter, directory, body.optimizer, body.path),
                finish_create,
                "LoadWeights",
                fingerprint(raw),
            )
        )

    assert body.model_id is not None
    assert body.seq_id is not None
    run = await state.live_training_run(body.model_id, tenant)
    if run.base_model != source.base_model or run.lora_rank != source.lora_rank:
        raise bad_request(
            f"path: checkpoint ({source.base_model}, rank {source.lora_rank}) does not fit "
            f"model {run.id} ({run.base_model}, rank {run.lora_rank})",
            "path",
        )
    model_id = run.id

    async def finish_load(_r: None) -> Outcome:
        origin = (model_id, ckpt.tinker_path, ckpt.training_step or 0)
        await state.db_write(state.registry.set_training_origin, *origin)
        return json_outcome({**result, "model_id": model_id})

    return state.submit_training(
        TrainingSubmission(
            tenant,
            model_id,
            body.seq_id,
            LoadState(model_id, directory, body.optimizer, body.path),
            finish_load,
            "LoadWeights",
            fingerprint(raw),
        )
    )


async def _protobuf_body(request: Request, state: ServerState) -> bytes:
    raw = await request.body()
    require_content_type(request, "application/x-protobuf")
    encoding = request.headers.get("content-encoding", "").lower()
    if encoding == "zstd":
        limit = state.config.max_request_bytes
        try:
            raw = await off_loop(len(raw), decompress_bounded, raw, limit)
        except zstandard.ZstdError as exc:
            raise bad_request(f"body: bad zstd data: {exc}", "content-encoding") from None
        except DecompressedTooLargeError:
            raise ApiError(413, f"body: decompresses to more than {limit} bytes", "body") from None
    elif encoding not in ("", "identity"):
        raise ApiError(415, f"Content-Encoding {encoding!r} is not supported", "content-encoding")
    return raw


def _request_arrays(msg: Any, limits: DecodeLimits) -> ForwardBackwardRequest:
    return forward_backward_request_from_proto(msg, limits, token_arrays=True)


def _fwdbwd_outcome(result: ForwardBackwardResult) -> Outcome:
    output = ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[{"logprobs": TensorData.from_numpy(lp)} for lp in result.logprobs],
        metrics=result.metrics,
    )
    return Outcome(encode_forward_backward_output(output), "application/x-protobuf")


@router.post(
    "/forward_backward",
    openapi_extra=protobuf_body(
        "ForwardBackwardRequest",
        "the wire schema of tuneloop.types.proto; zstd if Content-Encoding: zstd",
    ),
)
@consumes_seq
async def forward_backward(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    raw = await _protobuf_body(request, state)
    size = len(raw)
    if size >= PROCESS_BYTES:
        routing = await off_loop(size, routing_fields, raw)
        if routing is not None and routing[1] != CUSTOM:
            answer = await _decode_in_process(state, tenant, raw, routing[0])
            if answer is not None:
                return answer
    # Decoding, checking and hashing a large body take a worker thread, not the event loop,
    # which meanwhile answers other requests (measured in bench/bench_event_loop.py).
    try:
        msg = await off_loop(size, parse_forward_backward_request, raw)
        run = await state.live_training_run(msg.model_id, tenant)
        spec = state.model_spec(run.base_model)
        limits = decode_limits(spec, state.config.max_request_bytes)
        body = await off_loop(size, _request_arrays, msg, limits)
    except WireFormatError as exc:
        raise bad_request(str(exc), exc.field) from None
    if body.loss_fn == "custom":
        work = await off_loop(
            size,
            custom_loss_work,
            body,
            spec,
            run.id,
            run.session_id,
            state.custom_losses,
            tenant,
        )
    else:
        work = await off_loop(size, forward_backward_work, body, spec, run.id)
    if body.loss_fn == "stable_reinforce":
        work = attach_stability(work, body.data, state.stability, tenant)
    digest = await off_loop(size, fingerprint, raw)
    return _submit_fwdbwd(state, tenant, run.id, body.seq_id, work, digest)


async def _decode_in_process(
    state: ServerState, tenant: str, raw: bytes, model_id: str
) -> dict[str, Any] | None:
    """A large body decoded in the server's decoding process (api/decode_pool.py): the answer,
    or None for a custom loss's body, which the worker thread decodes."""
    try:
        run = await state.live_training_run(model_id, tenant)
    except ApiError:
        # A malformed body says so first, as where the body is parsed before the lookup.
        try:
            await off_loop(len(raw), parse_forward_backward_request, raw)
        except WireFormatError as exc:
            raise bad_request(str(exc), exc.field) from None
        raise
    spec = state.model_spec(run.base_model)
    decoded = await state.decoder.decode(raw, spec, state.config.max_request_bytes, run.id)
    if decoded is None:
        return None
    work = decoded.work
    if decoded.spans is not None:
        work = attach_stability(work, spans_as_data(decoded.spans), state.stability, tenant)
    return _submit_fwdbwd(state, tenant, run.id, decoded.seq_id, work, decoded.digest)


def _submit_fwdbwd(
    state: ServerState,
    tenant: str,
    model_id: str,
    seq_id: int,
    work: ForwardBackwardWork,
    digest: str,
) -> dict[str, Any]:
    return state.submit_training(
        TrainingSubmission(
            tenant,
            model_id,
            seq_id,
            work,
            _fwdbwd_outcome,
            "Forward" if work.forward_only else "ForwardBackward",
            digest,
        )
    )


def _seq_id(seq_id: int | None) -> int:
    if seq_id is None or seq_id < 1:
        raise bad_request("seq_id: required, >= 1 (seq 0 is the model's creation)", "seq_id")
    return seq_id


@router.post("/optim_step", openapi_extra=json_body(OptimStepRequest))
@consumes_seq
async def optim_step(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, raw = await read_json(request, OptimStepRequest)
    run = await state.live_training_run(body.model_id, tenant)
    step = adam_step(body)
    model_id = run.id

    async def finish(metrics: dict[str, float]) -> Outcome:
        # Stored in the model's order (one writer thread), so a later save sees it counted; a
        # skipped step (non-finite) changed nothing, so it counts no step.
        if not metrics.get(SKIPPED):
            await state.db_write(state.registry.advance_training_step, model_id)
        return json_outcome({"metrics": metrics, "type": "optim_step"})

    return state.submit_training(
        TrainingSubmission(
            tenant,
            model_id,
            _seq_id(body.seq_id),
            OptimStep(model_id, step),
            finish,
            "OptimStep",
            fingerprint(raw),
        )
    )


@router.post("/save_weights", openapi_extra=json_body(SaveWeightsRequest))
@consumes_seq
async def save_weights(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, raw = await read_json(request, SaveWeightsRequest)
    run = await state.live_training_run(body.model_id, tenant)
    seq_id = _seq_id(body.seq_id)
    check_ttl(body.ttl_seconds)
    target, directory = checkpoint_target(state, tenant, run.id, "weights", body.path)
    finish = checkpoint_writer(
        state, tenant, target, directory, "training", body.ttl_seconds, body.user_metadata
    )
    work = SaveState(
        run.id, directory, optimizer=True, overwrite=body.overwrite, target=str(target)
    )
    return state.submit_training(
        TrainingSubmission(tenant, run.id, seq_id, work, finish, "SaveWeights", fingerprint(raw))
    )


@router.post("/save_weights_for_sampler", openapi_extra=json_body(SaveWeightsForSamplerRequest))
@consumes_seq
async def save_weights_for_sampler(
    request: Request, state: State, tenant: Tenant
) -> dict[str, Any]:
    body, raw = await read_json(request, SaveWeightsForSamplerRequest)
    run = await state.live_training_run(body.model_id, tenant)
    seq_id = _seq_id(body.seq_id)
    check_ttl(body.ttl_seconds)
    model_id = run.id
    if body.sampling_session_seq_id is not None:
        # Ephemeral: a frozen snapshot of the adapter as of this point in the model's order.
        sampler_id = f"{run.session_id}:sample:{body.sampling_session_seq_id}"
        base_model = run.base_model
        retry = is_retry(state, model_id, seq_id, raw)
        if not retry:
            try:
                await refuse_taken_sampler(state, tenant, sampler_id)
            except ApiError:  # refused, its seq_id is still consumed (see seq_guard)
                await state.skip_rejected(tenant, model_id, seq_id, fingerprint(raw))
                raise

        async def finish_snapshot(_r: None) -> Outcome:
            state.pending_samplers.discard(sampler_id)
            row = SamplerRow(
                id=sampler_id, tenant=tenant, session_id=run.session_id, base_model=base_model
            )
            return await insert_new(state, row) or json_outcome(
                {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
            )

        accepted = state.submit_training(
            TrainingSubmission(
                tenant,
                model_id,
                seq_id,
                CreateSampler(sampler_id, base_model, adapter_id=model_id),
                finish_snapshot,
                "SaveWeightsForSampler",
                fingerprint(raw),
                # A snapshot that failed leaves its sampler id free to be created again.
                on_failure=lambda: state.pending_samplers.discard(sampler_id),
            )
        )
        if not retry:
            state.pending_samplers.add(sampler_id)
        return accepted
    target, directory = checkpoint_target(state, tenant, run.id, "sampler_weights", body.path)
    finish = checkpoint_writer(
        state, tenant, target, directory, "sampler", body.ttl_seconds, body.user_metadata
    )

    async def answer(size: int) -> Outcome:
        saved = json.loads((await finish(size)).body)
        return json_outcome({**saved, "type": "save_weights_for_sampler"})

    return state.submit_training(
        TrainingSubmission(
            tenant,
            model_id,
            seq_id,
            SaveSamplerWeights(model_id, directory),
            answer,
            "SaveWeightsForSampler",
            fingerprint(raw),
        )
    )


@router.post("/save_weights_external", openapi_extra=json_body(SaveWeightsExternalRequest))
@consumes_seq
async def save_weights_external(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    """Export the adapter in the PEFT layout for download (downloads.py signs its URLs): the
    sampler-weights files, no optimizer state, registered as a package of kind "adapter"."""
    body, raw = await read_json(request, SaveWeightsExternalRequest)
    run = await state.live_training_run(body.model_id, tenant)
    seq_id = _seq_id(body.seq_id)
    if body.age_encryption_recipients:
        # No age library is installed, and encryption is not something to write by hand.
        raise bad_request(
            "age_encryption_recipients: encrypted exports are not supported by this server; "
            "omit the field (downloads use signed URLs over your connection to the server)",
            "age_encryption_recipients",
        )
    check_ttl(body.ttl_seconds)
    target, directory = checkpoint_target(state, tenant, run.id, "external_weights", body.path)
    model_id = run.id
    finish = checkpoint_writer(state, tenant, target, directory, "external", body.ttl_seconds, None)

    async def answer(size: int) -> Outcome:
        saved = json.loads((await finish(size)).body)
        return json_outcome(
            {"path": saved["path"], "size_bytes": size, "type": "save_weights_external"}
        )

    return state.submit_training(
        TrainingSubmission(
            tenant,
            model_id,
            seq_id,
            SaveSamplerWeights(model_id, directory),
            answer,
            "SaveWeightsExternal",
            fingerprint(raw),
        )
    )
