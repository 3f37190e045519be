"""LoRA on a frozen `nn.Linear`: many adapters' factors in slots, applied per segment of rows."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from tuneloop.server.engine.lora import ops, siblings
from tuneloop.server.engine.lora.fused import plain_frozen, take, taken
from tuneloop.server.engine.lora.ops import Factors, add_lora
from tuneloop.server.engine.lora.routing import Routing, RoutingContext
from tuneloop.server.engine.lora.slots import Slotted

__all__ = ["LoRALinear"]


class LoRALinear(Slotted):
    """A frozen Linear plus per-slot factors A [r, in], B [out, r]."""

    def __init__(
        self, base: nn.Linear, slot_of: Mapping[str, str], context: RoutingContext
    ) -> None:
        super().__init__(slot_of, context)
        self.base = base
        # The layers fed the same input, this one among them, and its index there (set by the
        # bank: fused.py's sibling groups): one autograd node for the group in training.
        self.siblings: tuple[tuple[LoRALinear, ...], int] | None = None

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def _base_parameters(self) -> Iterator[torch.Tensor]:
        yield self.base.weight

    def factor_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (rank, self.in_features), (self.out_features, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self._context.routing
        lone = routing.lone.get(id(self)) if routing is not None and routing.lone else None
        if lone is not None:
            return lone[0].output(lone[1], x)  # one matmul for the group (fused.py)
        fused = self._one_adapter(x, routing)
        if fused is not None:
            return fused
        shared = routing.shared.get(id(self)) if routing is not None and routing.shared else None
        if shared is not None and routing is not None and routing.deltas is not None:
            # each key's delta added to its rows of the group's shared output (segments.py)
            return shared[0].output(shared[1], x, routing.segments(id(self)))
        out = self.base(x) if shared is None else shared[0].output(shared[1], x)
        if routing is None or not routing.runs:
            return out
        factors: list[Factors | None] = [
            self.lookup_as(key, out.dtype) for key, _, _ in routing.runs
        ]
        if all(f is None for f in factors):
            return out
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
        cache = routing.stacked.setdefault(id(self), {})
        return add_lora(flat_out, flat_x, routing.sizes(flat_x.shape[0]), factors, cache).view(
            out.shape
        )

    def _one_adapter(self, x: torch.Tensor, routing: Routing | None) -> torch.Tensor | None:
        """Base and delta as one autograd node (`ops.one_adapter_linear`) for one adapter over
        every row through a plain, frozen `nn.Linear`, where a graph is recorded or, outside
        sampling steps, the weights are half precision (there the node sums the delta with the
        base before rounding, as a decode step's fused weights do); with its siblings one node
        for the group where every one of them qualifies (siblings.py); None elsewhere (the
        base and `add_lora` then run)."""
        if routing is None or len(routing.runs) != 1:
            return None
        if not torch.is_grad_enabled() and (
            routing.steps or self.base.weight.dtype not in ops.HALF
        ):
            return None  # (a sampling step: the lone key's fused weights, or the products)
        if not plain_frozen(self.base):
            return None  # a sharded, hooked or trained layer runs its own forward
        weight, bias = self.base.weight, self.base.bias
        if x.dtype != weight.dtype or ops.kernel_on(x.device):
            return None
        grouped = self.siblings if siblings._GROUPED else None
        if grouped is not None:
            # the group's node ran for this very input (its first member checked every
            # member): this member's output, without asking each member again
            held = taken(routing.siblings, id(grouped[0]), grouped[1], x)
            if held is not None:
                return held
        key = routing.runs[0][0]
        factors = self.lookup_as(key, weight.dtype)
        if factors is None or factors[0].dtype != weight.dtype:
            return None
        if grouped is not None:
            group, index = grouped
            found = [_groupable(m, key, x) for m in group]
            if all(f is not None for f in found):
                return take(
                    routing.siblings, id(group), index, x, lambda: _group_outputs(group, found, x)
                )
        return ops.one_adapter_linear(x, weight, bias, factors)


def _groupable(module: LoRALinear, key: str | None, x: torch.Tensor) -> Factors | None:
    """A sibling's factors for `key` in x's dtype where it can join its group's node: a plain
    frozen layer in x's dtype (its bias too), `key`'s factors in it; else None."""
    base = module.base
    if not plain_frozen(base) or base.weight.dtype != x.dtype:
        return None
    if base.bias is not None and base.bias.dtype != x.dtype:
        return None
    factors = module.lookup_as(key, x.dtype)
    return factors if factors is not None and factors[0].dtype == x.dtype else None


def _group_outputs(
    group: tuple[LoRALinear, ...], factors: list[Factors | None], x: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    weights = [m.base.weight for m in group]
    biases = [m.base.bias for m in group]
    return siblings.sibling_linears(x, weights, factors, biases)  # type: ignore[arg-type]
