"""Every zoo architecture through the torch engine, served from its HF folder (`--model DIR`):
coverage, training, sampling = forward logprobs (with the LoRA products and on fused decode
weights), resume with optimizer state, and both exports (PEFT, with expert LoRA as
`target_parameters`; merged) loaded by peft / plain transformers."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.unit.engine.conftest import adam, example, forward, ok, params, seq, train, work
from tests.zoo.archs import ARCHS, MOE
from tests.zoo.conftest import model_folder
from tuneloop.server.engine import checkpoints, merge
from tuneloop.server.engine.torch_backend import TorchBackend
from tuneloop.server.engine.types import AdapterSpec, SampleWork

# fp32 throughout; the exports differ from base + LoRA by rounding only.
ATOL = 2e-4


def _logprobs(model: Any, tokens: np.ndarray) -> np.ndarray:
    ids = torch.tensor(tokens[None], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits.float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])
    return picked[0, :, 0].numpy()


def _sample_work(sampler_id: str, prompt: np.ndarray) -> SampleWork:
    return SampleWork(sampler_id, prompt, 1, 6, 1.0, -1, 1.0, 5, (), ())


@pytest.mark.parametrize("arch", ARCHS)
def test_zoo_model_trains_samples_resumes_and_exports(
    arch: str, zoo_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = str(model_folder(zoo_dir, arch))
    be = TorchBackend([folder], cache_dir=tmp_path / "cache", device="cpu", dtype=torch.float32)
    try:
        [runtime] = be._runtimes.values()
        coverage = runtime.bank.injected.coverage
        assert coverage.share() >= 0.95, coverage
        assert (coverage.covered["experts"] > 0) == (arch in MOE)

        spec = AdapterSpec("A", folder, rank=4, seed=1)
        be.create_adapter(spec)
        data = [example(seq(12, i)) for i in range(3)]
        before = forward(be, "A", data)
        train(be, "A", data, steps=4, lr=2e-2)
        after = forward(be, "A", data)
        assert np.mean([-x.mean() for x in after]) < np.mean([-x.mean() for x in before]) - 0.05

        # The sampler (KV cache, decode steps) gives the logprobs the forward pass gives.
        be.create_sampler("S", folder, adapter_id="A")
        prompt = seq(7, 9)
        [result] = [ok(r) for r in be.sample([_sample_work("S", prompt)])]
        sampled = result.sequences[0]
        full = np.concatenate([prompt, np.asarray(sampled.tokens, dtype=np.int64)])
        [scored] = forward(be, "A", [example(full)])
        np.testing.assert_allclose(
            sampled.logprobs, scored[len(prompt) - 1 :], atol=ATOL, err_msg=arch
        )
        # The same on the fused decode weights (lora/fused.py; the default where a CPU packs
        # bf16): sibling layers stacked (biases too), the delta in extra columns.
        be.fuse_lone_key = True
        [fused] = [ok(r) for r in be.sample([_sample_work("S", prompt)])]
        assert runtime.bank.lone_bytes > 0
        assert fused.sequences[0].tokens == sampled.tokens
        np.testing.assert_allclose(
            fused.sequences[0].logprobs, sampled.logprobs, atol=ATOL, err_msg=arch
        )
        be.fuse_lone_key = None

        # Save with the optimizer, resume into another adapter: the next step agrees exactly.
        state_dir = tmp_path / "state"
        be.save_state("A", state_dir, optimizer=True)
        be.create_adapter(AdapterSpec("B", folder, rank=4, seed=2))
        be.load_state("B", state_dir, optimizer=True)
        for key in ("A", "B"):
            ok(be.forward_backward([work(key, data)])[0])
            be.optim_step(key, adam(2e-2))
        assert all(
            torch.equal(a, b)
            for a, b in zip(params(be, "A").values(), params(be, "B").values(), strict=True)
        )

        served = forward(be, "A", data[:1])[0]
        weights = tmp_path / "weights"
        be.save_sampler_weights("A", weights)
    finally:
        be.close()

    config = json.loads((weights / checkpoints.CONFIG_FILE).read_text())
    assert ("target_parameters" in config) == (arch in MOE)
    tokens = np.concatenate([data[0].tokens, data[0].inputs["target_tokens"][-1:]])
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with warnings.catch_warnings():  # peft 0.21 reads an attribute transformers 5 deprecated
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        peft_model = PeftModel.from_pretrained(base, str(weights))
    np.testing.assert_allclose(_logprobs(peft_model, tokens), served, atol=ATOL, err_msg=arch)

    merged_dir = merge.export_merged(weights, tmp_path / "merged", cache_dir=tmp_path / "cache")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    np.testing.assert_allclose(_logprobs(merged, tokens), served, atol=ATOL, err_msg=arch)


def test_a_model_with_layers_lora_cannot_adapt_is_refused_at_load(tmp_path: Path) -> None:
    """GPT-2's attention and MLP are `Conv1D` layers (c_attn, c_proj, c_fc): no target group
    has them, so serving it would train the LM head alone; the load is refused instead."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.zoo.archs import VOCAB, copy_tokenizer
    from tuneloop.server.engine.types import EngineError

    folder = tmp_path / "gpt2"
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4, n_positions=128)
    GPT2LMHeadModel(config).save_pretrained(folder)
    copy_tokenizer(folder)
    with pytest.raises(
        EngineError, match=r"cannot adapt: Conv1D \(e\.g\. transformer\.h\.0\."
    ) as info:
        TorchBackend([str(folder)], cache_dir=tmp_path / "cache", device="cpu")
    assert info.value.category == "user"


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_mixed_tenant_batches_on_moe_give_each_adapter_its_solo_gradient(
    arch: str, zoo_dir: Path, tmp_path: Path
) -> None:
    """Two adapters in one packed batch: each one's expert (and other) gradients are those of
    its own requests run alone."""
    from tests.unit.engine.conftest import assert_near, grads

    folder = str(model_folder(zoo_dir, arch))
    be = TorchBackend([folder], cache_dir=tmp_path / "cache", device="cpu", dtype=torch.float32)
    try:
        for key, seed in (("A", 1), ("B", 2)):
            be.create_adapter(AdapterSpec(key, folder, rank=4, seed=seed))
            train(be, key, [example(seq(10, seed))], steps=1, lr=5e-2)  # B != 0 everywhere
        mine = {"A": [example(seq(9, 3)), example(seq(6, 4))], "B": [example(seq(11, 5))]}
        solo = {}
        for key, data in mine.items():
            ok(be.forward_backward([work(key, data)])[0])
            solo[key] = grads(be, key)
            be.optim_step(key, adam(0.0))  # clears the gradients, changes nothing at lr 0
        for result in be.forward_backward([work(k, d) for k, d in mine.items()]):
            ok(result)
        for key in mine:
            assert_near(grads(be, key), solo[key], 1e-5, f"{arch} {key}", relative=True)
    finally:
        be.close()


