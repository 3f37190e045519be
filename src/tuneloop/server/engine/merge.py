"""Merged export: base model + LoRA adapter folded into one plain Hugging Face model folder.

The result needs no tuneloop and no peft to load (`AutoModelForCausalLM.from_pretrained`), and
gives the same logits as the server's forward pass with that adapter.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from tuneloop.server.engine import checkpoints
from tuneloop.server.engine.files import TOKENIZER_FILES, atomic_directory
from tuneloop.server.engine.lora.experts import EXPERT_PARAMETERS, is_fused_experts
from tuneloop.server.engine.models import load_model
from tuneloop.server.engine.types import AdapterSpec, EngineError


@torch.no_grad()
def merge_into(model: nn.Module, spec: AdapterSpec, factors: Mapping[str, torch.Tensor]) -> int:
    """W += (alpha / r) * B @ A for every factor pair (per expert for fused MoE experts, from
    PEFT's `target_parameters` layout); returns how many weights changed."""
    scale = spec.alpha / spec.rank
    merged = 0
    for name, module in model.named_modules():
        if is_fused_experts(module):
            merged += _merge_experts(name, module, factors, scale)
            continue
        a = factors.get(f"{name}.lora_A.weight")
        b = factors.get(f"{name}.lora_B.weight")
        if a is None or b is None:
            continue
        if not isinstance(module, nn.Linear):
            raise EngineError(f"{name} is not a Linear layer; cannot merge", "user")
        if name.endswith("lm_head") and getattr(model.config, "tie_word_embeddings", False):
            # The unembedding shares its weight with the input embedding: untie it first, or
            # the merge would change the embeddings too.
            module.weight = nn.Parameter(module.weight.detach().clone(), requires_grad=False)
            model.config.tie_word_embeddings = False  # type: ignore[union-attr]
        delta = (b.float() @ a.float()) * scale
        module.weight += delta.to(module.weight.dtype)
        merged += 1
    return merged


def _merge_experts(
    name: str, module: nn.Module, factors: Mapping[str, torch.Tensor], scale: float
) -> int:
    """Per expert e, W[e] += scale * B_e @ A_e, in the parameter's own layout."""
    merged = 0
    transposed = bool(getattr(module, "is_transposed", False))
    for index, param_name in enumerate(EXPERT_PARAMETERS):
        prefix = name + ".base_layer" * (len(EXPERT_PARAMETERS) - 1 - index)
        a = factors.get(f"{prefix}.lora_A.weight")
        b = factors.get(f"{prefix}.lora_B.weight")
        if a is None or b is None:
            continue
        param = getattr(module, param_name)
        experts = param.shape[0]
        a3 = a.float().reshape(experts, -1, a.shape[-1])  # [E, r, in]
        b3 = b.float().reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # [E, out, r]
        delta = torch.bmm(b3, a3) * scale  # [E, out, in]
        if transposed:
            delta = delta.transpose(1, 2)
        param += delta.to(param.dtype)
        merged += 1
    return merged


def export_merged(adapter_dir: Path, out_dir: Path, *, cache_dir: Path) -> Path:
    """Write base + the adapter in `adapter_dir` (PEFT layout) as a plain HF folder."""
    spec = checkpoints.read_spec(adapter_dir, "export")
    loaded = load_model(
        spec.base_model, cache_dir=cache_dir, device=torch.device("cpu"), dtype=torch.float32
    )
    if merge_into(loaded.model, spec, checkpoints.read_factors(adapter_dir)) == 0:
        raise EngineError("the adapter has no factors for this base model", "user")
    with atomic_directory(out_dir) as tmp:
        loaded.model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
        for name in TOKENIZER_FILES:  # generation_config.json is written by save_pretrained
            if (tmp / name).exists():
                continue
            source = loaded.spec.tokenizer_dir / name
            if source.is_file():
                shutil.copy2(source, tmp / name)
    return out_dir
