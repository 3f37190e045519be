"""A real `tuneloop serve` (torch, the tiny built-in model) killed with SIGKILL in the middle of
training and started again on the same data dir, database and port, on SQLite and PostgreSQL.

What must hold: sessions, runs, checkpoints and usage are intact; requests in flight at the kill
fail with a clear error (410, reason server_restarted) on the next poll, within a bounded time;
the client loads its last state into a new training run and carries on where it left off. The
same with a worker group (`--workers 2`), whose worker processes exit with their server.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from signal import SIGKILL
from urllib.parse import urlsplit

import httpx
import pytest

import tuneloop
from tests.db import db_url
from tuneloop import AdamParams, Datum, ModelInput
from tuneloop._local_server import LiveServer, create_key, start_server, stop

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["db_url"]

TINY = "tuneloop/tiny-qwen3"
# Every wait is bounded: a hang fails the test instead of stalling the suite.
RESULT_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted tiny model, shared by every server start in this module."""
    return Path(tmp_path_factory.mktemp("model-cache"))


def _serve(data_dir: Path, key: str, db: str, cache_dir: Path, *extra: str) -> LiveServer:
    return start_server(
        data_dir,
        *("--db-url", db, "--device", "cpu", "--cache-dir", str(cache_dir), *extra),
        key=key,
        backend="torch",
        models=(TINY,),
    )


def _datum(tokens: list[int]) -> Datum:
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )


DATA = [_datum([(7 * i) % 200 + 3 for i in range(24)])]
# Heavy enough (32 x 1,024 tokens: many seconds on a CPU) to be still running at the kill.
HEAVY = [_datum([(11 * i + j) % 200 + 3 for i in range(1024)]) for j in range(32)]


def _loss(client: tuneloop.TrainingClient) -> float:
    return float(client.forward(DATA, "cross_entropy").result(RESULT_TIMEOUT_S).metrics["loss:sum"])


def _train(client: tuneloop.TrainingClient, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        fwdbwd = client.forward_backward(DATA, "cross_entropy")
        client.optim_step(AdamParams(learning_rate=0.05)).result(RESULT_TIMEOUT_S)
        losses.append(float(fwdbwd.result(RESULT_TIMEOUT_S).metrics["loss:sum"]))
    return losses


def _worker_pids(data_dir: Path) -> list[int]:
    """The pids of a worker group's processes (none for a single-process engine)."""
    status = data_dir / "workers" / "workers.json"
    return [int(p) for p in json.loads(status.read_text())["pids"]] if status.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: its parent (the killed server) is gone, so init reaps it soon.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
            return False
    return True


@pytest.fixture
def servers() -> Iterator[list[LiveServer]]:
    """Every server a test starts; each is stopped (by pid) when the test ends."""
    started: list[LiveServer] = []
    yield started
    for server in started:
        stop(server.process)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigkill_mid_training_then_restart(
    tmp_path: Path, db_url: str, cache_dir: Path, servers: list[LiveServer], workers: str
) -> None:
    if workers != "1" and db_url.startswith("postgresql"):
        pytest.skip("a worker group is run against one database: the registry is the same code")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    key = create_key(data_dir, "alice")
    group = ("--workers", workers)
    servers.append(_serve(data_dir, key, db_url, cache_dir, *group))
    first = servers[0]
    service = tuneloop.ServiceClient(base_url=first.url, api_key=key)
    try:
        training = service.create_lora_training_client(TINY, rank=4, seed=0)
        losses = _train(training, 3)
        assert losses[-1] < losses[0]
        state = training.save_state("before-kill").result(RESULT_TIMEOUT_S)
        loss_at_save = _loss(training)
        usage_before = service.get_usage().totals  # also writes every count so far

        # In flight at the kill: an SDK step computing on the engine, and (raw, so its id is
        # known) an optim_step queued behind a seq_id that never comes.
        running = training.forward_backward(HEAVY, "cross_entropy")
        queued = httpx.post(
            f"{first.url}/api/v1/optim_step",
            json={"model_id": training.model_id, "seq_id": 10_000, "adam_params": {}},
            headers={"x-api-key": key},
            timeout=30,
        )
        assert queued.status_code == 200, queued.text
        lost_request_id = queued.json()["request_id"]
        time.sleep(1.0)  # the SDK's heavy submission has gone out and is running
        assert not running.done()

        old_workers = _worker_pids(data_dir)
        os.kill(first.process.pid, SIGKILL)
        first.process.wait(30)
        # A group's workers notice that their server is gone and exit by themselves.
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in old_workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in old_workers)
        port = str(urlsplit(first.url).port)
        servers.append(_serve(data_dir, key, db_url, cache_dir, "--port", port, *group))
        second = servers[1]
        assert second.url == first.url

        # The raw poll: a final 410 at once, which says why and what to do.
        started = time.monotonic()
        polled = httpx.post(
            f"{second.url}/api/v1/retrieve_future",
            json={"request_id": lost_request_id},
            headers={"x-api-key": key},
            timeout=30,
        )
        assert time.monotonic() - started < 5
        assert polled.status_code == 410, polled.text
        assert polled.headers["x-should-retry"] == "false"
        body = polled.json()
        assert body["field"] == "request_id"
        assert body["reason"] == "server_restarted"
        assert "submit the request again" in body["detail"]

        # The SDK's future, which was polling all along, fails with the same clear error.
        with pytest.raises(tuneloop.GoneError, match="restarted"):
            running.result(RESULT_TIMEOUT_S)
        # The old run's adapter is gone: a clear 410 naming the remedy, not a hang.
        with pytest.raises(tuneloop.GoneError, match="create_training_client_from_state"):
            training.forward_backward(DATA, "cross_entropy").result(RESULT_TIMEOUT_S)

        # The records survived: session (still live), run, checkpoint, usage.
        rest = service.create_rest_client()
        assert service.session_id in rest.list_sessions().result(RESULT_TIMEOUT_S).sessions
        session = rest.get_session(service.session_id).result(RESULT_TIMEOUT_S)
        assert training.model_id in session.training_run_ids
        run = rest.get_training_run(training.model_id).result(RESULT_TIMEOUT_S)
        assert (run.base_model, run.lora_rank) == (TINY, 4)
        listed = rest.list_checkpoints(training.model_id).result(RESULT_TIMEOUT_S).checkpoints
        assert [c.tinker_path for c in listed] == [state.path]
        assert service.get_usage().totals == usage_before

        # The same client loads its last state into a new run of its session and carries on.
        resumed = service.create_training_client_from_state_with_optimizer(state.path)
        assert resumed.model_id != training.model_id
        assert _loss(resumed) == pytest.approx(loss_at_save, rel=1e-5)
        more = _train(resumed, 2)
        assert more[-1] < loss_at_save
        assert service.get_usage().totals.trained_tokens > usage_before.trained_tokens
    finally:
        service.close()
