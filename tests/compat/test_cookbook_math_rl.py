"""The unmodified tinker-cookbook `math_rl` recipe, with its DEFAULT loss (`stable_reinforce`),
trains against `tuneloop serve` on the tiny model.

The cookbook loads its tokenizer by model name from the Hugging Face cache (no hub here): the
test fills a private cache with the files the server serves at GET /api/v1/tokenizer, which is
what a user does once per model (docs/losses.md). Only `env=arithmetic` (generated problems)
and small sizes are passed; the loss, its config and the sampling setup are the recipe's own.

tinker-cookbook 0.6.1 does not install with its declared dependencies (tml-renderers>=0.4.1 is
not published where we install from): `make install` installs it without them, plus chz,
blobfile, tiktoken, datasets, pylatexenc, math-verify and pyrage (see the Makefile).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tuneloop._local_server import live_server

pytest.importorskip("tinker")
# A missing cookbook fails here rather than skipping: `make install` installs it.
import tinker_cookbook.recipes.math_rl.train  # noqa: F401

pytestmark = [pytest.mark.compat, pytest.mark.integration, pytest.mark.slow]

MODEL = "tuneloop/tiny-qwen3"
SNAPSHOT = "0" * 40
NOT_SERVED = (
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "preprocessor_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def fill_hf_cache(cache: Path, url: str, key: str, model: str) -> None:
    """The server's tokenizer files as the hub cache's snapshot of `model`."""
    answer = httpx.get(
        f"{url}/api/v1/tokenizer",
        params={"base_model": model},
        headers={"X-API-Key": key},
        timeout=30,
    )
    answer.raise_for_status()
    repo = cache / f"models--{model.replace('/', '--')}"
    snapshot = repo / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    files = answer.json()["files"]
    for name, data in files.items():
        (snapshot / name).write_bytes(base64.b64decode(data))
    # Files the model has not: the hub cache's negative entries, so offline loads do not fail.
    missing = repo / ".no_exist" / SNAPSHOT
    missing.mkdir(parents=True)
    for name in ("config.json", *NOT_SERVED):
        if name not in files:
            (missing / name).touch()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_math_rl_with_its_default_loss(tmp_path: Path, mode: str) -> None:
    """Synchronous, and asynchronous with sampling a step ahead of training (off-policy data,
    which is what stable_reinforce's truncated weights are for)."""
    with live_server(tmp_path / "server", backend="torch", models=(MODEL,)) as live:
        fill_hf_cache(tmp_path / "hf", live.url, live.key, MODEL)
        log_path = tmp_path / "run"
        env = {
            **os.environ,
            "TINKER_API_KEY": live.key,
            "TINKER_TELEMETRY": "0",
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_CACHE": str(tmp_path / "hf"),
            "TINKER_COOKBOOK_RUNS_DIR": str(tmp_path / "runs"),
        }
        args = [
            f"model_name={MODEL}",
            "renderer_name=role_colon",
            "env=arithmetic",
            "group_size=2",
            "groups_per_batch=2",
            "max_steps=2",
            "max_tokens=4",
            "learning_rate=1e-3",
            "lora_rank=4",
            "eval_every=0",
            "save_every=0",
            f"base_url={live.url}",
            f"log_path={log_path}",
            "behavior_if_log_dir_exists=delete",
            *(["max_steps_off_policy=1"] if mode == "async" else []),
        ]
        done = subprocess.run(
            [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        usage = httpx.get(
            f"{live.url}/api/v1/usage", headers={"X-API-Key": live.key}, timeout=30
        ).json()
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "optim/lr" in m]
    assert len(steps) == 2, metrics
    config = json.loads((log_path / "config.json").read_text())
    assert config["loss_fn"] == "stable_reinforce"  # the recipe's default, not passed
    if mode == "async":
        assert all("async/staleness_max" in m for m in steps)
    # the learner scores the sampled tokens as the sampler did (what the records hold)
    assert all(abs(m["optim/kl_sample_train_v1"]) < 1e-3 for m in steps)
    # it trained (stable_reinforce forward_backward calls reached the engine) and sampled
    assert usage["by_operation"]["forward_backward"]["requests"] >= 2
    assert usage["by_operation"]["sample"]["requests"] >= 4
