"""A base model's frozen weights sharded across the ranks with FSDP2 (`fully_shard`).

Each decoder layer is one FSDP group, the decoder body (embeddings, final norm) another and an
untied LM head a third: the engine calls the body (`get_decoder()`) and the head
(`get_output_embeddings()`) separately, never the model's own forward, so each must carry its
own hooks. A head tied to the input embeddings is one parameter that FSDP2 cannot place in two
groups; it stays whole on every rank (`ignored_params`), which costs one vocab x hidden matrix
per rank (21 % of SmolLM2-135M, under 2 % of a 7B model).

Every group reshards after its forward (also the root, which FSDP2 would otherwise keep whole
from forward to backward, and forever in a decode loop that has no backward): between calls a
rank holds its 1/N of each sharded weight and nothing more, and each forward all-gathers one
layer at a time.

LoRA factors are not sharded: they are created after this runs (adapters come and go), so
FSDP2 never manages them; they stay plain tensors, identical on every rank, and the gradients
they get are local (no reduce-scatter). Every rank runs the same batch (see sharded_runtime.py),
so those gradients are already equal on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tuneloop.server.engine.lora.experts import EXPERT_PARAMETERS, LoRAExperts
from tuneloop.server.engine.lora.linear import LoRALinear

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ShardedWeights", "local_bytes", "shard_model"]


@dataclass(frozen=True)
class ShardedWeights:
    """What `shard_model` did: bytes of base weights this rank holds and the model's total."""

    groups: int  # FSDP groups (decoder layers + body + untied head)
    local_bytes: int  # this rank's storage of base weights after sharding
    total_bytes: int  # the unsharded model's base weights
    replicated_bytes: int  # weights left whole on every rank (a tied embedding)


def _storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes this process stores for `tensor` (a DTensor: its local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.untyped_storage().nbytes())


def _base_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters(remove_duplicate=True) if ".lora_" not in n]


def local_bytes(model: nn.Module) -> int:
    """This rank's storage of the base model's weights (adapters excluded), from the parameters'
    storages: a sharded weight counts its local shard (with FSDP2's padding), a whole one all."""
    return sum(_storage_bytes(p) for _, p in _base_parameters(model))


def shard_model(model: nn.Module, mesh: DeviceMesh) -> ShardedWeights:
    """Shard `model`'s frozen base weights over `mesh` (a 1-D DeviceMesh) in place."""
    from torch.distributed.fsdp import fully_shard

    total = sum(p.numel() * p.element_size() for _, p in _base_parameters(model))
    body: nn.Module = model.get_decoder()  # type: ignore[operator]
    head: nn.Module = model.get_output_embeddings()  # type: ignore[operator]
    embeddings: nn.Module = model.get_input_embeddings()  # type: ignore[operator]
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__} has no decoder layers to shard")
    embedding = embeddings.weight
    assert isinstance(embedding, nn.Parameter)
    tied = head.weight is embedding
    ignored: set[nn.Parameter] = {embedding} if tied else set()
    device = torch.device(mesh.device_type)
    for param in ignored:  # fully_shard moves what it shards to the mesh's device, not these
        param.data = param.data.to(device)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(body, mesh=mesh, reshard_after_forward=True, ignored_params=ignored)
    groups = len(layers) + 1
    if not tied:
        # An adapted head is a LoRALinear whose output is a view; FSDP2 warns on views from a
        # group's root (in-place edits of them would skip its backward hook): shard the Linear.
        target = head.base if isinstance(head, LoRALinear) else head
        fully_shard(target, mesh=mesh, reshard_after_forward=True)
        groups += 1
    _repoint_expert_factors(model)
    return ShardedWeights(
        groups=groups,
        local_bytes=local_bytes(model),
        total_bytes=total,
        replicated_bytes=sum(p.numel() * p.element_size() for p in ignored),
    )


def _repoint_expert_factors(model: nn.Module) -> None:
    """Expert factors keep a reference to their 3-D expert weight (for its shape and device);
    fully_shard replaced that weight with its shard, and the old reference would keep the whole
    tensor alive on every rank."""
    for module in model.modules():
        if isinstance(module, LoRAExperts):
            for name in EXPERT_PARAMETERS:
                module.factors_of[name]._param = [getattr(module.base, name)]
