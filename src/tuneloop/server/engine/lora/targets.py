"""Which layers of a model LoRA adapts, by target group, and how much of the model that covers.

Groups (a LoRA config switches them on and off; Tinker's defaults train all of them):
- attention: q/k/v/o projections, fused `qkv_proj` (Phi-3), and MLA's low-rank projections
  (`q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`: DeepSeek-V3);
- mlp: dense MLP projections, fused `gate_up_proj` (Phi-3) and MoE shared experts;
- experts: fused 3-D MoE expert weights (`experts.gate_up_proj` / `experts.down_proj`);
- unembed: `lm_head`.
Routers stay frozen by design. Any other weight matrix of the body (not the embeddings) is a
layer the engine does not know how to adapt: `inject` refuses the model, naming its module
type, instead of training a silently partial adapter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from tuneloop.server.engine.lora.experts import (
    EXPERT_PARAMETERS,
    LoRAExperts,
    is_fused_experts,
    unsupported_experts_reason,
)
from tuneloop.server.engine.lora.linear import LoRALinear
from tuneloop.server.engine.lora.routing import RoutingContext
from tuneloop.server.engine.lora.slots import Slotted
from tuneloop.server.engine.types import AdapterSpec, EngineError, LoraCoverage

__all__ = [
    "ATTENTION_TARGETS",
    "GROUPS",
    "MLP_TARGETS",
    "UNEMBED_TARGETS",
    "Coverage",
    "Injected",
    "groups_of",
    "inject",
    "targets_of",
]

ATTENTION_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
UNEMBED_TARGETS = ("lm_head",)
GROUPS = ("attention", "mlp", "experts", "unembed")
_LINEAR_GROUPS = {
    **dict.fromkeys(ATTENTION_TARGETS, "attention"),
    **dict.fromkeys(MLP_TARGETS, "mlp"),
    **dict.fromkeys(UNEMBED_TARGETS, "unembed"),
}


def groups_of(spec: AdapterSpec) -> tuple[str, ...]:
    """The target groups an adapter trains: `train_mlp` covers dense MLPs and experts alike."""
    return spec.groups


def targets_of(spec: AdapterSpec) -> tuple[str, ...]:
    """The Linear module-name suffixes an adapter targets (PEFT's `target_modules`)."""
    return (
        (ATTENTION_TARGETS if spec.train_attn else ())
        + (MLP_TARGETS if spec.train_mlp else ())
        + (UNEMBED_TARGETS if spec.train_unembed else ())
    )


def _is_router(name: str, module: nn.Module) -> bool:
    last = name.rsplit(".", 1)[-1]
    return "Router" in type(module).__name__ or last in ("router", "gate", "shared_expert_gate")


@dataclass(frozen=True)
class Coverage:
    """How much of a model's body (every weight matrix but the embeddings) LoRA reaches."""

    body_parameters: int
    covered: Mapping[str, int]  # group -> base parameters under adapted layers
    frozen_routers: int

    def share(self, groups: tuple[str, ...] = GROUPS) -> float:
        return sum(self.covered.get(g, 0) for g in groups) / max(self.body_parameters, 1)


@dataclass
class Injected:
    """The adapted layers of one model: name -> layer (PEFT naming), group per layer."""

    layers: dict[str, Slotted]
    group: dict[str, str]
    coverage: Coverage
    slot_of: dict[str, str]
    context: RoutingContext

    def describe(self, model: nn.Module) -> LoraCoverage:
        per_rank = dict.fromkeys(GROUPS, 0)
        for name, layer in self.layers.items():
            a_shape, b_shape = layer.factor_shapes(1)
            per_rank[self.group[name]] += math.prod(a_shape) + math.prod(b_shape)
        present = tuple(g for g in GROUPS if per_rank[g])
        return LoraCoverage(
            parameters=sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n),
            groups=present,
            share=round(self.coverage.share(), 4),
            per_rank=tuple((g, per_rank[g]) for g in present),
        )


def inject(model: nn.Module, *, refuse_uncovered: bool = True) -> Injected:
    """Wrap every adaptable layer of `model` in place, or refuse the model (EngineError).

    `refuse_uncovered=False` keeps unknown weight matrices frozen instead (for hand-built test
    modules; a served model is always checked)."""
    slot_of: dict[str, str] = {}
    context = RoutingContext()
    layers: dict[str, Slotted] = {}
    group: dict[str, str] = {}
    covered = dict.fromkeys(GROUPS, 0)
    embeddings = {id(m) for m in model.modules() if isinstance(m, nn.Embedding)}
    unknown: dict[str, str] = {}
    routers = 0
    # Weights covered by an adapted layer or by a frozen router, counted while walking.
    accounted: set[int] = set()
    for name, module in list(model.named_modules()):
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and last in _LINEAR_GROUPS:
            wrapper = LoRALinear(module, slot_of, context)
            _replace(model, name, wrapper)
            layers[name] = wrapper
            group[name] = _LINEAR_GROUPS[last]
            covered[group[name]] += module.weight.numel()
            accounted.add(id(module.weight))
        elif is_fused_experts(module):
            reason = unsupported_experts_reason(module)
            if reason is not None or last != "experts":
                raise EngineError(
                    f"cannot adapt the experts of this model: {name} ({type(module).__name__}) "
                    f"{reason or 'is not named experts'}",
                    "user",
                )
            experts = LoRAExperts(module, slot_of, context)
            _replace(model, name, experts)
            for param in EXPERT_PARAMETERS:
                layers[f"{name}.{param}"] = experts.factors_of[param]
                group[f"{name}.{param}"] = "experts"
                covered["experts"] += getattr(module, param).numel()
                accounted.add(id(getattr(module, param)))
                bias = getattr(module, f"{param}_bias", None)
                if bias is not None:  # [E, out]: a bias per expert, frozen like every bias
                    accounted.add(id(bias))
        elif _is_router(name, module):
            for p in module.parameters(recurse=False):
                if p.dim() >= 2 and id(p) not in accounted:
                    routers += p.numel()
                    accounted.add(id(p))
    for mod_name, module in model.named_modules():
        if id(module) in embeddings or isinstance(module, (LoRALinear, LoRAExperts, Slotted)):
            continue
        for p_name, p in module.named_parameters(recurse=False):
            if p.dim() < 2 or id(p) in accounted:
                continue
            if any(p is e.weight for e in model.modules() if isinstance(e, nn.Embedding)):
                continue  # a tied head is the embedding
            unknown.setdefault(type(module).__name__, f"{mod_name}.{p_name}")
    if unknown and refuse_uncovered:
        listed = ", ".join(f"{kind} (e.g. {where})" for kind, where in unknown.items())
        raise EngineError(
            f"this model has layers LoRA cannot adapt: {listed}; refusing it rather than "
            "training an adapter that silently misses them",
            "user",
        )
    body = sum(covered.values()) + routers
    return Injected(layers, group, Coverage(body, covered, routers), slot_of, context)


def _replace(model: nn.Module, name: str, wrapper: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, wrapper)
