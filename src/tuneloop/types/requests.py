"""JSON request bodies of the wire protocol (forward_backward travels as protobuf, see codec)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tuneloop.types._base import StrictBase
from tuneloop.types.fields import (
    MAX_SEQ_ID,
    Int64,
    NonNegativeInt64,
    SeqId,
    StringMetadata,
    Tags,
    UserMetadata,
)
from tuneloop.types.model_input import ModelInput
from tuneloop.types.sampling import SamplingParams
from tuneloop.types.training import AdamParams, LoraConfig, OptimizerConfig


class ClientConfigRequest(StrictBase):
    sdk_version: str = ""


class CreateSessionRequest(StrictBase):
    tags: Tags = Field(default_factory=list)
    user_metadata: UserMetadata = None
    # Stored in a 32-character column (PostgreSQL enforces the length).
    sdk_version: str = Field(default="", max_length=32)
    project_id: str | None = None
    display_name: str | None = None
    type: Literal["create_session"] = "create_session"


class SessionHeartbeatRequest(StrictBase):
    session_id: str
    type: Literal["session_heartbeat"] = "session_heartbeat"


class FinishReason(StrictBase):
    type: Literal["success", "errored", "interrupted"] = "success"


class FinishSessionRequest(StrictBase):
    reason: FinishReason = Field(default_factory=FinishReason)
    detail: str | None = None


class CreateModelRequest(StrictBase):
    session_id: str
    model_seq_id: SeqId
    base_model: str
    user_metadata: UserMetadata = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    type: Literal["create_model"] = "create_model"

    @model_validator(mode="after")
    def _something_trains(self) -> CreateModelRequest:
        lora = self.lora_config
        if lora and not (
            lora.train_mlp or lora.train_attn or lora.train_unembed or lora.train_experts
        ):
            raise ValueError(
                "lora_config: one of train_mlp, train_attn, train_unembed, train_experts must be"
                " true"
            )
        return self


class GetInfoRequest(StrictBase):
    model_id: str
    type: Literal["get_info"] = "get_info"


class LoadWeightsRequest(StrictBase):
    """Two forms: create-via-load (session_id + model_seq_id) or legacy (model_id + seq_id)."""

    model_id: str | None = None
    seq_id: Int64 | None = None
    session_id: str | None = None
    model_seq_id: SeqId | None = None
    base_model: str | None = None
    user_metadata: UserMetadata = None
    path: str
    optimizer: bool = False
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None
    type: Literal["load_weights"] = "load_weights"

    @model_validator(mode="after")
    def _one_form(self) -> LoadWeightsRequest:
        creates = self.session_id is not None and self.model_seq_id is not None
        legacy = self.model_id is not None and self.seq_id is not None
        if creates == legacy:
            raise ValueError(
                "load_weights needs either session_id + model_seq_id or model_id + seq_id"
            )
        return self


class OptimStepRequest(StrictBase):
    model_id: str
    seq_id: Int64 | None = None
    adam_params: AdamParams | None = None
    optimizer_params: AdamParams | None = None
    optim_params: AdamParams | None = None
    type: Literal["optim_step"] = "optim_step"

    @property
    def params(self) -> AdamParams:
        return self.adam_params or self.optimizer_params or self.optim_params or AdamParams()


class SaveWeightsRequest(StrictBase):
    model_id: str
    path: str | None = None
    seq_id: Int64 | None = None
    ttl_seconds: Int64 | None = None
    overwrite: bool = False
    user_metadata: StringMetadata = None
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerRequest(StrictBase):
    """Named (path) or ephemeral (sampling_session_seq_id) sampler weights."""

    model_id: str
    path: str | None = None
    sampling_session_seq_id: SeqId | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: Int64 | None = None
    ttl_seconds: Int64 | None = None
    user_metadata: StringMetadata = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"

    @model_validator(mode="after")
    def _one_form(self) -> SaveWeightsForSamplerRequest:
        if (self.path is None) == (self.sampling_session_seq_id is None):
            raise ValueError("save_weights_for_sampler needs path or sampling_session_seq_id")
        return self


class SaveWeightsExternalRequest(StrictBase):
    """Export the adapter for download (PEFT layout), as `tinker://<run>/external_weights/<name>`.

    `age_encryption_recipients` is part of the wire type; this server refuses it (400) rather
    than store unencrypted files a caller asked to have encrypted.
    """

    model_id: str
    path: str | None = None
    seq_id: Int64 | None = None
    ttl_seconds: Int64 | None = None
    age_encryption_recipients: list[str] | None = None
    type: Literal["save_weights_external"] = "save_weights_external"


class CreateSamplingSessionRequest(StrictBase):
    session_id: str
    sampling_session_seq_id: SeqId
    base_model: str | None = None
    model_path: str | None = None
    type: Literal["create_sampling_session"] = "create_sampling_session"

    @model_validator(mode="after")
    def _something_to_sample(self) -> CreateSamplingSessionRequest:
        if self.base_model is None and self.model_path is None:
            raise ValueError("create_sampling_session needs base_model or model_path")
        return self


class SampleRequest(StrictBase):
    num_samples: int = Field(default=1, ge=1, le=256)
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: Int64 | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=64)
    topk_sample_logprobs: int = Field(default=0, ge=0, le=64)
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: NonNegativeInt64 = 0
    prompt_logprobs_last_n: int | None = Field(default=None, ge=1, le=MAX_SEQ_ID)
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"


class RetrieveFutureRequest(StrictBase):
    request_id: str
    allow_metadata_only: bool = False


class TelemetryRequest(StrictBase):
    events: list[dict[str, Any]] = Field(default_factory=list)
    platform: str = ""
    sdk_version: str = ""
    session_id: str = ""
    process_uuid: str = ""
