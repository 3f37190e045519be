"""AdapterBank: every adapter and sampler snapshot on one base model, slot by slot.

An adapter gets a slot on each layer it targets (`slots.Slotted`); its factors are parameters
of the model from then on, until it is deleted. Before a forward pass the engine says which
adapter each batch row uses (`routed`, or `using` for a routing kept across decode steps); each
row then goes through its own adapter only, so one batch can mix tenants and a row's gradient
reaches only its adapter. An extra adapter costs its factors and optimizer state, never another
model copy. Factors leave and enter the bank in PEFT's checkpoint layout (`state`, `load`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterator, Mapping, Sequence

import torch
from torch import nn

from tuneloop.server.engine import packed
from tuneloop.server.engine.lora.experts import EXPERT_PARAMETERS, ExpertFactors
from tuneloop.server.engine.lora.fused import FusedLinear, fusable, sibling_groups
from tuneloop.server.engine.lora.linear import LoRALinear
from tuneloop.server.engine.lora.routing import LoneWeights, Routing
from tuneloop.server.engine.lora.segments import KeyDelta, KeyDeltas
from tuneloop.server.engine.lora.siblings import stack_weights
from tuneloop.server.engine.lora.slots import Slotted
from tuneloop.server.engine.lora.targets import Injected, groups_of
from tuneloop.server.engine.memory import COPY_SHARE, free_bytes
from tuneloop.server.engine.types import AdapterSpec, EngineError

__all__ = ["DELTA_KEYS", "AdapterBank", "peft_keys", "peft_targets"]

# At most this many keys' deltas for steps of several keys are kept (`AdapterBank.deltas`),
# the least recently used dropped first (made again in a few ms): a key's are about its
# factors' size in bf16, ~23 MB for rank 32 on all of SmolLM2-135M's linears.
DELTA_KEYS = 16
_BASE_DELTAS: KeyDeltas = {}  # the base model's rows add nothing (one object: kept segments)


def peft_keys(name: str, layer: Slotted) -> tuple[str, str]:
    """The lora_A / lora_B keys PEFT uses for one adapted layer.

    A Linear is `<module>.lora_A.weight`. The expert parameters of one module are wrapped by
    nested ParamWrappers in declaration order, the first innermost, so `gate_up_proj` is
    `<experts>.base_layer.lora_A.weight` and `down_proj` is `<experts>.lora_A.weight`.
    """
    if isinstance(layer, ExpertFactors):
        module, _, param = name.rpartition(".")
        depth = len(EXPERT_PARAMETERS) - 1 - EXPERT_PARAMETERS.index(param)
        name = module + ".base_layer" * depth
    return f"{name}.lora_A.weight", f"{name}.lora_B.weight"


def peft_targets(keys: Collection[str]) -> tuple[list[str], list[str]]:
    """PEFT's `target_modules` and `target_parameters` for factors under `keys` (`peft_keys`)."""
    modules: set[str] = set()
    parameters: set[str] = set()
    for key in keys:
        name = key.removesuffix(".lora_A.weight")
        if name == key:
            continue
        depth = 0
        while name.endswith(".base_layer"):
            name, depth = name.removesuffix(".base_layer"), depth + 1
        last = name.rsplit(".", 1)[-1]
        if last == "experts":  # adapted experts are always named so (targets.inject checks)
            param = EXPERT_PARAMETERS[len(EXPERT_PARAMETERS) - 1 - depth]
            parameters.add(".".join([*name.split(".")[-2:], param]))
        else:
            modules.add(last)
    if parameters:
        # On models with fused experts, peft (0.21, under transformers 5) rewrites the
        # target_modules gate_proj / up_proj / down_proj as the v4 names of expert weights and
        # drops them as modules, losing the dense MLP and shared-expert factors. Named as
        # target_parameters (their 2-D weights: the same factor layout and keys) they load.
        for dense in {"gate_proj", "up_proj", "down_proj"} & modules:
            modules.discard(dense)
            parameters.add(f"{dense}.weight")
    return sorted(modules), sorted(parameters)


# The base weights copied into a table's groups, with their versions then (`FusedLinear.versions`).
_Versions = list[tuple[torch.Tensor, int]]


def _versions(table: LoneWeights) -> _Versions:
    groups = {id(group): group for group, _ in table.values()}
    return [pair for group in groups.values() for pair in group.versions]


def _fresh(versions: _Versions) -> bool:
    """Whether no base weight copied into a table changed in place since (asked twice a
    decode step: one flat list, where each layer's group asked in turn cost ~1 ms a step)."""
    return all(weight._version == version for weight, version in versions)


