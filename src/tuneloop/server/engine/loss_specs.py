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
    # Per-token inputs the server derives itself (never accepted from a request).
    server_inputs: tuple[str, ...] = ()

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.required_inputs + self.optional_inputs


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
# What stable_reinforce reads from the stability records: the sampler's own logprob of each
# target token, and 1.0 where the target is a sampled token (0.0 on prompt positions).
STABILITY_INPUTS = ("recorded_logprobs", "sampled_mask")

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
        # The sampler logprobs come from the server's stability records, named by the datum's
        # provenance spans (api/stability.py); the request's own `logprobs` are not used.
        "stable_reinforce": LossSpec(
            "stable_reinforce",
            ("target_tokens", "advantages"),
            ("logprobs",),
            {"kl_coeff": 0.0, "clip_high_threshold": 2.0},
            server_inputs=STABILITY_INPUTS,
        ),
    }
)

# Names the official SDK can send that this server deliberately does not run, with the reason.
# (None today: "custom" runs a graph stored by create_custom_loss, see engine/custom_loss.py.)
UNSUPPORTED_LOSSES: Mapping[str, str] = MappingProxyType({})
