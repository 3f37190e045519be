"""JSON response bodies: futures, session/model/sampler records, REST listings."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from tuneloop.types._base import ResponseBase


class ClientConfigResponse(ResponseBase):
    """Feature flags the official SDK reads at start; ours are the simplest compatible set."""

    pjwt_auth_enabled: bool = False
    use_pyqwest_transport: bool = False
    proto_compress_fwdbwd: bool = False
    parallel_fwdbwd_chunks: bool = True
    fwdbwd_max_chunk_len: int = 1024
    fwdbwd_max_chunk_bytes_count: int = 5_000_000
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False


class CreateSessionResponse(ResponseBase):
    session_id: str
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class UntypedFuture(ResponseBase):
    """What every long operation returns at once; the result comes from retrieve_future."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


class TryAgainResponse(ResponseBase):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    queue_state_reason: str | None = None


class RequestFailedResponse(ResponseBase):
    error: str
    category: Literal["user", "server", "unknown"] = "unknown"


class ModelData(ResponseBase):
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None
    # What the adapter covers on this model (None where the backend does not say).
    num_parameters: int | None = None
    lora_groups: list[str] | None = None
    lora_trainable_parameters: int | None = None


class GetInfoResponse(ResponseBase):
    model_id: str
    model_data: ModelData
    optimizer_config: dict[str, Any] | None = None
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None
    type: str | None = "get_info"


class CreateModelResponse(ResponseBase):
    model_id: str
    type: str = "create_model"


class LoadWeightsResponse(ResponseBase):
    path: str | None = None
    model_id: str | None = None
    type: str = "load_weights"


class SaveWeightsResponse(ResponseBase):
    path: str
    type: str = "save_weights"


class SaveWeightsForSamplerResponse(ResponseBase):
    path: str | None = None
    sampling_session_id: str | None = None
    type: str = "save_weights_for_sampler"


class SaveWeightsExternalResponse(ResponseBase):
    path: str
    size_bytes: int | None = None
    type: str = "save_weights_external"


class ExternalWeightsUrlsResponse(ResponseBase):
    """A signed URL per file of an external-weights checkpoint, keyed by its path relative to
    the checkpoint's folder. The URLs need no API key and stop working at `expires`."""

    urls: dict[str, str]
    expires: datetime


class CreateSamplingSessionResponse(ResponseBase):
    sampling_session_id: str


class GetSamplerResponse(ResponseBase):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class SupportedModel(ResponseBase):
    model_name: str
    max_context_length: int | None = None
    trainable: bool = True
    sampleable: bool = True
    # The model's architecture and what LoRA covers on it, every target group on: the groups,
    # their share of the body's weights, and trainable parameters per unit of rank.
    arch: str | None = None
    num_parameters: int | None = None
    lora_groups: list[str] | None = None
    lora_coverage: float | None = None
    lora_parameters_per_rank: int | None = None


class GetServerCapabilitiesResponse(ResponseBase):
    supported_models: list[SupportedModel]


class Checkpoint(ResponseBase):
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, Any] | None = None
    expires_at: datetime | None = None
    # Model-package fields (tuneloop; the official SDK ignores them). `name` is the checkpoint
    # name; `version` numbers the tenant's packages of that name 1, 2, ...; `kind` is
    # "training-state", "sampler", "adapter" (a PEFT export, save_weights_external) or "merged"
    # (base + adapter as one model); `parent_tinker_path` the package the run was loaded from
    # (for a merged one, its source); `training_step` the optimizer steps applied.
    name: str | None = None
    version: int | None = None
    kind: str | None = None
    base_model: str | None = None
    lora_rank: int | None = None
    lora_targets: list[str] | None = None
    parent_tinker_path: str | None = None
    training_step: int | None = None


class TrainingRun(ResponseBase):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    last_request_time: datetime
    corrupted: bool = False
    lora_rank: int | None = None
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, Any] | None = None


class Cursor(ResponseBase):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(ResponseBase):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRunsResponse(ResponseBase):
    training_runs: list[TrainingRun]
    cursor: Cursor


class GetSessionResponse(ResponseBase):
    training_run_ids: list[str] = Field(default_factory=list)
    sampler_ids: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    display_name: str | None = None


class ListSessionsResponse(ResponseBase):
    sessions: list[str]


class WeightsInfoResponse(ResponseBase):
    base_model: str
    optimizer_config: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"})
    is_lora: bool = True
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None
    # Not in the official schema (its clients ignore it): None means the experts follow train_mlp.
    train_experts: bool | None = None
