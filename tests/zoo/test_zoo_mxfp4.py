"""GPT-OSS with its experts in MXFP4, as released: the loader dequantises exactly what was
written, the engine trains and samples the result, and the memory it takes is what the config
says."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.engine.conftest import example, forward, ok, seq, train
from tests.zoo.archs import published_config
from tests.zoo.mxfp4 import EXPERT_PARAMETERS, dequantise, quantise, save_mxfp4
from tuneloop.server.engine import merge, mxfp4
from tuneloop.server.engine.models import load_model
from tuneloop.server.engine.torch_backend import TorchBackend
from tuneloop.server.engine.types import AdapterSpec, SampleWork

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return folder, save_mxfp4(folder)


def test_the_reference_quantiser_round_trips_and_matches_transformers() -> None:
    """What `quantise` writes, `dequantise` reads back, and transformers' own dequantiser reads
    the same bytes to the same values; quantising those values again gives the same bytes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    # Magnitudes over many binades, exact zeros and a zero block, both signs.
    weight = rng.standard_normal((3, 64, 48)) * np.exp2(rng.integers(-12, 6, (3, 1, 48)))
    weight[0, :5, 0] = 0.0
    weight[1, :32, 7] = 0.0
    blocks, scales = quantise(weight)
    assert blocks.shape == (3, 48, 2, 16)
    assert scales.shape == (3, 48, 2)
    values = dequantise(blocks, scales)
    assert np.abs(values - weight).max() > 0  # FP4 is lossy...
    # ...by less than 2 x 2^e in a block of exponent e: FP4's widest step (4 to 6) is 2, and a
    # block's largest magnitude, in [4, 8) x 2^e, is clamped to 6 x 2^e.
    per_block = np.exp2(scales.astype(np.float64) - 127)
    step = np.repeat(np.swapaxes(per_block, 1, 2), 32, axis=1)
    assert np.all(np.abs(values - weight) < 2.0 * step)
    again_blocks, again_scales = quantise(values)
    np.testing.assert_array_equal(again_scales, scales)
    np.testing.assert_array_equal(again_blocks, blocks)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype
        )
        np.testing.assert_array_equal(theirs.to(torch.float64).numpy(), values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_mxfp4_folder_loads_dequantised_to_exactly_what_was_written(
    written: tuple[Path, dict[str, np.ndarray]],
    tmp_path: Path,
    dtype: torch.dtype,
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder, tensors = written
    assert mxfp4.is_mxfp4(folder)
    with caplog.at_level(logging.INFO, logger="tuneloop.server.engine.mxfp4"):
        loaded = load_model(str(folder), cache_dir=tmp_path, device=CPU, dtype=dtype)
    state = loaded.model.state_dict()
    experts = 0
    for name, param in state.items():
        assert param.dtype == dtype, name
        if name.endswith(EXPERT_PARAMETERS):
            experts += 1
            reference = dequantise(tensors[f"{name}_blocks"], tensors[f"{name}_scales"])
            # FP4 code x 2^k is exact in bf16 and fp32 alike: equality, not closeness.
            np.testing.assert_array_equal(param.to(torch.float64).numpy(), reference, name)
        else:
            expected = torch.from_numpy(tensors[name]).to(dtype)
            assert torch.equal(param, expected), name
    assert experts == 2 * 2  # two layers, gate_up and down
    # Resident as a plain model: nothing quantised left, no marker a save would write back.
    assert getattr(loaded.model, "hf_quantizer", None) is None
    assert "quantization_config" not in loaded.model.config.to_dict()
    [message] = [r.getMessage() for r in caplog.records if r.name == mxfp4.log.name]
    assert "4 MXFP4 expert tensors" in message
    assert "in memory" in message


def test_stored_bytes_and_the_footprint_agree_with_the_folder(
    written: tuple[Path, dict[str, np.ndarray]],
) -> None:
    from transformers import AutoConfig

    folder, tensors = written
    stored = mxfp4.stored_bytes(folder)
    quantised = [a for k, a in tensors.items() if k.endswith(("_blocks", "_scales"))]
    assert stored.tensors == 4
    assert stored.nbytes == sum(a.nbytes for a in quantised)
    assert stored.values == sum(2 * a.size for k, a in tensors.items() if k.endswith("_blocks"))
    estimate = mxfp4.footprint(AutoConfig.from_pretrained(folder), torch.float32, torch.float32)
    assert estimate.expert_values == stored.values
    assert estimate.expert_disk_bytes == stored.nbytes
    assert estimate.disk_bytes == sum(a.nbytes for a in tensors.values())
    assert estimate.parameters == stored.values + sum(
        a.size for k, a in tensors.items() if not k.endswith(("_blocks", "_scales"))
    )


def test_gpt_oss_20b_footprint_from_its_published_config() -> None:
    """The figures docs/operations.md states (config.json of openai/gpt-oss-20b, no weights)."""
    config = published_config("gpt-oss-20b")
    bf16 = mxfp4.footprint(config, torch.bfloat16)
    # 24 layers x 32 experts x (2880 x 5760 gate_up + 2880 x 2880 down)
    assert bf16.expert_values == 24 * 32 * 3 * 2880 * 2880 == 19_110_297_600
    assert bf16.parameters == 20_914_757_184
    assert bf16.expert_disk_bytes == bf16.expert_values * 17 // 32  # 4.25 bits a value
    assert round(bf16.disk_bytes / 1e9, 2) == 13.76  # the released safetensors: 13.8 GB
    assert round(bf16.expert_memory_bytes / 1e9, 1) == 38.2
    assert round(bf16.memory_bytes / 1e9, 1) == 41.8
    assert mxfp4.footprint(config, torch.float32).memory_bytes == 2 * bf16.memory_bytes


def test_a_plain_folder_gets_no_quantisation_arguments(tmp_path: Path) -> None:
    assert mxfp4.from_pretrained_kwargs(tmp_path) == {}  # no config.json at all
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert mxfp4.from_pretrained_kwargs(tmp_path) == {}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"bits": 4}}))
    assert not mxfp4.is_mxfp4(tmp_path)


