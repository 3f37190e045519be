"""LoRA on a frozen `nn.Linear`: many adapters' factors in slots, applied per segment of rows."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from tuneloop.server.engine import packed
from tuneloop.server.engine.lora.ops import Factors, add_lora
from tuneloop.server.engine.lora.routing import RoutingContext
from tuneloop.server.engine.lora.slots import Slotted

__all__ = ["LoRALinear"]


class LoRALinear(Slotted):
    """A frozen Linear plus per-slot factors A [r, in], B [out, r]."""

    def __init__(
        self, base: nn.Linear, slot_of: Mapping[str, str], context: RoutingContext
    ) -> None:
        super().__init__(slot_of, context)
        self.base = base

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
        merged = routing.merged.get(id(self)) if routing is not None and routing.merged else None
        if merged is not None:
            return packed.linear(x, merged, self.base.bias)  # plain or packed (packed.py)
        out = self.base(x)
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
