"""Whether a model fits a sharded group of N ranks: checked in the server before any worker
starts, from the model's config alone (a model built on the meta device: no weights loaded).

Per rank, at the least, a sharded group holds: its shard of the base weights (plus what stays
whole on every rank, a tied embedding), one adapter (a reference rank on every target, factors
and gradients in fp32) with AdamW's two moments, the sampler's KV cache (on a CPU the
configured pool; on a GPU, where the pool takes a share of what is free, one full-context
sequence), and the activations of the smallest training micro-batch. A group whose ranks cannot
hold that is refused with the numbers; one that can is described the same way, and the
workers later report what they measure (sharded_runtime.rank_memory).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tuneloop.server.engine.memory import (
    MIN_TOKEN_BUDGET,
    activation_bytes_per_token,
    free_bytes,
    kv_bytes_per_token,
)

__all__ = ["REFERENCE_RANK", "RankPlan", "check_fits", "meta_model", "plan_model", "rank_capacity"]

# The adapter the plan reserves room for: LoRA rank 32 on every target (attention, MLP,
# experts, LM head), the largest the cookbook's recipes use.
REFERENCE_RANK = 32
# Factors, their gradients and AdamW's moments are fp32 whatever the base weights' dtype.
_FACTOR_BYTES = 4
# The LM head's logits for one chunk (logprobs.py caps a chunk at 2^26 elements), fp32, with
# their log-softmax.
_HEAD_ELEMENTS = 1 << 26


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@dataclass(frozen=True)
class RankPlan:
    """Bytes one rank of the group needs for one model."""

    model: str
    ranks: int
    weights: int  # its shard of the base weights plus the replicated part
    weights_total: int  # the whole model's base weights
    replicated: int  # weights whole on every rank (a tied embedding)
    adapter: int  # one REFERENCE_RANK adapter: factors and gradients
    optimizer: int  # that adapter's AdamW moments
    kv_cache: int
    activations: int  # the smallest training micro-batch (MIN_TOKEN_BUDGET tokens)

    @property
    def need(self) -> int:
        return self.weights + self.adapter + self.optimizer + self.kv_cache + self.activations

    def describe(self) -> str:
        return (
            f"{self.model} on {self.ranks} ranks, per rank: weights {_mib(self.weights)} "
            f"(1/{self.ranks} of {_mib(self.weights_total)}, {_mib(self.replicated)} "
            f"replicated), one rank-{REFERENCE_RANK} adapter {_mib(self.adapter)}, optimizer "
            f"{_mib(self.optimizer)}, KV cache {_mib(self.kv_cache)}, activations "
            f"{_mib(self.activations)}: {_mib(self.need)}"
        )


def meta_model(name: str, cache_dir: Path) -> nn.Module:
    """The model `name` resolves to (models.py's rules), built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tuneloop.server.engine import models

    if name in models._TINY_BUILDERS:
        with torch.device("meta"):
            return models._TINY_BUILDERS[name]()
    folder: Path
    if name == models.DEFAULT_MODEL:
        folder = models._smollm2_folder(cache_dir)
    elif Path(name).expanduser().is_dir():
        folder = Path(name).expanduser()
    else:
        folder = models._hub_snapshot(name)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(config)
    return model


def plan_model(
    name: str, model: nn.Module, ranks: int, dtype: torch.dtype, kv_tokens: int
) -> RankPlan:
    """What each of `ranks` ranks holds for `model` (a meta model) at `dtype`."""
    from tuneloop.server.engine.lora import AdapterBank, inject
    from tuneloop.server.engine.types import AdapterSpec

    element = torch.finfo(dtype).bits // 8
    embedding = model.get_input_embeddings().weight  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    params = list(model.parameters())  # tied weights once
    total = sum(p.numel() for p in params) * element
    replicated = embedding.numel() * element if head.weight is embedding else 0
    # Each sharded tensor's dim 0 is padded to a multiple of the ranks.
    shards = sum(
        math.ceil(p.shape[0] / ranks) * (p.numel() // max(1, p.shape[0])) * element
        for p in params
        if p is not embedding or not replicated
    )
    adapter = AdapterSpec("plan", name, REFERENCE_RANK, 0, train_experts=True)
    factors = AdapterBank(inject(copy.deepcopy(model))).trainable_parameters(adapter)
    config = model.config
    vocab = int(head.weight.shape[0])
    head_bytes = 2 * min(_HEAD_ELEMENTS, MIN_TOKEN_BUDGET * vocab) * 4
    return RankPlan(
        model=name,
        ranks=ranks,
        weights=shards + replicated,
        weights_total=total,
        replicated=replicated,
        adapter=2 * factors * _FACTOR_BYTES,
        optimizer=2 * factors * _FACTOR_BYTES,
        kv_cache=kv_tokens * kv_bytes_per_token(config, dtype),
        activations=MIN_TOKEN_BUDGET * activation_bytes_per_token(config, dtype) + head_bytes,
    )


def rank_capacity(device: torch.device, ranks_on_host: int) -> int | None:
    """Bytes one rank may use: a GPU's total memory, or this host's available memory shared by
    the ranks it runs (None: unknown, not checked)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    free = free_bytes(device)
    return None if free is None else free // max(1, ranks_on_host)


def check_fits(plans: Sequence[RankPlan], capacity: int | None) -> str:
    """The plan in words; raises ValueError naming the numbers when the ranks cannot hold the
    models' sum."""
    need = sum(p.need for p in plans)
    lines = [p.describe() for p in plans]
    if capacity is not None and need > capacity:
        ranks = plans[0].ranks
        raise ValueError(
            f"the models do not fit {ranks} sharded ranks: each rank needs {_mib(need)} and "
            f"has {_mib(capacity)}.\n" + "\n".join(lines) + "\nUse more ranks (--workers), "
            "a smaller dtype (--dtype bfloat16) or devices with more memory."
        )
    capacity_text = "unknown" if capacity is None else _mib(capacity)
    return "\n".join([*lines, f"per-rank memory: {capacity_text}"])