def test_experts_are_a_target_group_of_their_own(zoo_dir: Path, tmp_path: Path) -> None:
    """`train_experts` splits the experts from `train_mlp` (None: they follow it), and a saved
    adapter keeps the choice."""
    folder = str(model_folder(zoo_dir, "deepseek_v3"))  # dense MLPs, shared and routed experts
    be = TorchBackend([folder], cache_dir=tmp_path / "cache", device="cpu", dtype=torch.float32)
    try:
        [runtime] = be._runtimes.values()
        bank = runtime.bank

        def groups(**flags: Any) -> set[str]:
            spec = AdapterSpec("x", folder, rank=2, seed=0, **flags)
            return {bank.injected.group[name] for name in bank.module_names(spec)}

        everything = {"attention", "mlp", "experts", "unembed"}
        assert groups() == everything
        assert groups(train_experts=False) == everything - {"experts"}
        assert groups(train_mlp=False, train_experts=True) == everything - {"mlp"}
        assert groups(train_mlp=False) == {"attention", "unembed"}

        spec = AdapterSpec("E", folder, rank=2, seed=0, train_attn=False, train_mlp=False,
                           train_unembed=False, train_experts=True)  # fmt: skip
        be.create_adapter(spec)
        train(be, "E", [example(seq(10, 1))], steps=1)
        be.save_state("E", tmp_path / "e", optimizer=True)
        assert checkpoints.read_spec(tmp_path / "e", "E2") == AdapterSpec(
            "E2", folder, 2, 0, False, False, False, spec.alpha, True
        )
        config = json.loads((tmp_path / "e" / checkpoints.CONFIG_FILE).read_text())
        assert config["target_modules"] == []
        assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
        be.create_adapter(checkpoints.read_spec(tmp_path / "e", "E2"))
        be.load_state("E2", tmp_path / "e", optimizer=True)
        assert all(
            torch.equal(a, b)
            for a, b in zip(params(be, "E").values(), params(be, "E2").values(), strict=True)
        )
    finally:
        be.close()
