"""Tiny random-weight models of real architectures, built in code and saved as HF folders.

Each is small enough for a CPU test (two layers, hidden size 64) yet keeps its architecture's
distinctive layers: fused qkv/gate_up (Phi-3), MLA projections and shared experts (DeepSeek-V3),
fused 3-D experts with or without biases (Qwen3-MoE, GPT-OSS, GLM-4-MoE, DeepSeek-V3), sliding
windows and sinks (GPT-OSS, Gemma 3), QK norms (Qwen3, OLMo 2, Gemma 3). The folder carries the
byte-level tokenizer that ships with tuneloop, so `--model DIR` serves it offline.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ARCHS",
    "DENSE",
    "MOE",
    "VOCAB",
    "build",
    "copy_tokenizer",
    "published_config",
    "save",
]

VOCAB = 259
_TOKENIZER = Path(str(resources.files("tuneloop") / "assets" / "tokenizers" / "byte-level"))

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": 258,
    "pad_token_id": 256,
}
_MOE: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _config(arch: str) -> Any:
    import transformers as tf

    head = {"head_dim": 16}
    deepseek_like = {
        **_MOE,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    }
    builders: dict[str, Callable[[], Any]] = {
        "llama": lambda: tf.LlamaConfig(**_COMMON, **head),
        "qwen2": lambda: tf.Qwen2Config(**_COMMON),
        "qwen3": lambda: tf.Qwen3Config(**_COMMON, **head),
        "mistral": lambda: tf.MistralConfig(**_COMMON, **head, sliding_window=None),
        "gemma3": lambda: tf.Gemma3TextConfig(**_COMMON, **head, sliding_window=16),
        "phi3": lambda: tf.Phi3Config(**_COMMON),
        "olmo2": lambda: tf.Olmo2Config(**_COMMON),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            **_COMMON, **head, **_MOE, num_experts=4, decoder_sparse_step=1
        ),
        "gpt_oss": lambda: tf.GptOssConfig(
            **{**_COMMON, "intermediate_size": 32},
            **head,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
        ),
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            **{**_COMMON, "num_key_value_heads": 4},  # MLA: one latent KV for every head
            **deepseek_like,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
        ),
        "glm4_moe": lambda: tf.Glm4MoeConfig(**_COMMON, **head, **deepseek_like),
    }
    return builders[arch]()


DENSE = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "olmo2")
MOE = ("qwen3_moe", "gpt_oss", "deepseek_v3", "glm4_moe")
ARCHS = DENSE + MOE


def build(arch: str, seed: int = 0, **shapes: Any) -> torch.nn.Module:
    """The tiny model, fp32 on the CPU, same weights for the same seed; `shapes` override
    config fields (a test whose kernels need wider heads)."""
    from transformers import AutoModelForCausalLM

    config = _config(arch)
    for name, value in shapes.items():
        setattr(config, name, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: torch.nn.Module = AutoModelForCausalLM.from_config(config)
    if arch == "gpt_oss":
        # Random init leaves GPT-OSS's expert biases and sinks at zero-ish; give them values so
        # the bias path is exercised.
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed + 1)
            for name, p in model.named_parameters():
                if name.endswith(("_bias", "sinks")):
                    p.normal_(0.0, 0.02)
    return model.eval()


def save(arch: str, folder: Path, seed: int = 0) -> Path:
    """`build(arch)` saved with the byte-level tokenizer as a plain HF folder."""
    model = build(arch, seed)
    model.save_pretrained(folder)  # type: ignore[operator]
    copy_tokenizer(folder)
    return folder


def copy_tokenizer(folder: Path) -> None:
    """The byte-level tokenizer (vocabulary `VOCAB`) into a model folder."""
    for item in _TOKENIZER.iterdir():
        shutil.copy2(item, folder / item.name)


def published_config(name: str) -> Any:
    """The shapes of a released model (its config.json on the hub), built in code: for
    estimates on the meta device, never for weights."""
    import transformers as tf

    if name == "gpt-oss-20b":
        return tf.GptOssConfig(
            vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
            num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
            num_experts_per_tok=4, tie_word_embeddings=False,
        )  # fmt: skip
    if name == "qwen3-30b-a3b":
        return tf.Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
            tie_word_embeddings=False,
        )  # fmt: skip
    raise KeyError(name)
