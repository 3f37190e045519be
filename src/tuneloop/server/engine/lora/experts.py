"""LoRA on fused mixture-of-experts weights (transformers 5 `*Experts` modules).

transformers 5 stores an MoE layer's experts as two 3-D parameters, `gate_up_proj` and
`down_proj`: [E, out, in] (Qwen3-MoE, DeepSeek-V3, GLM-4-MoE) or, with `is_transposed`,
[E, in, out] (GPT-OSS, which adds biases and an interleaved clamped SwiGLU). `LoRAExperts`
wraps such a module and gives each of the two parameters per-expert factors
(A [E, r, in], B [E, out, r] per slot, one `ExpertFactors` child each). With no adapter routed
the wrapped module runs as it is (whatever experts kernel transformers picked); with one, the
(token, top-k) assignments are sorted by expert once, and each hit expert's contiguous slice of
tokens goes through the expert's frozen weights plus its own low-rank delta, so a token's delta
comes only from the experts its (frozen) router chose, and a token's adapter comes from the
routing, like every other layer. The loop is over experts (and, within one, over the adapters
present), never over tokens.

On disk the factors take PEFT's `target_parameters` layout (`ParamWrapper`): lora_A.weight
[E*r, in] with expert e's rows at e*r..(e+1)*r, lora_B.weight [out, r*E] with column j*E+e
holding expert e's column j (`to_peft` / `from_peft`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from tuneloop.server.engine.lora.routing import RoutingContext
from tuneloop.server.engine.lora.slots import Slotted

__all__ = [
    "EXPERT_PARAMETERS",
    "ExpertFactors",
    "LoRAExperts",
    "is_fused_experts",
    "unsupported_experts_reason",
]

# In declaration order, which is also the order PEFT nests its ParamWrappers in.
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def is_fused_experts(module: nn.Module) -> bool:
    return all(
        isinstance(getattr(module, name, None), nn.Parameter) and getattr(module, name).dim() == 3
        for name in EXPERT_PARAMETERS
    )


def unsupported_experts_reason(module: nn.Module) -> str | None:
    """Why `LoRAExperts` cannot reproduce this experts module's forward, or None."""
    if not callable(getattr(module, "_apply_gate", None)):
        return "it has no _apply_gate (not a transformers 5 experts module)"
    if not getattr(module, "has_gate", True):
        return "it has no gate projection"
    if getattr(module, "has_post_expert_norm", False):
        return "it applies a norm after each expert"
    return None


class ExpertFactors(Slotted):
    """Per-slot, per-expert factors of one 3-D expert parameter."""

    def __init__(
        self, param: nn.Parameter, transposed: bool, slot_of: Mapping[str, str], ctx: RoutingContext
    ) -> None:
        super().__init__(slot_of, ctx)
        experts, first, second = param.shape
        self._param = [param]  # a plain list: the frozen weight is not this module's parameter
        self.num_experts = experts
        self.in_features, self.out_features = (first, second) if transposed else (second, first)

    def _base_parameters(self) -> Iterator[torch.Tensor]:
        yield self._param[0]

    def factor_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.num_experts, rank, self.in_features), (
            self.num_experts,
            self.out_features,
            rank,
        )

    def to_peft(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts, rank, _ = a.shape
        return a.reshape(experts * rank, -1), b.permute(1, 2, 0).reshape(-1, rank * experts)

    def from_peft(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts = self.num_experts
        rank = a.shape[0] // experts
        return (
            a.reshape(experts, rank, a.shape[-1]),
            b.reshape(b.shape[0], rank, experts).permute(2, 0, 1).contiguous(),
        )

    def delta(
        self,
        x: torch.Tensor,
        expert: int,
        present: Sequence[tuple[torch.Tensor, torch.Tensor, float] | None],
        token_keys: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The delta for `x` (tokens routed to `expert`), each token with its adapter."""
        if token_keys is None:  # one adapter for every token
            item = present[0]
            return None if item is None else _expert_delta(x, item, expert)
        out: torch.Tensor | None = None
        for index, item in enumerate(present):
            if item is None:
                continue
            rows = (token_keys == index).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            piece = _expert_delta(x.index_select(0, rows), item, expert)
            if out is None:
                out = x.new_zeros(x.shape[0], self.out_features, dtype=piece.dtype)
            out = out.index_add(0, rows, piece)
        return out


def _expert_delta(
    x: torch.Tensor, item: tuple[torch.Tensor, torch.Tensor, float], expert: int
) -> torch.Tensor:
    a, b, scale = item
    return ((x.to(a.dtype) @ a[expert].t()) * scale) @ b[expert].t()


class LoRAExperts(nn.Module):
    """A frozen fused-experts module plus per-expert LoRA on gate_up_proj and down_proj."""

    def __init__(
        self, base: nn.Module, slot_of: Mapping[str, str], context: RoutingContext
    ) -> None:
        super().__init__()
        self.base = base
        self._context = context
        self.transposed = bool(getattr(base, "is_transposed", False))
        self.has_bias = bool(getattr(base, "has_bias", False))
        self.factors_of = {
            name: ExpertFactors(getattr(base, name), self.transposed, slot_of, context)
            for name in EXPERT_PARAMETERS
        }
        self.adapters = nn.ModuleDict(self.factors_of)  # registers them in the module tree

    def _project(self, x: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        weight = getattr(self.base, name)[expert]
        out = x @ weight if self.transposed else nn.functional.linear(x, weight)
        if self.has_bias:
            out = out + getattr(self.base, f"{name}_bias")[expert]
        return out

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        routing = self._context.routing
        keys = routing.keys if routing is not None and routing.runs else []
        factors = {
            name: [module.lookup_as(key, hidden_states.dtype) for key in keys]
            for name, module in self.factors_of.items()
        }
        if routing is None or all(f is None for per in factors.values() for f in per):
            return self.base(hidden_states, top_k_index, top_k_weights)
        token_keys = (
            routing.token_keys(hidden_states.shape[0], hidden_states.device)
            if len(keys) > 1
            else None
        )
        gate_up, down = self.factors_of["gate_up_proj"], self.factors_of["down_proj"]
        experts = gate_up.num_experts
        with torch.no_grad():
            # Every (token, top-k slot) assignment, sorted by expert: each expert's tokens are
            # then one contiguous slice (ids out of range, which some models use to mark a
            # dropped slot, sort last and are cut off).
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat.clamp(max=experts), minlength=experts + 1)[:experts]
            sizes = counts.tolist()
            order = order[: sum(sizes)]
            tokens = order // top_k_index.shape[1]
        x_all = hidden_states.index_select(0, tokens)
        keys_all = token_keys.index_select(0, tokens) if token_keys is not None else None
        pieces = []
        start = 0
        for expert, size in enumerate(sizes):
            if size == 0:
                continue
            x = x_all[start : start + size]
            keys_here = keys_all[start : start + size] if keys_all is not None else None
            start += size
            h = self._project(x, "gate_up_proj", expert)
            delta = gate_up.delta(x, expert, factors["gate_up_proj"], keys_here)
            if delta is not None:
                h = h + delta.to(h.dtype)
            h = self.base._apply_gate(h)  # type: ignore[operator]
            out = self._project(h, "down_proj", expert)
            delta = down.delta(h, expert, factors["down_proj"], keys_here)
            if delta is not None:
                out = out + delta.to(out.dtype)
            pieces.append(out)
        weights = top_k_weights.reshape(-1).index_select(0, order)[:, None]
        weighted = (torch.cat(pieces) * weights).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, tokens, weighted)
