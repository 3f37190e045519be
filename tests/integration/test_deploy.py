"""`tuneloop deploy` as a real process: a checkpoint trained on a real server (torch, the tiny
model), exported merged, then served alone; the official `openai` client chats with it (streamed
too) and gets what the training server gave for the adapter; readiness, no training routes,
SIGTERM exits 0, and the merged model is a registered package of kind "merged"."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from typer.testing import CliRunner

import tuneloop
from tuneloop import AdamParams, Datum, ModelInput
from tuneloop._local_server import launch, live_server, stop
from tuneloop.cli import build_app
from tuneloop.server.cli.deploy import _merged_checkpoint
from tuneloop.server.config import ServerConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TINY = "tuneloop/tiny-qwen3"
TOKENS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10]
PROMPT = TOKENS[:6]
HI = [{"role": "user", "content": "Say hello."}]
READY_S = 180.0


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the servers' torch: a shared 2-core machine


def _deploy(source: str, data_dir: Path, *extra: str) -> tuple[subprocess.Popen[str], str, str]:
    """Start `tuneloop deploy`; (process, its URL, what it printed before it was ready)."""
    args = ["deploy", source, "--port", "0", "--data-dir", str(data_dir), "--device", "cpu"]
    # fp32 as the training server ran the tiny model (a folder would get bf16 on AMX CPUs).
    args += ["--dtype", "float32"]
    return launch([*args, "--parent-pid", str(os.getpid()), *extra], READY_S)


def _packages(data_dir: Path) -> list[dict[str, object]]:
    done = CliRunner().invoke(
        build_app(with_demo=False), ["checkpoints", "list", "--json", "--data-dir", str(data_dir)]
    )
    assert done.exit_code == 0, done.output
    rows: list[dict[str, object]] = json.loads(done.stdout)
    return rows


@pytest.fixture(scope="module")
def trained(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, str, str, dict[str, Any]]]:
    """A data folder with a trained checkpoint: (folder, key, checkpoint path, the training
    server's greedy completion of PROMPT with that checkpoint)."""
    data_dir = tmp_path_factory.mktemp("deploy") / "data"
    datum = Datum(
        model_input=ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={"target_tokens": TOKENS[1:]}
    )
    with live_server(data_dir, backend="torch", models=(TINY,)) as live:
        service = tuneloop.ServiceClient(base_url=live.url, api_key=live.key)
        try:
            training = service.create_lora_training_client(TINY, rank=4, seed=7)
            for _ in range(3):
                training.forward_backward([datum], "cross_entropy")
                training.optim_step(AdamParams(learning_rate=0.05))
            path = training.save_weights_for_sampler("s1").result(timeout=120).path
        finally:
            service.close()
        with openai.OpenAI(api_key=live.key, base_url=f"{live.url}/oai/api/v1") as client:
            greedy = client.completions.create(
                model=path, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0
            )
        reference = greedy.choices[0].model_dump()
        yield data_dir, live.key, path, reference


def test_deploy_a_merged_folder(
    tmp_path: Path, trained: tuple[Path, str, str, dict[str, Any]]
) -> None:
    data_dir, key, path, reference = trained
    merged = tmp_path / "merged"
    done = CliRunner().invoke(
        build_app(with_demo=False),
        ["checkpoints", "export", path, "--merged", "--out", str(merged), "--data-dir",
         str(data_dir)],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    process, url, printed = _deploy(str(merged), data_dir)
    try:
        assert "package s1-merged v1 (merged" in printed
        health = httpx.get(f"{url}/oai/api/v1/health", timeout=30)
        assert health.status_code == 200
        assert health.json()["models"] == [str(merged.resolve())]
        with openai.OpenAI(api_key=key, base_url=f"{url}/oai/api/v1", max_retries=0) as client:
            assert [m.id for m in client.models.list()] == [str(merged.resolve())]
            reply = client.chat.completions.create(
                model="merged", messages=HI, max_tokens=12, seed=2
            )
            content = reply.choices[0].message.content
            stream = client.chat.completions.create(
                model="merged", messages=HI, max_tokens=12, seed=2, stream=True
            )
            streamed = [c.choices[0].delta.content or "" for c in stream if c.choices]
            assert "".join(streamed) == content
            assert len(streamed) > 2
            # The merged weights answer as base + adapter did on the training server.
            greedy = client.completions.create(
                model="merged", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0
            )
            choice = greedy.choices[0]
            assert choice.text == reference["text"]
            assert choice.logprobs is not None
            assert choice.logprobs.token_logprobs == pytest.approx(
                reference["logprobs"]["token_logprobs"], abs=2e-4
            )
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model=path, messages=HI)  # no adapters here
        # No training routes in a deployment.
        assert httpx.post(f"{url}/api/v1/create_session", json={}, timeout=30).status_code == 404
        assert httpx.get(f"{url}/api/v1/healthz", timeout=30).status_code == 404
    finally:
        assert stop(process) == 0  # SIGTERM: a graceful stop
    [package] = [p for p in _packages(data_dir) if p["directory"] == str(merged.resolve())]
    assert package["kind"] == "merged"
    assert package["tinker_path"] == path.replace(
        "sampler_weights/s1", "external_weights/s1-merged"
    )


def test_deploying_a_checkpoint_merges_and_registers_it_once(
    trained: tuple[Path, str, str, dict[str, Any]],
) -> None:
    # What `tuneloop deploy tinker://...` does before it serves the folder (served as above).
    data_dir, _key, path, _ = trained
    config = ServerConfig.from_env(data_dir=data_dir)
    folder = _merged_checkpoint(path, config, "s1-live")
    assert (folder / "config.json").is_file()
    target = path.replace("sampler_weights/s1", "external_weights/s1-live")
    [package] = [p for p in _packages(data_dir) if p["tinker_path"] == target]
    assert package["kind"] == "merged"
    assert package["parent_tinker_path"] == path
    assert package["directory"] == str(folder)
    made = (folder / "config.json").stat().st_mtime_ns
    assert _merged_checkpoint(path, config, "s1-live") == folder  # deployed again: reused
    assert (folder / "config.json").stat().st_mtime_ns == made
    assert len([p for p in _packages(data_dir) if p["tinker_path"] == target]) == 1
