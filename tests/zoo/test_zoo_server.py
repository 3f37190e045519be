"""Zoo models served from their folders (`--model DIR`) by a real server, driven by the official
SDK: a dense model and MoE architectures whose experts carry LoRA, fp32. Run with
`pytest tests/zoo -m slow` (about a minute each on one core)."""

from __future__ import annotations

import json
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest

import tuneloop
from tests.compat.runner import run_official
from tests.zoo.conftest import model_folder
from tuneloop._local_server import live_server

pytest.importorskip("tinker")
pytestmark = [pytest.mark.compat, pytest.mark.integration, pytest.mark.slow]


def _capabilities(url: str, key: str) -> dict[str, object]:
    request = urllib.request.Request(
        f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": key}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        [model] = json.loads(response.read())["supported_models"]
    assert isinstance(model, dict)
    return model


@pytest.mark.parametrize("arch", ["llama", "gpt_oss", "deepseek_v3"])
def test_official_sdk_trains_samples_resumes_and_exports_a_zoo_model(
    arch: str, zoo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    folder = str(model_folder(zoo_dir, arch))
    out = tmp_path / "export"
    # fp32 weights (not the measured default, bf16 on CPUs with matrix units): the downloaded
    # adapter is checked to fp32 rounding against the server's logprobs.
    data_dir = tmp_path / "data"
    with live_server(data_dir, "--dtype", "float32", backend="torch", models=(folder,)) as live:
        capabilities = _capabilities(live.url, live.key)
        service = tuneloop.ServiceClient(base_url=live.url, api_key=live.key)
        try:  # get_info: the groups this adapter covers and what it trains at its rank
            info = service.create_lora_training_client(folder, rank=4, seed=0).get_info()
            # Our SDK's finer target: the experts apart from the dense MLPs.
            without_experts = service.create_lora_training_client(
                folder, rank=4, train_experts=False
            ).get_info()
            experts_only = None
            if arch != "llama":
                experts_only = service.create_lora_training_client(
                    folder, rank=4, train_mlp=False, train_attn=False, train_unembed=False,
                    train_experts=True,
                ).get_info()  # fmt: skip
        finally:
            service.close()
        done = run_official(
            "official_zoo", live.url, live.key, folder, str(out), timeout=400, package="tests.zoo"
        )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "official SDK zoo flow: OK" in done.stdout
    assert capabilities["arch"] == arch
    groups = capabilities["lora_groups"]
    assert isinstance(groups, list)
    assert ("experts" in groups) == (arch != "llama")
    assert float(capabilities["lora_coverage"]) >= 0.95  # type: ignore[arg-type]
    assert info.model_data.lora_groups == groups
    assert without_experts.model_data.lora_groups == [g for g in groups if g != "experts"]
    if experts_only is not None:
        assert experts_only.model_data.lora_groups == ["experts"]
    per_rank = capabilities["lora_parameters_per_rank"]
    assert isinstance(per_rank, int)
    assert info.model_data.lora_trainable_parameters == 4 * per_rank
    assert info.model_data.num_parameters == capabilities["num_parameters"]

    served = json.loads((out / "served.json").read_text())
    tokens = torch.tensor([served["tokens"]])
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    untrained = _logprobs(base, tokens)
    with warnings.catch_warnings():  # peft 0.21 reads an attribute transformers 5 deprecated
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing")
        adapted = PeftModel.from_pretrained(base, str(out))
    got, want = _logprobs(adapted, tokens), np.asarray(served["logprobs"])
    np.testing.assert_allclose(got, want, atol=2e-4)
    assert np.abs(untrained - want).max() > 50 * 2e-4  # and the training changed the model


def _logprobs(model: object, tokens: object) -> np.ndarray:
    import torch

    assert isinstance(tokens, torch.Tensor)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits.float()  # type: ignore[operator]
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[0, :, 0].numpy()
