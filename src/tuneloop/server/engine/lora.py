"""Multi-tenant LoRA over one frozen base model.

Every targeted `nn.Linear` of the base model is wrapped in a `LoRALinear` that holds the low-rank
factors of any number of adapters (training adapters and frozen sampler snapshots alike). Before a
forward pass the engine says which adapter each batch row uses (`routing`); each row then goes
through its own adapter only, so one batch can mix tenants and a row's gradient reaches only its
adapter. An extra adapter costs its factors and optimizer state, never another model copy.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from tuneloop.server.engine.types import AdapterSpec, EngineError

# Module-name suffixes per target group: Llama, Qwen2/3, Mistral and Gemma 3 all use these names.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGETS = ("lm_head",)


def targets_of(spec: AdapterSpec) -> tuple[str, ...]:
    return (
        (ATTENTION_TARGETS if spec.train_attn else ())
        + (MLP_TARGETS if spec.train_mlp else ())
        + (UNEMBED_TARGETS if spec.train_unembed else ())
    )


@dataclass
class Routing:
    """Which adapter each batch row uses: adapter key -> row indices (None: every row).

    Rows absent from every group use the base model alone.
    """

    groups: list[tuple[str, torch.Tensor | None]] = field(default_factory=list)

    @classmethod
    def from_rows(cls, row_keys: Sequence[str | None], device: torch.device) -> Routing:
        rows: dict[str, list[int]] = {}
        for index, key in enumerate(row_keys):
            if key is not None:
                rows.setdefault(key, []).append(index)
        if len(rows) == 1 and len(next(iter(rows.values()))) == len(row_keys):
            # One adapter for the whole batch (the common case): no gather/scatter of rows.
            return cls([(next(iter(rows)), None)])
        return cls([(k, torch.tensor(v, device=device)) for k, v in rows.items()])


class LoRALinear(nn.Module):
    """A frozen Linear plus per-adapter factors, applied grouped by adapter over batch rows."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        # key -> (A [r, in], B [out, r], scale); plain dict: adapters are not model parameters.
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self.routing: Routing | None = None

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.routing is None:
            return out
        for key, rows in self.routing.groups:
            factors = self.factors.get(key)
            if factors is None:
                continue  # this adapter does not target this module
            a, b, scale = factors
            x_rows = x if rows is None else x.index_select(0, rows)
            # 2-D matmuls (3-D ones fall into a slow batched kernel on CPU), the scale folded
            # into B ([r, out]) rather than applied to the [tokens, out] result.
            flat = x_rows.reshape(-1, x.shape[-1]).to(a.dtype)
            delta = ((flat @ a.t()) @ (b.t() * scale)).view(*x_rows.shape[:-1], -1)
            if rows is None:
                out = out + delta.to(out.dtype)
            else:
                out = out.index_add(0, rows, delta.to(out.dtype))
        return out


def inject(model: nn.Module) -> dict[str, LoRALinear]:
    """Wrap every targetable Linear of `model` in place; returns name -> wrapper."""
    suffixes = ATTENTION_TARGETS + MLP_TARGETS + UNEMBED_TARGETS
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in suffixes:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            wrapper = LoRALinear(module)
            setattr(parent, child, wrapper)
            wrapped[name] = wrapper
    return wrapped


