"""Per-adapter slots of one adapted layer: factors registered as parameters of the module tree.

Every adapted layer holds `lora_A` / `lora_B` ParameterDicts keyed by slot ("0", "1", ...); the
bank gives each adapter (or frozen sampler snapshot) one slot on every layer it targets when it
is created and takes it back when it is deleted, so adapters come and go at run time without
re-wrapping the model, and `model.named_parameters()` (FSDP, torch.compile, optimizers) sees
them. Trainable slots hold parameters with requires_grad; snapshots hold frozen ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from tuneloop.server.engine.lora.routing import RoutingContext

__all__ = ["FactorView", "Slotted"]


class Slotted(nn.Module):
    """The slot storage and routing shared by LoRALinear and LoRAExperts."""

    def __init__(self, slot_of: Mapping[str, str], context: RoutingContext) -> None:
        super().__init__()
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.scales: dict[str, float] = {}
        # key -> slot name, owned by the bank and shared by every layer of the model.
        self._slot_of = slot_of
        self._context = context

    @property
    def routing(self) -> object:
        return self._context.routing

    @property
    def factors(self) -> FactorView:
        return FactorView(self)

    def factor_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        raise NotImplementedError

    def lora_device(self) -> torch.device:
        """Where this layer's factors live: beside the frozen weights."""
        return next(p.device for p in self._base_parameters())

    def _base_parameters(self) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def put(
        self, slot: str, a: torch.Tensor, b: torch.Tensor, scale: float, *, train: bool
    ) -> None:
        self.lora_A[slot] = nn.Parameter(a, requires_grad=train)
        self.lora_B[slot] = nn.Parameter(b, requires_grad=train)
        self.scales[slot] = scale

    def drop(self, slot: str) -> None:
        if slot in self.scales:
            del self.lora_A[slot], self.lora_B[slot], self.scales[slot]

    def lookup(self, key: str | None) -> tuple[nn.Parameter, nn.Parameter, float] | None:
        slot = self._slot_of.get(key) if key is not None else None
        if slot is None or slot not in self.scales:
            return None  # the base model alone, or an adapter that does not target this layer
        return self.lora_A[slot], self.lora_B[slot], self.scales[slot]

    def lookup_as(
        self, key: str | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """`lookup`'s factors in `dtype`, the activations' (mixed precision, as autocast does it).

        The factors stay fp32 masters, trained by an fp32 AdamW; the products run in the
        engine dtype, so on bf16 weights the LoRA matmuls use the bf16 matrix units, and no
        activation is copied to fp32 and back per layer. The cast is made once per routed block
        (every layer call of a forward pass, the checkpointed LM-head recompute and a whole
        decode loop share it) and is part of the graph: gradients reach the fp32 masters.
        """
        found = self.lookup(key)
        if found is None or found[0].dtype == dtype:
            return found
        a, b, scale = found
        routing = self._context.routing
        slot = self._slot_of[key]  # type: ignore[index]  # lookup found it
        cache = routing.cast if routing is not None else {}
        pair = cache.get((id(self), slot))
        if pair is None or pair[0].dtype != dtype:
            pair = cache[(id(self), slot)] = (a.to(dtype), b.to(dtype))
        return pair[0], pair[1], scale


class FactorView(Mapping[str, tuple[nn.Parameter, nn.Parameter, float]]):
    """key -> (A, B, scale) of one layer, read through the bank's slot table."""

    def __init__(self, module: Slotted) -> None:
        self._module = module

    def __getitem__(self, key: str) -> tuple[nn.Parameter, nn.Parameter, float]:
        found = self._module.lookup(key)
        if found is None:
            raise KeyError(key)
        return found

    def __iter__(self) -> Iterator[str]:
        return (k for k, slot in self._module._slot_of.items() if slot in self._module.scales)

    def __len__(self) -> int:
        return sum(1 for _ in self)
