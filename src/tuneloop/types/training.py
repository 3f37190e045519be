"""Training-side types: LoRA and optimizer configuration, forward/backward results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from tuneloop.types._base import ResponseBase, StrictBase
from tuneloop.types.tensor import TensorData

LossFnType = Literal[
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
    "custom",
]


class LoraConfig(StrictBase):
    rank: int = Field(default=32, ge=1, le=1024)
    # Stored as a 64-bit integer and fed to the generators, which take no negatives.
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True
    # tuneloop's finer target group: LoRA on MoE experts (None: as train_mlp, which then covers
    # dense MLPs and experts alike, Tinker's meaning). Ignored on models without experts.
    train_experts: bool | None = None


class AdamParams(StrictBase):
    """AdamW step parameters; decoupled weight decay as torch.optim.AdamW, global-norm clip."""

    learning_rate: float = Field(default=1e-4, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip_norm: float = Field(default=0.0, ge=0)  # 0 = no clipping


class OptimizerConfig(StrictBase):
    type: Literal["adamw"] = "adamw"


class OptimStepResponse(ResponseBase):
    metrics: dict[str, float] | None = None


@dataclass
class ForwardBackwardOutput:
    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    # Keys are "name:reduction" (sum, mean, min, max, ...); "loss:sum" is always present.
    metrics: dict[str, float] = field(default_factory=dict)