class AdapterBank:
    """The LoRA factors of every adapter and sampler snapshot on one base model."""

    def __init__(self, modules: Mapping[str, LoRALinear]) -> None:
        self.modules = dict(modules)
        self.specs: dict[str, AdapterSpec] = {}

    def module_names(self, spec: AdapterSpec) -> list[str]:
        targets = targets_of(spec)
        return [n for n in self.modules if n.rsplit(".", 1)[-1] in targets]

    def create(self, spec: AdapterSpec, device: torch.device) -> list[nn.Parameter]:
        """Fresh trainable factors: A like PEFT's default (Kaiming-uniform), B = 0, seeded."""
        if spec.adapter_id in self.specs:
            raise EngineError(f"adapter {spec.adapter_id!r} already exists", "user")
        names = self.module_names(spec)
        if not names:
            raise EngineError("the adapter targets no module of this model", "user")
        generator = torch.Generator().manual_seed(spec.seed)
        params: list[nn.Parameter] = []
        scale = spec.alpha / spec.rank
        for name in names:
            module = self.modules[name]
            bound = 1.0 / math.sqrt(module.in_features)
            a = torch.empty(spec.rank, module.in_features).uniform_(
                -bound, bound, generator=generator
            )
            a_param = nn.Parameter(a.to(device))
            b_param = nn.Parameter(torch.zeros(module.out_features, spec.rank, device=device))
            module.factors[spec.adapter_id] = (a_param, b_param, scale)
            params += [a_param, b_param]
        self.specs[spec.adapter_id] = spec
        return params

    def parameters(self, key: str) -> list[nn.Parameter]:
        out: list[nn.Parameter] = []
        for name in self.module_names(self.specs[key]):
            a, b, _ = self.modules[name].factors[key]
            if not (isinstance(a, nn.Parameter) and isinstance(b, nn.Parameter)):
                raise EngineError(f"{key!r} is a frozen sampler, not a trainable adapter")
            out += [a, b]
        return out

    def snapshot(self, source: str, key: str) -> None:
        """A frozen copy of `source`'s factors under `key` (a sampler sees them as of now)."""
        spec = self.specs[source]
        for name in self.module_names(spec):
            a, b, scale = self.modules[name].factors[source]
            self.modules[name].factors[key] = (a.detach().clone(), b.detach().clone(), scale)
        self.specs[key] = spec

    def state(self, key: str) -> dict[str, torch.Tensor]:
        """module name -> factors, in PEFT's naming ("<module>.lora_A.weight", ...)."""
        out: dict[str, torch.Tensor] = {}
        for name in self.module_names(self.specs[key]):
            a, b, _ = self.modules[name].factors[key]
            out[f"{name}.lora_A.weight"] = a.detach()
            out[f"{name}.lora_B.weight"] = b.detach()
        return out

    def load(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy factors in place (trainable adapters keep their Parameter objects)."""
        spec = self.specs[key]
        for name in self.module_names(spec):
            a, b, _ = self.modules[name].factors[key]
            try:
                new_a = tensors[f"{name}.lora_A.weight"]
                new_b = tensors[f"{name}.lora_B.weight"]
            except KeyError as exc:
                raise EngineError(f"checkpoint lacks {exc.args[0]}", "user") from None
            if new_a.shape != a.shape or new_b.shape != b.shape:
                raise EngineError(
                    f"checkpoint factors for {name} have shape {list(new_a.shape)}, expected "
                    f"{list(a.shape)} (rank or model mismatch)",
                    "user",
                )
            with torch.no_grad():
                a.copy_(new_a)
                b.copy_(new_b)

    def add_frozen(self, key: str, spec: AdapterSpec, tensors: Mapping[str, torch.Tensor]) -> None:
        """Register frozen factors read from disk (a sampler of a saved checkpoint)."""
        scale = spec.alpha / spec.rank
        names = self.module_names(spec)
        for name in names:
            module = self.modules[name]
            a = tensors.get(f"{name}.lora_A.weight")
            b = tensors.get(f"{name}.lora_B.weight")
            if a is None or b is None:
                raise EngineError(f"checkpoint lacks factors for {name}", "user")
            device = module.base.weight.device
            module.factors[key] = (a.to(device).float(), b.to(device).float(), scale)
        self.specs[key] = spec

    def delete(self, key: str) -> None:
        for module in self.modules.values():
            module.factors.pop(key, None)
        self.specs.pop(key, None)

    @contextlib.contextmanager
    def routed(self, row_keys: Sequence[str | None], device: torch.device) -> Iterator[None]:
        """Route batch rows to adapters for the forward passes inside the block."""
        routing = Routing.from_rows(row_keys, device)
        for module in self.modules.values():
            module.routing = routing
        try:
            yield
        finally:
            for module in self.modules.values():
                module.routing = None
