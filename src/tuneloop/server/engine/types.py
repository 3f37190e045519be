"""Engine-level types: frozen dataclasses with no optionals where a default will do.

The API converts wire types to these once; the engine trusts them (already validated).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from tuneloop.server.engine.custom_loss_graph import CustomLoss


class EngineError(Exception):
    """A failure of one request; returned as a value in batches so neighbours still succeed."""

    def __init__(self, message: str, category: Literal["user", "server"] = "server") -> None:
        super().__init__(message)
        self.category = category


@dataclass(frozen=True)
class LoraCoverage:
    """What LoRA reaches on one model: reported by get_info and capabilities, logged at load."""

    parameters: int  # the base model's parameter count
    groups: tuple[str, ...]  # target groups with layers on this model (attention, mlp, ...)
    share: float  # of the body's weights (all matrices but the embeddings), every group on
    per_rank: tuple[tuple[str, int], ...]  # group -> trainable parameters per unit of rank

    def trainable(self, rank: int, groups: tuple[str, ...] | None = None) -> int:
        """Trainable parameters of a rank-`rank` adapter on these groups (None: all)."""
        return rank * sum(n for g, n in self.per_rank if groups is None or g in groups)

    def describe(self, name: str, arch: str) -> str:
        """One line for the load log and `tuneloop serve`'s start-up output."""
        return (
            f"model {name} ({arch}, {self.parameters / 1e6:.1f}M parameters): LoRA covers "
            f"{', '.join(self.groups)}, {100 * self.share:.1f}% of the body's weights; a rank-32 "
            f"adapter on all of them trains {self.trainable(32) / 1e6:.2f}M parameters"
        )

    def summary(self) -> dict[str, Any]:
        """The capabilities fields (every target group on)."""
        return {
            "num_parameters": self.parameters,
            "lora_groups": list(self.groups),
            "lora_coverage": self.share,
            "lora_parameters_per_rank": self.trainable(1),
        }


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str
    vocab_size: int
    max_context_length: int
    eos_token_id: int
    tokenizer_dir: Path
    lora: LoraCoverage | None = None  # None: a backend without real layers (the fake one)


@dataclass(frozen=True)
class AdapterSpec:
    adapter_id: str
    base_model: str
    rank: int
    seed: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    alpha: float = 32.0
    train_experts: bool | None = None  # None: as train_mlp

    @property
    def groups(self) -> tuple[str, ...]:
        """The target groups trained: `train_mlp` covers dense MLPs and, unless `train_experts`
        says otherwise, MoE experts."""
        return target_groups(
            self.train_attn, self.train_mlp, self.train_unembed, self.train_experts
        )


def target_groups(
    train_attn: bool, train_mlp: bool, train_unembed: bool, train_experts: bool | None = None
) -> tuple[str, ...]:
    experts = train_mlp if train_experts is None else train_experts
    return (
        (("attention",) if train_attn else ())
        + (("mlp",) if train_mlp else ())
        + (("experts",) if experts else ())
        + (("unembed",) if train_unembed else ())
    )


def lora_info(
    spec: ModelSpec,
    rank: int,
    train_attn: bool,
    train_mlp: bool,
    train_unembed: bool,
    train_experts: bool | None = None,
) -> dict[str, Any]:
    """get_info's account of one adapter: the model's size, the groups it covers there, and
    how many parameters it trains (empty where the backend does not say)."""
    if spec.lora is None:
        return {}
    groups = tuple(
        g
        for g in target_groups(train_attn, train_mlp, train_unembed, train_experts)
        if g in spec.lora.groups
    )
    return {
        "num_parameters": spec.lora.parameters,
        "lora_groups": list(groups),
        "lora_trainable_parameters": spec.lora.trainable(rank, groups),
    }


@dataclass(frozen=True)
class Example:
    """One datum: input tokens [N] and per-token loss inputs (target_tokens [N] or [N, K], ...)."""

    tokens: np.ndarray
    inputs: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class ForwardBackwardWork:
    """One request (one chunk) for one adapter; a batch may hold many adapters' requests."""

    adapter_id: str
    examples: tuple[Example, ...]
    loss_fn: str
    loss_config: Mapping[str, float]
    forward_only: bool
    # loss_fn "custom": the checked graph to run per datum (create_custom_loss).
    custom_loss: CustomLoss | None = None


@dataclass(frozen=True)
class ForwardBackwardResult:
    logprobs: list[np.ndarray]  # per example, shaped like its target_tokens, float32
    metrics: dict[str, float]


@dataclass(frozen=True)
class AdamStep:
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float


TopkRow = list[tuple[int, float]] | None
# Told of each token as it is drawn: (sample index, token, logprob, top-k row or None). Called
# on the engine thread between decode steps, so it must be quick and hand work elsewhere.
TokenHook = Callable[[int, int, float, TopkRow], None]


# The error of a sampling request cancelled mid-way: its session ended or its caller went away.
CANCELLED = "cancelled: the request's session ended or its caller went away"


@dataclass(frozen=True)
class SampleWork:
    sampler_id: str
    prompt: np.ndarray  # int64 [P]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int  # -1 = no limit
    top_p: float
    seed: int | None
    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    # Streaming: backends that decode step by step call it per token; others never do (the
    # result still arrives whole), so a caller must not depend on it.
    on_token: TokenHook | None = field(default=None, compare=False, repr=False)
    # Cancelling this key drops this request as cancelling its sampler drops all of the
    # sampler's (a caller that went away; several requests may share one sampler).
    cancel_key: str | None = None

    def cancelled_by(self, gone: Collection[str]) -> bool:
        """Whether the ids in `gone` (cancelled samplers and cancel keys) name this request."""
        return self.sampler_id in gone or (self.cancel_key is not None and self.cancel_key in gone)

    def __getstate__(self) -> dict[str, object]:
        # The hook stays in this process: work sent to a worker process goes without it (it
        # could not call back here), and its result arrives whole.
        return {**self.__dict__, "on_token": None}


@dataclass(frozen=True)
class SampledTokens:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk: list[TopkRow] | None = None


@dataclass(frozen=True)
class SampleResult:
    sequences: list[SampledTokens]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[TopkRow] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
