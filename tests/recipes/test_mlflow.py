"""`--mlflow-uri`: a recipe's params and per-step metrics reach a real MLflow tracking server
(a local `mlflow server` process with a SQLite store), and a resumed run continues the same
MLflow run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.recipes.conftest import TINY
from tests.recipes.test_chat_sft import _conversations
from tuneloop._local_server import LiveServer
from tuneloop.recipes.chat_sft import ChatSFTConfig, run_chat_sft

pytestmark = [pytest.mark.recipe, pytest.mark.integration, pytest.mark.slow]
mlflow = pytest.importorskip("mlflow")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--default-artifact-root",
            str(tmp_path / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "MLFLOW_TRACKING_URI": ""},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None:
                pytest.fail(f"mlflow server exited with {process.returncode}")
            time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not become ready in 90 s")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def test_metrics_and_params_reach_mlflow_and_resume_continues_the_run(
    tiny_server: LiveServer, mlflow_server: str, tmp_path: Path
) -> None:
    data = _conversations(tmp_path / "chats.jsonl")
    config = ChatSFTConfig(
        log_dir=str(tmp_path / "sft"),
        base_url=tiny_server.url,
        api_key=tiny_server.key,
        model=TINY,
        data=str(data),
        steps=2,
        batch_size=4,
        eval_every=0,
        save_every=1,
        eval_fraction=0.2,
        progress=False,
        mlflow_uri=mlflow_server,
    )
    run_chat_sft(config)
    config.steps = 3
    run_chat_sft(config)  # resumed: the same MLflow run goes on

    client = mlflow.tracking.MlflowClient(tracking_uri=mlflow_server)
    run_id = (tmp_path / "sft" / "mlflow_run_id").read_text().strip()
    history = client.get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in history) == [1, 2, 3]
    logged = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["train_loss"] for r in logged if "train_loss" in r}
    for m in history:
        assert m.value == pytest.approx(by_step[m.step])
    params = client.get_run(run_id).data.params
    assert params["batch_size"] == "4"
    assert params["model"] == TINY
    assert "api_key" not in params  # never sent to the tracking server
