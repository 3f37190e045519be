"""Exports that leave tuneloop behind: a checkpoint trained on a real server (torch backend) is
exported merged (`tuneloop checkpoints export --merged`) and downloaded as a PEFT adapter (the
SDK's download_checkpoint); plain `transformers`, and `peft` on the base model, load them in a
Python that cannot import tuneloop, and give the logprobs the server's forward gives.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import tuneloop
from tuneloop import AdamParams, Datum, ModelInput
from tuneloop._local_server import live_server
from tuneloop.cli import build_app

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "tuneloop/tiny-qwen3"
TOKENS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10]
# fp32 on the CPU: the merged weights differ from base + LoRA by rounding only.
ATOL = 2e-4

# Run with `python -I -S`: no PYTHONPATH, no user site, and no .pth files (the editable install
# of tuneloop is one), so only the installed packages are on the path, then tuneloop is checked
# to be unimportable. Prints the logprobs of every target token under each model.
_OUTSIDE = """
import importlib.util, json, sys
sys.path.append({site!r})
assert importlib.util.find_spec("tuneloop") is None, "tuneloop is importable"
import torch
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
from peft import PeftModel

tokens = torch.tensor([{tokens!r}])

def logprobs(model):
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits.float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])
    return lp[0, :, 0].tolist()

merged = AutoModelForCausalLM.from_pretrained({merged!r}, dtype=torch.float32)
base = AutoModelForCausalLM.from_pretrained({base!r}, dtype=torch.float32)
out = {{"merged": logprobs(merged), "base": logprobs(base)}}
out["peft"] = logprobs(PeftModel.from_pretrained(base, {adapter!r}))
print(json.dumps(out))
"""


def test_merged_and_peft_exports_match_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server's torch: a shared 2-core machine
    data_dir = tmp_path / "data"
    datum = Datum(
        model_input=ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={"target_tokens": TOKENS[1:]}
    )
    with live_server(data_dir, backend="torch", models=(MODEL,)) as live:
        service = tuneloop.ServiceClient(base_url=live.url, api_key=live.key)
        try:
            # Attention, MLP and unembedding all trained, so every kind of factor is exported.
            training = service.create_lora_training_client(MODEL, rank=4, seed=7)
            for _ in range(3):
                training.forward_backward([datum], "cross_entropy")
                training.optim_step(AdamParams(learning_rate=0.02))
            state = training.save_state("trained").result(timeout=120).path
            export = training.save_weights_external("adapter").result(timeout=120)
            output = training.forward([datum], "cross_entropy").result(timeout=120)
            served = output.loss_fn_outputs[0]["logprobs"].to_numpy()
            rest = service.create_rest_client()
            downloaded = rest.download_checkpoint(export.path, tmp_path / "download").result(60)
        finally:
            service.close()

    assert export.size_bytes == sum(p.stat().st_size for p in downloaded.iterdir())
    config = json.loads((downloaded / "adapter_config.json").read_text())
    assert (config["r"], config["base_model_name_or_path"]) == (4, MODEL)
    assert "lm_head" in config["target_modules"]
    assert "optimizer.pt" not in {p.name for p in downloaded.iterdir()}

    # The operator's export of the training checkpoint is the same adapter folder, file for file.
    runner = CliRunner()
    where = ("--data-dir", str(data_dir))
    adapter = tmp_path / "exported"
    done = runner.invoke(build_app(with_demo=False), ["checkpoints", "export", state, "--out",
                         str(adapter), *where])  # fmt: skip
    assert done.exit_code == 0, done.output
    files = {p.name: p.read_bytes() for p in adapter.iterdir()}
    assert files == {p.name: p.read_bytes() for p in downloaded.iterdir()}

    merged = tmp_path / "merged"
    done = runner.invoke(build_app(with_demo=False), ["checkpoints", "export", state, "--out",
                         str(merged), "--merged", *where])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert (merged / "config.json").is_file()
    assert not (merged / "adapter_config.json").exists()

    # The base model, as a plain folder for peft to put the adapter on (the tiny model is built
    # in code; the merged folder was written from the same build).
    import torch

    from tuneloop.server.engine.models import load_model

    base = tmp_path / "base"
    loaded = load_model(MODEL, cache_dir=tmp_path, device=torch.device("cpu"), dtype=torch.float32)
    loaded.model.save_pretrained(base)  # type: ignore[operator]

    script = _OUTSIDE.format(
        site=sysconfig.get_paths()["purelib"],
        tokens=TOKENS,
        merged=str(merged),
        base=str(base),
        adapter=str(downloaded),
    )
    outside = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
             "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert outside.returncode == 0, outside.stderr[-3000:]
    got = {k: np.asarray(v) for k, v in json.loads(outside.stdout.splitlines()[-1]).items()}
    np.testing.assert_allclose(got["merged"], served, atol=ATOL)
    np.testing.assert_allclose(got["peft"], served, atol=ATOL)
    # And the training changed the model, so matching it is not matching the base.
    assert np.abs(got["base"] - served).max() > 50 * ATOL
