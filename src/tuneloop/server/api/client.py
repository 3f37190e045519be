"""Client handshake, capabilities, health, telemetry and tokenizer files."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from fastapi import APIRouter, Request

from tuneloop.server.api.deps import State, Tenant, json_body, read_json
from tuneloop.server.api.errors import ApiError
from tuneloop.server.engine.files import TOKENIZER_FILES
from tuneloop.types import (
    ClientConfigRequest,
    ClientConfigResponse,
    GetServerCapabilitiesResponse,
    SupportedModel,
    TelemetryRequest,
)

router = APIRouter(prefix="/api/v1")
# Served only with `serve --jwt` (app.py): without it the route does not exist.
token_router = APIRouter(prefix="/api/v1")


@router.post("/client/config", openapi_extra=json_body(ClientConfigRequest))
async def client_config(request: Request, state: State, _tenant: Tenant) -> dict[str, Any]:
    await read_json(request, ClientConfigRequest)
    flags = {
        "pjwt_auth_enabled": state.token_issuer is not None,  # serve --jwt
        "proto_compress_fwdbwd": True,  # zstd forward_backward bodies (api/training.py)
        "sample_use_retrieve_futures": True,  # the batch completion feed (api/futures.py)
        "sample_join_sampling_session": True,  # server-numbered clones (api/futures.py)
        "custom_loss_server_side": True,  # create_custom_loss graphs run inside forward_backward
    }
    return ClientConfigResponse(**flags).model_dump()


@token_router.post("/auth/token")
async def auth_token(request: Request, state: State, _tenant: Tenant) -> dict[str, str]:
    """Trade the API key this request carries for a short-lived token (`serve --jwt`)."""
    assert state.token_issuer is not None  # the route exists only with --jwt
    record = getattr(request.state, "api_key_record", None)
    if record is None:  # a token, not a key: tokens are renewed from the key only
        raise ApiError(401, "exchange an API key (tml-...), not a token", "X-API-Key")
    state.audit.record_once(
        ("token", record.key_id),
        record.tenant,
        "key_token_issued",
        window_s=3600,
        key_id=record.key_id,
    )
    return {"jwt": state.token_issuer.issue(record)}


@router.post("/client/dynamic_config")
async def dynamic_config(_tenant: Tenant) -> dict[str, Any]:
    return {
        "refresh_interval_sec": 300,
        "sample_cancel_enabled": False,
        "sample_cancel_max_batch_size": 64,
    }


@router.post("/telemetry", openapi_extra=json_body(TelemetryRequest))
async def telemetry(request: Request, _tenant: Tenant) -> dict[str, str]:
    await read_json(request, TelemetryRequest)  # accepted and dropped
    return {"status": "accepted"}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(state: State, _tenant: Tenant) -> dict[str, Any]:
    models = [
        SupportedModel(
            model_name=m.name,
            max_context_length=m.max_context_length,
            arch=m.arch,
            **({} if m.lora is None else m.lora.summary()),
        )
        for m in state.models.values()
    ]
    return GetServerCapabilitiesResponse(supported_models=models).model_dump()


@router.get("/tokenizer")
async def tokenizer(state: State, _tenant: Tenant, base_model: str) -> dict[str, Any]:
    """The served model's tokenizer files, so clients never need a model hub."""
    spec = state.model_spec(base_model)
    files: dict[str, str] = {}
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = spec.tokenizer_dir / name
        if path.is_file():
            raw = path.read_bytes()
            digest.update(name.encode() + b"\0" + raw)
            files[name] = base64.b64encode(raw).decode()
    return {"base_model": spec.name, "files": files, "sha256": digest.hexdigest()}
