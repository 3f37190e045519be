"""A tiny GPT-OSS saved as the released checkpoints are: experts in MXFP4.

`quantise` and `dequantise` are a NumPy reference of the OCP microscaling format as GPT-OSS
stores it, written from the format (not from transformers): per block of 32 values one E8M0
exponent e (bias 127), chosen so the block's largest magnitude is within FP4's range
(2^(floor(log2 amax) - 2): E2M1's largest value is 6 = 1.5 x 2^2), and 32 FP4 E2M1 codes
(sign bit, then the index of the magnitude in `FP4_MAGNITUDES`), packed two per byte with the
even-indexed value in the low nibble. Tensors are laid out as on disk: `<name>_blocks`
[E, out, in/32, 16] and `<name>_scales` [E, out, in/32], where the model's parameter is
[E, in, out] (GPT-OSS's experts are transposed).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.zoo.archs import build, copy_tokenizer

__all__ = ["FP4_MAGNITUDES", "dequantise", "quantise", "save_mxfp4"]

FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BLOCK = 32
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
# As in openai/gpt-oss-20b's config.json.
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def quantise(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, in, out] float -> (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32])."""
    rows = np.swapaxes(weight.astype(np.float64), 1, 2)  # [E, out, in]
    e, out, inner = rows.shape
    assert inner % BLOCK == 0, inner
    x = rows.reshape(e, out, inner // BLOCK, BLOCK)
    amax = np.abs(x).max(axis=-1)
    with np.errstate(divide="ignore"):
        exponent = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -127).clip(-127, 127)
    y = x / np.exp2(exponent)[..., None]
    magnitude = np.abs(np.abs(y)[..., None] - FP4_MAGNITUDES).argmin(axis=-1)
    codes = (magnitude + 8 * np.signbit(y)).astype(np.uint8)  # [E, out, G, 32]; -0 keeps its sign
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # C order: numpy keeps the reduced input's strides, and safetensors writes the raw buffer.
    scales = np.ascontiguousarray((exponent + 127).astype(np.uint8))
    return np.ascontiguousarray(blocks.astype(np.uint8)), scales


def dequantise(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The exact values (float64) of what `quantise` wrote, in the model's [E, in, out]."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)
    sign = np.where(codes & 8, -1.0, 1.0)
    values = sign * FP4_MAGNITUDES[codes & 7] * np.exp2(scales.astype(np.float64) - 127)[..., None]
    e, out, groups, _ = values.shape
    return np.swapaxes(values.reshape(e, out, groups * BLOCK), 1, 2)


def save_mxfp4(folder: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """The zoo's GPT-OSS with its expert matrices written as MXFP4 blocks and scales (the rest
    fp32), the config's `quantization_config` as released. Returns every tensor written."""
    from safetensors.numpy import save_file

    model = build("gpt_oss", seed)
    model.config.save_pretrained(folder)  # type: ignore[operator]
    tensors: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().to(torch.float32).numpy()
        if name.endswith(EXPERT_PARAMETERS):
            blocks, scales = quantise(array)
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        else:
            tensors[name] = np.ascontiguousarray(array)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    config_path.write_text(json.dumps(config, indent=2))
    copy_tokenizer(folder)
    return tensors
