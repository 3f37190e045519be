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
    """Which adapter each batch row uses, as runs of consecutive rows: (key, start, end).

    A key of None, or one without factors for a module, means the base model alone. Runs keep
    every slice a view: the engine lays a batch out request by request, so one adapter's rows
    are usually consecutive. A "row" is a unit of the flattened leading dimensions: a batch row
    of a padded [B, T] batch, or a token of a packed [1, T] row (`from_lengths`).
    """

    runs: list[tuple[str | None, int, int]] = field(default_factory=list)
    # Per layer, the stacked factors of the grouped path, built once per routed block (a whole
    # decode loop): re-stacking them every step cost more than the matmuls they replace.
    stacked: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )

    @classmethod
    def from_rows(cls, row_keys: Sequence[str | None]) -> Routing:
        runs: list[tuple[str | None, int, int]] = []
        for index, key in enumerate(row_keys):
            if runs and runs[-1][0] == key:
                runs[-1] = (key, runs[-1][1], index + 1)
            else:
                runs.append((key, index, index + 1))
        return cls(runs)

    @classmethod
    def from_lengths(cls, keys: Sequence[str | None], lengths: Sequence[int]) -> Routing:
        """Token runs of a packed row: segment i, of lengths[i] tokens, uses keys[i]."""
        runs: list[tuple[str | None, int, int]] = []
        start = 0
        for key, length in zip(keys, lengths, strict=True):
            if runs and runs[-1][0] == key:
                runs[-1] = (key, runs[-1][1], start + length)
            else:
                runs.append((key, start, start + length))
            start += length
        return cls(runs)


class LoRALinear(nn.Module):
    """A frozen Linear plus per-adapter factors, applied per run of rows of one adapter."""

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

    def _delta(self, key: str | None, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        factors = self.factors.get(key) if key is not None else None
        if factors is None:
            return None  # the base model alone, or an adapter that does not target this layer
        a, b, scale = factors
        # 2-D matmuls (3-D ones fall into a slow batched kernel on CPU), the scale applied to
        # the small [tokens, r] product (not to B, [out, r], re-scaled on every call: 1.5M
        # elements for a 49k-vocab head, per adapter, per decode step).
        flat = x.reshape(-1, x.shape[-1]).to(a.dtype)
        return (((flat @ a.t()) * scale) @ b.t()).view(*x.shape[:-1], -1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.routing is None:
            return out
        runs = self.routing.runs
        if len(runs) == 1:  # one adapter for the whole batch, the common case
            delta = self._delta(runs[0][0], x, out.dtype)
            return out if delta is None else out + delta
        grouped = self._grouped_delta(runs, x, out.dtype)
        if grouped is not None:
            return out + grouped
        # Several adapters: split into runs, add each run's delta, concatenate once. (An
        # index_add per adapter copied the whole output each time; slicing instead of split
        # makes the backward pass zero-fill a full-size gradient per run.) Runs count rows of
        # the flattened leading dimensions, so one split serves padded and packed batches.
        per_row = x.numel() // x.shape[-1] // runs[-1][2]
        sizes = [(end - start) * per_row for _, start, end in runs]
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
        pieces = []
        for (key, _, _), x_run, out_run in zip(
            runs, flat_x.split(sizes), flat_out.split(sizes), strict=True
        ):
            delta = self._delta(key, x_run, out.dtype)
            pieces.append(out_run if delta is None else out_run + delta)
        return torch.cat(pieces, dim=0).view(out.shape)

    def _grouped_delta(
        self, runs: list[tuple[str | None, int, int]], x: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """All adapters' deltas in two batched matmuls, when the runs allow it.

        Needs equal-size runs whose adapters all target this layer with one rank: the decode
        steps of a batch of requests with the same num_samples. There, per-adapter matmuls of a
        few rows each cost more in per-operation overhead than in arithmetic (measured: 8
        adapters x 1 row per decode step ran at 0.6x of one adapter x 8 rows).
        """
        size = runs[0][2] - runs[0][1]
        factors = [self.factors.get(key) if key is not None else None for key, _, _ in runs]
        if any(f is None for f in factors) or any(end - start != size for _, start, end in runs):
            return None
        present = [f for f in factors if f is not None]
        if len({f[0].shape[0] for f in present}) != 1:
            return None
        assert self.routing is not None
        if id(self) not in self.routing.stacked:
            a = torch.stack([f[0] for f in present])  # [G, r, in]
            b = torch.stack([f[1] for f in present])  # [G, out, r]
            scale = torch.tensor([f[2] for f in present], dtype=a.dtype, device=a.device)
            self.routing.stacked[id(self)] = (a, b, scale)
        a, b, scale = self.routing.stacked[id(self)]
        groups = x.reshape(len(runs), -1, x.shape[-1]).to(a.dtype)  # [G, rows x tokens, in]
        low = torch.bmm(groups, a.transpose(1, 2)) * scale[:, None, None]  # [G, n, r]
        return torch.bmm(low, b.transpose(1, 2)).view(*x.shape[:-1], -1).to(dtype)


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
    def routed(
        self, row_keys: Sequence[str | None], lengths: Sequence[int] | None = None
    ) -> Iterator[None]:
        """Route batch rows to adapters for the forward passes inside the block.

        With `lengths`, the batch is one packed row and row_keys[i] covers lengths[i] tokens.
        """
        routing = (
            Routing.from_rows(row_keys)
            if lengths is None
            else Routing.from_lengths(row_keys, lengths)
        )
        with self.using(routing):
            yield

    @contextlib.contextmanager
    def using(self, routing: Routing) -> Iterator[None]:
        """Apply an existing routing inside the block (a decode batch keeps its own across steps,
        with the stacked factors it built). Blocks nest: the previous routing holds again after."""
        previous = {name: module.routing for name, module in self.modules.items()}
        for module in self.modules.values():
            module.routing = routing
        try:
            yield
        finally:
            for name, module in self.modules.items():
                module.routing = previous[name]