class AdapterBank:
    """The LoRA factors of every adapter and sampler snapshot on one base model."""

    def __init__(self, injected: Injected) -> None:
        self.injected = injected
        self.modules: dict[str, Slotted] = dict(injected.layers)
        self.specs: dict[str, AdapterSpec] = {}
        self._slot_of = injected.slot_of  # shared with every layer
        self._trainable: set[str] = set()
        # One key's decode weights (`lone_weights`), kept while it is sampled alone.
        self._lone: tuple[tuple[str | None, bool], LoneWeights, _Versions] | None = None
        self._refused: tuple[str | None, bool] | None = None  # too large for free memory
        self._shared: LoneWeights | None = None  # the base weights of steps of several keys
        self._shared_versions: _Versions = []
        self._refused_shared = False
        # Per frozen key, its version and its groups' deltas for steps of several keys.
        self._deltas: dict[str, tuple[int, KeyDeltas]] = {}
        # Per live key, the count of changes to the bank when its factors were last set
        # (made, snapshotted, loaded): what a CUDA graph that read them checks (`version`).
        self._versions: dict[str, int] = {}
        self._changes = 0
        linears = {n: m for n, m in self.modules.items() if isinstance(m, LoRALinear)}
        for names in sibling_groups(list(linears), {n: m.base for n, m in linears.items()}):
            if len(names) > 1:  # (siblings.py: one training node per group)
                group = tuple(linears[n] for n in names)
                for index, module in enumerate(group):
                    module.siblings = (group, index)
                if all(fusable(m.base) for m in group):
                    stack_weights([m.base for m in group])

    # ---- slots --------------------------------------------------------------------------

    def _changed(self, key: str) -> None:
        self._changes += 1
        self._versions[key] = self._changes

    def version(self, key: str | None) -> int | None:
        """A number that changes whenever `key`'s factors are set anew (0: the base model), or
        None for a trainable adapter, whose factors change in place at every optimizer step."""
        if key is None:
            return 0
        if key in self._trainable or key not in self._versions:
            return None
        return self._versions[key]

    def _take_slot(self, key: str) -> str:
        self._changed(key)
        used = set(self._slot_of.values())
        slot = next(str(i) for i in range(len(used) + 1) if str(i) not in used)
        self._slot_of[key] = slot
        return slot

    def module_names(self, spec: AdapterSpec) -> list[str]:
        groups = groups_of(spec)
        return [n for n in self.modules if self.injected.group[n] in groups]

    def trainable_parameters(self, spec: AdapterSpec) -> int:
        """How many parameters an adapter of this spec trains on this model."""
        total = 0
        for name in self.module_names(spec):
            a_shape, b_shape = self.modules[name].factor_shapes(spec.rank)
            total += math.prod(a_shape) + math.prod(b_shape)
        return total

    def create(self, spec: AdapterSpec, device: torch.device) -> list[nn.Parameter]:
        """Fresh trainable factors: A like PEFT's default (Kaiming-uniform), B = 0, seeded."""
        if spec.adapter_id in self.specs:
            raise EngineError(f"adapter {spec.adapter_id!r} already exists", "user")
        names = self.module_names(spec)
        if not names:
            raise EngineError("the adapter targets no module of this model", "user")
        generator = torch.Generator().manual_seed(spec.seed)
        scale = spec.alpha / spec.rank
        slot = self._take_slot(spec.adapter_id)
        params: list[nn.Parameter] = []
        for name in names:
            module = self.modules[name]
            a_shape, b_shape = module.factor_shapes(spec.rank)
            bound = 1.0 / math.sqrt(a_shape[-1])
            a = torch.empty(a_shape).uniform_(-bound, bound, generator=generator)
            module.put(slot, a.to(device), torch.zeros(b_shape, device=device), scale, train=True)
            params += [module.lora_A[slot], module.lora_B[slot]]
        self.specs[spec.adapter_id] = spec
        self._trainable.add(spec.adapter_id)
        return params

    def _layers(self, key: str) -> Iterator[tuple[str, Slotted, nn.Parameter, nn.Parameter]]:
        slot = self._slot_of[key]
        for name in self.module_names(self.specs[key]):
            module = self.modules[name]
            yield name, module, module.lora_A[slot], module.lora_B[slot]

    def parameters(self, key: str) -> list[nn.Parameter]:
        if key not in self._trainable:
            raise EngineError(f"{key!r} is a frozen sampler, not a trainable adapter")
        out: list[nn.Parameter] = []
        for _, _, a, b in self._layers(key):
            out += [a, b]
        return out

    def snapshot(self, source: str, key: str) -> None:
        """A frozen copy of `source`'s factors under `key` (a sampler sees them as of now)."""
        spec = self.specs[source]
        slot = self._take_slot(key)
        for _, module, a, b in list(self._layers(source)):
            module.put(
                slot, a.detach().clone(), b.detach().clone(), spec.alpha / spec.rank, train=False
            )
        self.specs[key] = spec

    def state(self, key: str) -> dict[str, torch.Tensor]:
        """PEFT key -> factor ("<module>.lora_A.weight", ...), expert factors in PEFT's layout."""
        out: dict[str, torch.Tensor] = {}
        for name, module, a, b in self._layers(key):
            key_a, key_b = peft_keys(name, module)
            a_out, b_out = a.detach(), b.detach()
            if isinstance(module, ExpertFactors):
                a_out, b_out = module.to_peft(a_out, b_out)
            out[key_a], out[key_b] = a_out, b_out
        return out

    def _read(
        self, name: str, module: Slotted, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key_a, key_b = peft_keys(name, module)
        try:
            a, b = tensors[key_a], tensors[key_b]
        except KeyError as exc:
            raise EngineError(f"checkpoint lacks {exc.args[0]}", "user") from None
        if isinstance(module, ExpertFactors):
            if a.shape[0] % module.num_experts:
                raise EngineError(f"checkpoint factors for {name} do not fit its experts", "user")
            a, b = module.from_peft(a, b)
        return a, b

    def load(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy factors in place (trainable adapters keep their Parameter objects)."""
        self._forget_lone(key)
        self._changed(key)
        for name, module, a, b in list(self._layers(key)):
            new_a, new_b = self._read(name, module, tensors)
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
        names = self.module_names(spec)
        read = [(name, *self._read(name, self.modules[name], tensors)) for name in names]
        slot = self._take_slot(key)
        for name, a, b in read:
            module = self.modules[name]
            device = module.lora_device()
            # Fresh copies, never the file's buffers: a tensor read from safetensors sits at
            # its offset in the file, and some CPUs' fp32 matmul kernels round differently
            # for a factor that is not 64-byte aligned (an AVX-512 EPYC gave a saved
            # sampler's logprobs 3e-7 away from its in-memory snapshot's).
            module.put(
                slot,
                a.to(device, torch.float32, copy=True),
                b.to(device, torch.float32, copy=True),
                spec.alpha / spec.rank,
                train=False,
            )
        self.specs[key] = spec

    def lone_weights(self, key: str | None, *, merge: bool = False) -> LoneWeights | None:
        """Layer id -> (its group, its index there): the linear layers' weights for decode
        steps whose rows all use `key` (None: the base model), siblings stacked into one
        matmul each and `key`'s LoRA delta in extra columns, or merged into the rows with
        `merge` (fused.py). None for a trainable adapter (its factors change under it) and
        where the copy would take more than COPY_SHARE of the free memory. Expert layers
        keep their LoRA products. The weights of the last key asked for are kept (one copy
        of the targeted weights): a sampler's decode batches reuse them until it is deleted
        or `release_lone` (a GPU's sampling calls end with it)."""
        if key is not None and (key in self._trainable or key not in self.specs):
            return None
        if self._refused == (key, merge):
            return None
        held = self._lone  # (its freshness is read only when it is the one asked for)
        if held is not None and held[0] == (key, merge) and _fresh(held[2]):
            return held[1]
        self._lone = None  # the previous key's go first: never two copies of a key's at once
        table = self._build(key, merge)
        if table is None:
            self._refused = (key, merge)  # asked every step: not measured again until freed
            return None
        self._lone = ((key, merge), table, _versions(table))
        return table

    def shared_weights(self) -> LoneWeights | None:
        """Layer id -> (its group, its index there): the linear layers' base weights for decode
        steps whose rows use several keys, siblings stacked into one matmul each and packed for
        this CPU's kernels (fused.py, no LoRA columns); each key's LoRA products are then added
        to its rows' part of the output. Only where the weights pack (a CPU, packed.py): a
        plain stacked copy gains little for its memory. Kept beside the lone key's copy (a
        server alternates between steps of one tenant and steps of several) until
        `release_lone`; None where it is not made."""
        held = self._lone
        if held is not None and held[0][0] is None and _fresh(held[2]):
            return held[1]  # the base model's own lone copy is the same weights
        shared = self._shared
        if shared is not None and _fresh(self._shared_versions):
            return shared
        self._shared = None
        if self._refused_shared:
            return None
        self._shared = self._build(None, False, packed_only=True)
        self._shared_versions = _versions(self._shared) if self._shared else []
        self._refused_shared = self._shared is None
        return self._shared

    def deltas(self, key: str | None) -> KeyDeltas | None:
        """Layer id -> its sibling group's LoRA delta for `key` (segments.py), over the groups of
        `shared_weights`: what a step of several keys adds to `key`'s rows. Empty for the base
        model; None for a trainable adapter (its factors change at every optimizer step) or a
        key not in the bank. Built once per version of the key's factors."""
        if key is None:
            return _BASE_DELTAS
        version = self.version(key)
        if version is None or key not in self.specs:
            return None
        held = self._deltas.pop(key, None)  # (put back last: the most recently used)
        if held is None or held[0] != version:
            held = (version, self._build_deltas(key))
        self._deltas[key] = held
        while len(self._deltas) > DELTA_KEYS:
            del self._deltas[next(iter(self._deltas))]
        return held[1]

    def _build_deltas(self, key: str) -> KeyDeltas:
        linears = {
            n: m for n, m in self.modules.items() if isinstance(m, LoRALinear) and fusable(m.base)
        }
        table: KeyDeltas = {}
        for names in sibling_groups(list(linears), {n: m.base for n, m in linears.items()}):
            members = [linears[n] for n in names]
            dtype = members[0].base.weight.dtype
            sizes = [m.base.weight.shape[0] for m in members]
            delta = KeyDelta.build(sizes, [m.lookup(key) for m in members], dtype)
            if delta is not None:
                for module in members:
                    table[id(module)] = delta
        return table

    def _build(
        self, key: str | None, merge: bool, *, packed_only: bool = False
    ) -> LoneWeights | None:
        """The groups of `lone_weights` for `key`; None where no layer is fusable, where the
        copy would take more than COPY_SHARE of the free memory or, with `packed_only`, where
        the weights do not pack."""
        linears = {
            n: m for n, m in self.modules.items() if isinstance(m, LoRALinear) and fusable(m.base)
        }
        if not linears:
            return None
        first = next(iter(linears.values())).base.weight
        if packed_only and not packed.packable(first):
            return None
        need = sum(m.base.weight.numel() * m.base.weight.element_size() for m in linears.values())
        free = free_bytes(first.device)
        if free is not None and need > COPY_SHARE * free:
            return None  # a large model on a full device: keep the LoRA products
        table: LoneWeights = {}
        bases = {n: m.base for n, m in linears.items()}
        for names in sibling_groups(list(linears), bases):
            members = [linears[n] for n in names]
            factors = [m.lookup(key) if key is not None else None for m in members]
            group = FusedLinear.build([m.base for m in members], factors, merge=merge)
            for index, module in enumerate(members):
                table[id(module)] = (group, index)
        return table

    def _forget_lone(self, key: str) -> None:
        self._deltas.pop(key, None)
        if self._lone is not None and self._lone[0][0] == key:
            self._lone = None
        self._refused = None
        self._refused_shared = False  # (memory freed: a copy refused for it may fit now)

    @property
    def lone_bytes(self) -> int:
        """Memory of the lone key's weights, the shared base weights and the keys' deltas kept
        now (0: none)."""
        tables = [t for t in (self._lone[1] if self._lone else None, self._shared) if t]
        groups = {id(group): group for table in tables for group, _ in table.values()}
        deltas = {id(d): d for _, table in self._deltas.values() for d in table.values()}
        return sum(g.nbytes for g in groups.values()) + sum(d.nbytes for d in deltas.values())

    def release_lone(self) -> None:
        """Drop the weights kept for the last sampled key, the shared base weights and the
        keys' deltas (made again when asked)."""
        self._lone = None
        self._refused = None
        self._shared = None
        self._refused_shared = False
        self._deltas.clear()

    def delete(self, key: str) -> None:
        self._forget_lone(key)
        # (the count is global: a key made again later gets a number no graph has seen)
        self._versions.pop(key, None)
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            for module in self.modules.values():
                module.drop(slot)
        self.specs.pop(key, None)
        self._trainable.discard(key)

    # ---- routing ------------------------------------------------------------------------

    @contextlib.contextmanager
    def routed(
        self, row_keys: Sequence[str | None], lengths: Sequence[int] | None = None
    ) -> Iterator[None]:
        """Route batch rows to adapters for the forward passes inside the block.

        With `lengths`, the batch is one packed row and row_keys[i] covers lengths[i] tokens.
        """
        with self.using(self.routing(row_keys, lengths)):
            yield

    @staticmethod
    def routing(row_keys: Sequence[str | None], lengths: Sequence[int] | None = None) -> Routing:
        """`routed`'s routing, to be applied with `using` (in blocks that must be entered again
        with the same routing: a pass whose forward and backward run apart)."""
        if lengths is None:
            return Routing.from_rows(row_keys)
        return Routing.from_lengths(row_keys, lengths)

    @contextlib.contextmanager
    def using(self, routing: Routing) -> Iterator[None]:
        """Apply an existing routing inside the block (a decode batch keeps its own across steps,
        with the stacked factors it built). Blocks nest: the previous routing holds again after."""
        context = self.injected.context
        previous = context.routing
        context.routing = routing
        try:
            yield
        finally:
            context.routing = previous
