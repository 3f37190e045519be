"""GPT-OSS's MXFP4 expert weights: loaded dequantised, with the memory that takes.

The released GPT-OSS checkpoints store every MoE expert matrix in MXFP4 (OCP microscaling):
`<name>_blocks`, uint8 [E, out, in/32, 16], two FP4 E2M1 codes per byte (low nibble first), and
`<name>_scales`, uint8 [E, out, in/32], one E8M0 exponent (bias 127) per block of 32 values;
config.json says `quantization_config: {"quant_method": "mxfp4", ...}`. Everything else
(attention, router, embeddings, head, expert biases) is bf16.

The engine loads such a folder through transformers' own MXFP4 loader with
`Mxfp4Config(dequantize=True)`: each expert tensor is expanded by a 16-entry lookup table and
`ldexp` by its block's exponent straight into the parameter's dtype, so a value is exact in bf16
and fp32 (FP4 times a power of two). It never keeps them quantised: transformers' quantised
experts (`Mxfp4GptOssExperts`, Triton kernels) are inference-only and replace the 3-D weights
that expert LoRA (`lora/experts.py`) adds its per-expert factors to; without Triton and the
`kernels` package (a CPU, most installs) transformers dequantises anyway. The cost is memory:
4.25 bits per expert weight on disk become 16 in bf16 (`footprint`; GPT-OSS-20B: 19.1 B expert
weights, 10.2 GB on disk, 38.2 GB as bf16).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine.types import EngineError

__all__ = [
    "BLOCK_VALUES",
    "QUANTISED_PARAMETERS",
    "Footprint",
    "Stored",
    "footprint",
    "from_pretrained_kwargs",
    "is_mxfp4",
    "log_dequantised",
    "stored_bytes",
]

log = logging.getLogger(__name__)

BLOCK_VALUES = 32  # values sharing one E8M0 scale
# What transformers' MXFP4 quantizer stores quantised (its `serialized_names`): the two fused
# expert matrices of every MoE layer; their biases stay bf16.
QUANTISED_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
_SUFFIXES = ("_blocks", "_scales")


def _packed_bytes(values: int) -> int:
    """Bytes of `values` MXFP4 values: half a byte each, plus one scale byte per block."""
    return values // 2 + values // BLOCK_VALUES


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def _quant_method(folder: Path) -> str | None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return str(method).lower() if method is not None else None


def is_mxfp4(folder: Path) -> bool:
    """Whether the model folder's config.json declares MXFP4 weights."""
    return _quant_method(folder) == "mxfp4"


def from_pretrained_kwargs(folder: Path) -> dict[str, Any]:
    """Extra `from_pretrained` arguments for `folder`: MXFP4 dequantised on load, else none."""
    if not is_mxfp4(folder):
        return {}
    from transformers.utils.quantization_config import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


@dataclass(frozen=True)
class Stored:
    """What a folder's safetensors hold in MXFP4: quantised tensors, their values and bytes."""

    tensors: int
    values: int
    nbytes: int


def stored_bytes(folder: Path) -> Stored:
    """Counted from the safetensors headers (no tensor is read): every `*_blocks` tensor with
    its `*_scales`."""
    from safetensors import safe_open

    tensors = values = nbytes = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if not key.endswith(_SUFFIXES):
                    continue
                shape = f.get_slice(key).get_shape()
                count = 1
                for dim in shape:
                    count *= int(dim)
                nbytes += count  # uint8
                if key.endswith("_blocks"):
                    tensors += 1
                    values += 2 * count
    return Stored(tensors=tensors, values=values, nbytes=nbytes)


@dataclass(frozen=True)
class Footprint:
    """Memory of a model whose experts ship in MXFP4, computed from its config."""

    parameters: int  # every parameter of the model
    expert_values: int  # of which stored as MXFP4
    expert_disk_bytes: int  # those on disk: FP4 codes and E8M0 scales
    disk_bytes: int  # the whole checkpoint, the rest in `other_disk_dtype`
    expert_memory_bytes: int  # the experts resident, dequantised to the engine dtype
    memory_bytes: int  # the whole model resident in the engine dtype


def footprint(
    config: Any, dtype: torch.dtype, other_disk_dtype: torch.dtype = torch.bfloat16
) -> Footprint:
    """Built on the meta device from `config` (no weights): the parameters transformers stores
    as MXFP4 (`QUANTISED_PARAMETERS`) and what they take on disk and, as `dtype`, in memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = experts = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if name.endswith(QUANTISED_PARAMETERS):
            experts += param.numel()
    element = torch.finfo(dtype).bits // 8
    other = torch.finfo(other_disk_dtype).bits // 8
    expert_disk = _packed_bytes(experts)
    return Footprint(
        parameters=total,
        expert_values=experts,
        expert_disk_bytes=expert_disk,
        disk_bytes=expert_disk + (total - experts) * other,
        expert_memory_bytes=experts * element,
        memory_bytes=total * element,
    )


def log_dequantised(name: str, folder: Path, model: torch.nn.Module) -> None:
    """Log what dequantising `folder`'s MXFP4 experts cost; refuse a model left quantised."""
    stored = stored_bytes(folder)
    values = nbytes = 0
    dtype = torch.float32
    for pname, param in model.named_parameters():
        if pname.endswith(QUANTISED_PARAMETERS):
            if not param.is_floating_point():  # transformers' quantised experts: no LoRA there
                raise EngineError(f"model {name!r}: {pname} is still quantised", "server")
            values += param.numel()
            nbytes += param.numel() * param.element_size()
            dtype = param.dtype
    if values != stored.values:
        raise EngineError(
            f"model {name!r}: {stored.values} MXFP4 values on disk but {values} expert weights "
            "loaded",
            "user",
        )
    log.info(
        "%s: %d MXFP4 expert tensors (%.2fM values) dequantised to %s: %s on disk "
        "(FP4 blocks + E8M0 scales) -> %s in memory",
        name,
        stored.tensors,
        values / 1e6,
        str(dtype).removeprefix("torch."),
        _size(stored.nbytes),
        _size(nbytes),
    )
