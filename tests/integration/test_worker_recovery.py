"""A real `tuneloop serve --workers 2` (2 gloo ranks, the tiny model) driven by the SDK: a
worker SIGKILLed in the middle of a 10-step training loop.

What must hold: the loop completes without the user's code seeing anything (the server restores
the group and runs the requests in flight again); the losses and the saved adapter equal those
of an undisturbed run of the same data on the same server (same sharding, so equal to float32
rounding: 1e-6); the group was restarted (workers.json in the data dir names the new pids);
after 10 steps each adapter's snapshot is on disk too.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import load_file

import tuneloop
from tuneloop import AdamParams, Datum, ModelInput
from tuneloop._local_server import create_key, start_server, stop

pytestmark = [pytest.mark.integration]

TINY = "tuneloop/tiny-qwen3"
RESULT_TIMEOUT_S = 120.0
STEPS = 10
KILL_AT = 4


def _datum(step: int, j: int, length: int) -> Datum:
    tokens = [(7 * i + 13 * j + 3 * step) % 250 + 3 for i in range(length)]
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )


def _batch(step: int) -> list[Datum]:
    return [_datum(step, j, n) for j, n in enumerate((40, 24, 31, 9))]


def _status(data_dir: Path) -> dict[str, object]:
    loaded: dict[str, object] = json.loads((data_dir / "workers" / "workers.json").read_text())
    return loaded


def _train(
    service: tuneloop.ServiceClient, name: str, kill_in: Path | None = None
) -> tuple[list[float], Path]:
    training = service.create_lora_training_client(TINY, rank=4, seed=0)
    losses = []
    for step in range(STEPS):
        fwdbwd = training.forward_backward(_batch(step), "cross_entropy")
        optim = training.optim_step(AdamParams(learning_rate=1e-2))
        if kill_in is not None and step == KILL_AT:
            # while this step's requests are queued or running
            pids = _status(kill_in)["pids"]
            assert isinstance(pids, list)
            os.kill(int(pids[1]), signal.SIGKILL)
        losses.append(float(fwdbwd.result(RESULT_TIMEOUT_S).metrics["loss:sum"]))
        optim.result(RESULT_TIMEOUT_S)
    path = training.save_state(name).result(RESULT_TIMEOUT_S).path
    assert path.endswith(name)
    return losses, path


def _saved(data_dir: Path, name: str) -> dict[str, np.ndarray]:
    [folder] = data_dir.glob(f"checkpoints/*/*/weights/{name}")
    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.slow
def test_worker_killed_mid_training_loop(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    key = create_key(data_dir, "alice")
    server = start_server(
        data_dir,
        *("--workers", "2", "--device", "cpu", "--cache-dir", str(tmp_path / "cache")),
        key=key,
        backend="torch",
        models=(TINY,),
    )
    try:
        service = tuneloop.ServiceClient(base_url=server.url, api_key=key)
        first = _status(data_dir)
        undisturbed, _ = _train(service, "undisturbed")
        started = time.monotonic()
        disturbed, _ = _train(service, "disturbed", kill_in=data_dir)
        print(f"disturbed run: {time.monotonic() - started:.1f} s")
        after = _status(data_dir)
        assert after["restarts"] == 1
        # and /metrics says so
        scraped = httpx.get(f"{server.url}/metrics", timeout=30)
        values = {
            s.name: s.value
            for family in text_string_to_metric_families(scraped.text)
            for s in family.samples
        }
        assert values["tuneloop_worker_restarts_total"] == 1
        assert values["tuneloop_workers"] == 2
        assert set(after["pids"]).isdisjoint(first["pids"])  # type: ignore[arg-type]
        np.testing.assert_allclose(disturbed, undisturbed, rtol=1e-6)
        want, got = _saved(data_dir, "undisturbed"), _saved(data_dir, "disturbed")
        assert want.keys() == got.keys()
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=1e-6, err_msg=name)
        # every 10 optim steps each adapter's state is also on disk, in the checkpoint layout
        snapshots = sorted((data_dir / "workers" / "snapshots").iterdir())
        assert len(snapshots) == 2
        for folder in snapshots:
            on_disk = load_file(str(folder / "adapter_model.safetensors"))
            for name in want:
                np.testing.assert_allclose(on_disk[name], want[name], atol=1e-6, err_msg=name)
            assert (folder / "optimizer.pt").is_file()
        # the adapters did train: equal untrained weights would prove nothing
        assert max(float(np.abs(v).max()) for k, v in want.items() if "lora_B" in k) > 1e-3
    finally:
        stop(server.process)
