"""Token budgets sized from the memory the device has free.

A training micro-batch keeps its activations for the backward pass: per token and layer, a
handful of hidden-size vectors (norm inputs, attention q/k/v/output, residuals) and a few
intermediate-size ones (the MLP's gate, up and activation). Sizing the micro-batch by a fixed
token count either wastes a large GPU or swaps a small machine (SmolLM2-135M keeps ~1.4 MB per
token in fp32: 8192 tokens is ~12 GB). So the budget is a share of the memory free when the
model loads, divided by that per-token estimate.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine.causal_cpu import MATMUL_MAX_TOKENS

log = logging.getLogger(__name__)

# Share of the free memory one micro-batch's activations may take: the rest is for the
# optimizer, the sampler's KV cache, other processes and the estimate's error.
ACTIVATION_SHARE = 0.4
MIN_TOKEN_BUDGET = 512
MAX_TOKEN_BUDGET = 65536
# Saved vectors per token and layer (see the module docstring); measured on SmolLM2-135M the
# estimate is within ~20 % of the process's peak growth.
_HIDDEN_VECTORS = 10
_INTERMEDIATE_VECTORS = 4
# The most bytes of LM-head logits a training pass keeps for its backward instead of recomputing
# them (fused_head.py; a head that runs as its own module keeps one position chunk's logits and
# log-softmax, as much), set aside from the per-token cost: 8 x 256 tokens of a 49k-vocabulary
# head in fp32 fit, 8k tokens of a 150k one do not.
SAVED_LOGITS_BYTES = 1 << 29
_HEAD_BYTES = SAVED_LOGITS_BYTES
# The most of a device's free memory (where it can be read) one copy of the adapted layers'
# weights made for speed may take: a decode step's merged or fused copy (lora/bank.py), a
# training pass's packed copies (lora/native_summed.py); past it they keep the plain products.
COPY_SHARE = 0.25


def free_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on `device`, or None when it cannot be read."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    meminfo = Path("/proc/meminfo")
    if device.type == "cpu" and meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def attention_heads(config: Any) -> tuple[int, int, int]:
    """A model config's query heads, key/value heads and head size (a multimodal config's text
    part; no `head_dim`: the hidden size split over the heads)."""
    text = getattr(config, "text_config", None) or config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or int(text.hidden_size) // heads)
    return heads, kv_heads, head_dim


def activation_bytes_per_token(
    config: Any, dtype: torch.dtype, device: torch.device | None = None
) -> int:
    """Estimated bytes a trained token keeps for the backward pass, all layers. On a CPU in
    bf16/fp16, attention also keeps each query's probabilities over its sequence, heads x
    length, for lengths up to causal_cpu.py's MATMUL_MAX_TOKENS."""
    text = getattr(config, "text_config", None) or config
    hidden = int(text.hidden_size)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    layers = int(text.num_hidden_layers)
    element = torch.finfo(dtype).bits // 8
    vectors = _HIDDEN_VECTORS * hidden + _INTERMEDIATE_VECTORS * intermediate
    if device is not None and device.type == "cpu" and element == 2:
        heads, _, _ = attention_heads(config)
        vectors += heads * MATMUL_MAX_TOKENS
    return layers * vectors * element


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes one cached token takes in the sampler's KV cache: a key and a value per layer."""
    text = getattr(config, "text_config", None) or config
    _, kv_heads, head_dim = attention_heads(config)
    element = torch.finfo(dtype).bits // 8
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * element


def training_token_budget(config: Any, dtype: torch.dtype, device: torch.device) -> int:
    """Tokens per training micro-batch: ACTIVATION_SHARE of free memory, clamped."""
    free = free_bytes(device)
    if free is None:
        return 8192
    per_token = activation_bytes_per_token(config, dtype, device)
    budget = int((free * ACTIVATION_SHARE - _HEAD_BYTES) // per_token)
    chosen = max(MIN_TOKEN_BUDGET, min(MAX_TOKEN_BUDGET, budget))
    log.info(
        "training micro-batches of up to %d tokens (%.1f GB free, ~%.2f MB per token)",
        chosen,
        free / 1e9,
        per_token / 1e6,
    )
    return chosen


# Share of the memory free when the sampler's KV pool is made (on a GPU) that the pool takes:
# the rest is for training activations, the LM head's logits and the estimate's error.
KV_SHARE = 0.3
# On a CPU the memory is shared with training's activations and other processes, so the pool
# takes a smaller share; its pages are touched only as requests fill them (torch.empty), so a
# pool larger than a workload needs costs nothing. At least CPU_MIN_KV_TOKENS (what every
# host got before); at most CPU_MAX_KV_TOKENS (a tiny model's pool would otherwise count
# millions of blocks). SmolLM2-135M at bf16 keeps 23 KB a token; 32 prompts of 100-200
# tokens x 4 samples x 384 new ones (math_rl's max_tokens) reserve ~54k tokens, which a fixed
# 32,768 ran in two waves of rows.
CPU_KV_SHARE = 0.2
CPU_MIN_KV_TOKENS = 32768
CPU_MAX_KV_TOKENS = 262144


def kv_cache_tokens(
    config: Any, dtype: torch.dtype, device: torch.device, token_budget: int | None
) -> int:
    """Tokens of the sampler's KV pool: `token_budget` where one is configured; else a share
    of the memory free now, KV_SHARE on a GPU, CPU_KV_SHARE on a CPU (within
    [CPU_MIN_KV_TOKENS, CPU_MAX_KV_TOKENS])."""
    if token_budget is not None:
        return token_budget
    free = free_bytes(device)
    if free is None:
        return CPU_MIN_KV_TOKENS
    per_token = kv_bytes_per_token(config, dtype)
    if device.type == "cuda":
        return int(free * KV_SHARE) // per_token
    tokens = int(free * CPU_KV_SHARE) // per_token
    return max(CPU_MIN_KV_TOKENS, min(CPU_MAX_KV_TOKENS, tokens))


def kv_cache_blocks(
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    token_budget: int | None,
) -> int:
    """Blocks of the sampler's KV pool (`kv_cache_tokens`), logged."""
    tokens = kv_cache_tokens(config, dtype, device, token_budget)
    blocks = max(1, tokens // block_size)
    log.info(
        "sampler KV cache: %d blocks of %d tokens (%.2f GB)",
        blocks,
        block_size,
        blocks * block_size * kv_bytes_per_token(config, dtype) / 1e9,
    )
    return blocks


# A trained adapter parameter costs its fp32 value, its gradient and AdamW's two moments.
ADAPTER_BYTES_PER_PARAMETER = 16


def adapter_memory(
    config: Any,
    rank: int,
    *,
    train_attn: bool = True,
    train_mlp: bool = True,
    train_unembed: bool = True,
    train_experts: bool | None = None,
) -> tuple[int, int]:
    """(parameters, bytes) of a rank-`rank` adapter with its gradients and AdamW state on a
    model of `config`, built on the meta device (no weights), with the targets the engine
    gives it (`lora/targets.py`: per-expert factors on fused MoE experts included)."""
    from transformers import AutoModelForCausalLM

    from tuneloop.server.engine.lora import AdapterBank, inject
    from tuneloop.server.engine.types import AdapterSpec

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = AdapterSpec(
        "estimate", "", rank, 0, train_mlp, train_attn, train_unembed, train_experts=train_experts
    )
    parameters = AdapterBank(inject(model)).trainable_parameters(spec)
    return parameters, parameters * ADAPTER_BYTES_PER_PARAMETER
