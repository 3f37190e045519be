"""Client handshake, capabilities, health, telemetry and tokenizer files."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from fastapi import APIRouter, Request

from tuneloop.server.api.deps import State, Tenant, json_body, read_json
from tuneloop.server.engine.files import TOKENIZER_FILES
from tuneloop.types import (
    ClientConfigRequest,
    ClientConfigResponse,
    GetServerCapabilitiesResponse,
    SupportedModel,
    TelemetryRequest,
)

router = APIRouter(prefix="/api/v1")


@router.post("/client/config", openapi_extra=json_body(ClientConfigRequest))
async def client_config(request: Request, _tenant: Tenant) -> dict[str, Any]:
    await read_json(request, ClientConfigRequest)
    return ClientConfigResponse(
        custom_loss_server_side=True,  # create_custom_loss graphs run inside forward_backward
    ).model_dump()


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
