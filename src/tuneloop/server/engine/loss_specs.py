"""What each built-in loss takes: required and optional per-token inputs, config keys, defaults.

Pure data, shared by the API (to reject bad requests with a field name) and the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

_CLIP_INPUTS = ("clip_low_threshold", "clip_high_threshold")


@dataclass(frozen=True)
class LossSpec:
    name: str
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_defaults: Mapping[str, float] = field(default_factory=dict)
    allows_2d_targets: bool = False

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.required_inputs + self.optional_inputs


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")

LOSS_SPECS: Mapping[str, LossSpec] = MappingProxyType(
    {
        "cross_entropy": LossSpec(
            "cross_entropy", ("target_tokens",), ("weights",), allows_2d_targets=True
        ),
        "importance_sampling": LossSpec("importance_sampling", _RL_INPUTS),
        "ppo": LossSpec(
            "ppo",
            _RL_INPUTS,
            _CLIP_INPUTS,
            {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        ),
        "cispo": LossSpec(
            "cispo",
            _RL_INPUTS,
            _CLIP_INPUTS,
            {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        ),
        # The published docs show beta=0.05 in their example; no default was published.
        "dro": LossSpec("dro", _RL_INPUTS, (), {"beta": 0.05}),
        "gspo": LossSpec(
            "gspo",
            _RL_INPUTS,
            ("sequence_ratio_mask", *_CLIP_INPUTS),
            {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        ),
    }
)

# Names the official SDK can send that this server deliberately does not run, with the reason.
UNSUPPORTED_LOSSES: Mapping[str, str] = MappingProxyType(
    {
        "stable_reinforce": "its formula is not public; use importance_sampling, ppo or cispo",
        "custom": "server-side custom losses are off; forward_backward_custom runs on the client",
    }
)