def test_the_dequantised_model_trains_samples_and_exports_merged(
    written: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    folder = str(written[0])
    be = TorchBackend([folder], cache_dir=tmp_path / "cache", device="cpu", dtype=torch.float32)
    try:
        [runtime] = be._runtimes.values()
        assert runtime.bank.injected.coverage.covered["experts"] > 0  # expert LoRA on them
        be.create_adapter(AdapterSpec("A", folder, rank=4, seed=1))
        data = [example(seq(12, i)) for i in range(3)]
        before = forward(be, "A", data)
        train(be, "A", data, steps=4, lr=2e-2)
        after = forward(be, "A", data)
        assert np.mean([-x.mean() for x in after]) < np.mean([-x.mean() for x in before]) - 0.05

        be.create_sampler("S", folder, adapter_id="A")
        prompt = seq(7, 9)
        work = SampleWork("S", prompt, 1, 6, 1.0, -1, 1.0, 5, (), ())
        [result] = [ok(r) for r in be.sample([work])]
        sampled = result.sequences[0]
        full = np.concatenate([prompt, np.asarray(sampled.tokens, dtype=np.int64)])
        [scored] = forward(be, "A", [example(full)])
        np.testing.assert_allclose(sampled.logprobs, scored[len(prompt) - 1 :], atol=2e-4)
        served = forward(be, "A", data[:1])[0]
        weights = tmp_path / "weights"
        be.save_sampler_weights("A", weights)
    finally:
        be.close()

    # The merged export is a plain bf16/fp32 folder: no MXFP4 marker, loads without a quantizer.
    merged_dir = merge.export_merged(weights, tmp_path / "merged", cache_dir=tmp_path / "cache")
    assert "quantization_config" not in json.loads((merged_dir / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    tokens = np.concatenate([data[0].tokens, data[0].inputs["target_tokens"][-1:]])
    ids = torch.tensor(tokens[None], dtype=torch.long)
    with torch.no_grad():
        logits = merged(input_ids=ids[:, :-1]).logits.float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[0, :, 0]
    np.testing.assert_allclose(picked.numpy(), served, atol=2e-4)
