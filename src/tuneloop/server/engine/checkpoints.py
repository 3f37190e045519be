"""Adapter checkpoints on disk, in the PEFT layout, written atomically.

A checkpoint folder holds `adapter_model.safetensors` (keys
`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`; LoRA on fused MoE experts in the
form of PEFT's `target_parameters`) and `adapter_config.json`, so
`peft.PeftModel.from_pretrained(base, folder)` loads it; a training state adds
`optimizer.pt` (AdamW moments and step counts) and `tuneloop_state.json`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tuneloop.server.engine.files import atomic_directory, directory_size
from tuneloop.server.engine.lora import peft_targets
from tuneloop.server.engine.types import AdapterSpec, EngineError

_PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "tuneloop_state.json"
# What PEFT's config has no field for (the seed and target groups), kept beside it: an extra key
# in adapter_config.json makes peft warn about an unknown argument.
ADAPTER_META_FILE = "tuneloop_adapter.json"


def peft_config(spec: AdapterSpec, keys: Collection[str]) -> dict[str, Any]:
    """PEFT's adapter config for factors under `keys` (the layers the adapter really has)."""
    modules, parameters = peft_targets(keys)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": spec.base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "target_modules": modules,
    }
    if parameters:
        config["target_parameters"] = parameters
    return config


def adapter_meta(spec: AdapterSpec) -> dict[str, Any]:
    return {
        "seed": spec.seed,
        "train_mlp": spec.train_mlp,
        "train_attn": spec.train_attn,
        "train_unembed": spec.train_unembed,
        "train_experts": spec.train_experts,
    }


def write_adapter(
    directory: Path,
    spec: AdapterSpec,
    factors: Mapping[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None = None,
    steps: int = 0,
) -> int:
    with atomic_directory(directory) as tmp:
        tensors = {
            _PEFT_PREFIX + k: v.detach().float().cpu().contiguous() for k, v in factors.items()
        }
        save_file(tensors, str(tmp / ADAPTER_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(peft_config(spec, factors.keys()), indent=1))
        (tmp / ADAPTER_META_FILE).write_text(json.dumps(adapter_meta(spec)))
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
            (tmp / STATE_FILE).write_text(json.dumps({"steps": steps}))
    return directory_size(directory)


def read_factors(directory: Path) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(str(directory / ADAPTER_FILE))
    except FileNotFoundError:
        raise EngineError(f"no adapter weights in checkpoint {directory.name!r}", "user") from None
    for name, tensor in tensors.items():
        # Refused where it would enter the engine: a NaN adapter would answer NaN to its user.
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise EngineError(
                f"checkpoint {directory.name!r} holds non-finite weights ({name})", "user"
            )
    return {k.removeprefix(_PEFT_PREFIX): v for k, v in tensors.items()}


def read_spec(directory: Path, adapter_id: str) -> AdapterSpec:
    config = json.loads((directory / CONFIG_FILE).read_text())
    meta_path = directory / ADAPTER_META_FILE
    extra = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    return AdapterSpec(
        adapter_id=adapter_id,
        base_model=config["base_model_name_or_path"],
        rank=int(config["r"]),
        seed=int(extra.get("seed", 0)),
        train_mlp=bool(extra.get("train_mlp", True)),
        train_attn=bool(extra.get("train_attn", True)),
        train_unembed=bool(extra.get("train_unembed", True)),
        alpha=float(config["lora_alpha"]),
        train_experts=extra.get("train_experts"),
    )


def read_optimizer(directory: Path) -> dict[str, Any]:
    path = directory / OPTIMIZER_FILE
    if not path.exists():
        raise EngineError("checkpoint holds no optimizer state", "user")
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state
