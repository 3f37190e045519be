"""The API-side findings of the adversarial pass, replayed from outside against a real
`tuneloop serve` (fake backend; the torch tiny model where the finding touches the engine's
files), the way an attacker or a careless user would send them.

Each test names its finding: quotas that count what they say (2), shapes bounded before
anything is allocated (3), 4xx instead of 500s (4), registry rows never overwritten (5),
revocation at once (6), limits on stored metadata, private files and half-sent requests (8).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from tuneloop._local_server import LiveServer, create_key, start_server, stop
from tuneloop.server.storage.keys import KeyStore, key_hash
from tuneloop.types import Datum, ModelInput, TensorData
from tuneloop.types.codec import ForwardBackwardRequest, encode_forward_backward_request

pytestmark = pytest.mark.integration

FAKE = "tuneloop/fake-tiny"
TINY = "tuneloop/tiny-qwen3"
PROTO = {"content-type": "application/x-protobuf"}
MAX_INFLIGHT = 8
# The read bounds the server runs with here, and how much later the disconnect may come.
READ_TIMEOUT_S = 1.0
SLACK_S = 2.0
# Every wait is bounded: a hang fails the test instead of stalling the suite.
WAIT_S = 60.0


class Tenant:
    """One key's raw HTTP view of a live server."""

    def __init__(self, server: LiveServer, key: str) -> None:
        self.server = server
        self.key = key
        # The server closes a connection whose next request's headers have not come within
        # READ_TIMEOUT_S of its last response: a connection idle that long is dropped here
        # first, or a request sent on it as the server closes it finds it gone.
        limits = httpx.Limits(keepalive_expiry=READ_TIMEOUT_S / 2)
        self.http = httpx.Client(base_url=server.url, timeout=WAIT_S, limits=limits)

    def __enter__(self) -> Tenant:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.http.close()

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return self.http.post(f"/api/v1/{path}", json=body, headers={"x-api-key": self.key}, **kw)

    def post_raw(self, path: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
        headers = {"x-api-key": self.key, **headers}
        return self.http.post(f"/api/v1/{path}", content=content, headers=headers)

    def oai(self, path: str, body: Any) -> httpx.Response:
        headers = {"authorization": f"Bearer {self.key}"}
        return self.http.post(f"/oai/api/v1/{path}", json=body, headers=headers)

    def result(self, response: httpx.Response) -> httpx.Response:
        assert response.status_code == 200, response.text
        request_id = response.json()["request_id"]
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            polled = self.post("retrieve_future", {"request_id": request_id})
            if polled.status_code != 408:
                return polled
        raise AssertionError(f"{request_id} never completed")

    def session(self) -> str:
        response = self.post("create_session", {"tags": [], "sdk_version": "test"})
        assert response.status_code == 200, response.text
        return str(response.json()["session_id"])

    def model(self, session_id: str, seq: int = 0, base_model: str = FAKE) -> str:
        body = {
            "session_id": session_id,
            "model_seq_id": seq,
            "base_model": base_model,
            "lora_config": {"rank": 4, "seed": 1},
        }
        done = self.result(self.post("create_model", body))
        assert done.status_code == 200, done.text
        return str(done.json()["model_id"])

    def save(self, model_id: str, seq_id: int, name: str, kind: str = "save_weights") -> str:
        body = {"model_id": model_id, "seq_id": seq_id, "path": name}
        done = self.result(self.post(kind, body))
        assert done.status_code == 200, done.text
        return str(done.json()["path"])

    def forward_backward(self, model_id: str, seq_id: int, data: list[Datum]) -> httpx.Response:
        body = encode_forward_backward_request(
            ForwardBackwardRequest(model_id, seq_id, data, "cross_entropy")
        )
        return self.post_raw("forward_backward", body, PROTO)


def _datum(tokens: list[int]) -> Datum:
    targets = np.asarray(tokens[1:], dtype=np.int64)
    return Datum(ModelInput.from_ints(tokens[:-1]), {"target_tokens": targets})


def _error(response: httpx.Response, status: int, field: str) -> dict[str, Any]:
    """A JSON error naming `field` (Tinker shape or OpenAI's)."""
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    named = body["error"]["param"] if "error" in body else body["field"]
    assert named == field, body
    return body


@contextlib.contextmanager
def _serve(data_dir: Path, *extra: str, backend: str = "fake") -> Iterator[LiveServer]:
    models = (TINY,) if backend == "torch" else ()
    args = [*extra, "--device", "cpu"] if backend == "torch" else list(extra)
    server = start_server(
        data_dir, *args, key=create_key(data_dir, "alice"), backend=backend, models=models
    )
    try:
        yield server
    finally:
        stop(server.process)


SERVE_ARGS = (
    "--max-inflight",
    str(MAX_INFLIGHT),
    "--header-timeout-s",
    str(READ_TIMEOUT_S),
    "--body-timeout-s",
    str(READ_TIMEOUT_S),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with _serve(Path(tmp_path_factory.mktemp("findings")), *SERVE_ARGS) as live:
        yield live


@pytest.fixture
def alice(server: LiveServer) -> Iterator[Tenant]:
    with Tenant(server, server.key) as tenant:
        yield tenant


# ---- finding 2: every prompt x choice counts against max_inflight ---------------------------


def test_openai_prompts_times_n_count_against_max_inflight(alice: Tenant) -> None:
    # 2 prompts x n 4 = 8 generations: exactly the quota, answered whole.
    fits = alice.oai("completions", {"model": FAKE, "prompt": ["a b", "c d"], "n": 4})
    assert fits.status_code == 200, fits.text
    assert len(fits.json()["choices"]) == 2 * 4
    # 3 x 4 = 12 can never fit a quota of 8: a 400 naming the limit, not 12 choices.
    body = _error(
        alice.oai("completions", {"model": FAKE, "prompt": ["a", "b", "c"], "n": 4}),
        400,
        "max_inflight",
    )
    assert str(MAX_INFLIGHT) in body["error"]["message"]
    # The finding's request: 2,000 prompts x n 4.
    _error(alice.oai("completions", {"model": FAKE, "prompt": ["x"] * 2000, "n": 4}), 400, "prompt")


# ---- finding 3: shapes bounded before any array is built -------------------------------------


def test_sparse_targets_are_bounded_before_they_are_densified(alice: Tenant) -> None:
    model_id = alice.model(alice.session())
    empty = np.zeros(0)
    # The finding's body: 1.6 MB, CSR target_tokens of shape [200000, 259] and no values.
    hostile = TensorData(empty, "int64", [200_000, 259], np.zeros(200_001, dtype=np.int64), empty)
    datum = Datum(ModelInput.from_ints([1, 2, 3]), {"target_tokens": hostile})
    started = time.monotonic()
    response = alice.forward_backward(model_id, 1, [datum])
    took = time.monotonic() - started
    _error(response, 400, "data[0].loss_fn_inputs['target_tokens']")
    assert "context length" in response.json()["detail"]
    # Refused from its declared shape: far below the 0.4 s the densifying took.
    assert took < 5.0
    # Wider than the vocabulary, or more rows than tokens: refused by shape as well.
    wide = TensorData(empty, "int64", [3, 10**12], np.zeros(4, dtype=np.int64), empty)
    datum = Datum(ModelInput.from_ints([1, 2, 3]), {"target_tokens": wide})
    _error(
        alice.forward_backward(model_id, 2, [datum]), 400, "data[0].loss_fn_inputs['target_tokens']"
    )
    # The model still trains afterwards (both rejected requests consumed their seq_ids).
    done = alice.result(alice.forward_backward(model_id, 3, [_datum([1, 2, 3, 4])]))
    assert done.status_code == 200, done.text


# ---- finding 4: 4xx, never a 500 or a reset connection ----------------------------------------


@pytest.mark.parametrize("token", [2**63, 2**64 + 5, -(2**63) - 1])
def test_token_ids_outside_64_bits_are_a_400(alice: Tenant, token: int) -> None:
    session_id = alice.session()
    body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": FAKE}
    sampler_id = alice.post("create_sampling_session", body).json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, token]}]}
    sample = {"sampling_session_id": sampler_id, "prompt": prompt, "sampling_params": {}}
    _error(alice.post("asample", sample), 400, "prompt.chunks[0].encoded_text.tokens[1]")
    # The same connection still answers (it was reset before).
    assert alice.http.get("/api/v1/healthz").status_code == 200


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("create_model", "model_seq_id", "1"),
        ("create_model", "model_seq_id", 1.0),
        ("create_sampling_session", "sampling_session_seq_id", "0"),
        ("create_sampling_session", "sampling_session_seq_id", 2**63),
    ],
)
def test_ids_are_integers_not_coerced(alice: Tenant, path: str, field: str, value: Any) -> None:
    body: dict[str, Any] = {"session_id": alice.session(), "base_model": FAKE, field: value}
    _error(alice.post(path, body), 400, field)


def test_sampling_session_on_a_checkpoint_deleted_meanwhile(alice: Tenant) -> None:
    session_id = alice.session()
    model_id = alice.model(session_id)
    answers: list[int] = []
    for i in range(5):  # the finding raced create_sampling_session with a DELETE 5 times
        path = alice.save(model_id, i + 1, f"race-{i}", "save_weights_for_sampler")
        checkpoint_id = path.rsplit("/", 2)[-2:]
        delete = threading.Thread(
            target=alice.http.delete,
            args=(f"/api/v1/training_runs/{model_id}/checkpoints/{'/'.join(checkpoint_id)}",),
            kwargs={"headers": {"x-api-key": alice.key}},
        )
        body = {"session_id": session_id, "sampling_session_seq_id": 100 + i, "model_path": path}
        delete.start()
        response = alice.post("create_sampling_session", body)
        delete.join(WAIT_S)
        answers.append(response.status_code)
        assert response.status_code in (200, 404, 410), response.text
        assert response.json()  # a JSON body either way
    # Once deleted, always a 404 naming model_path.
    body = {"session_id": session_id, "sampling_session_seq_id": 200, "model_path": path}
    _error(alice.post("create_sampling_session", body), 404, "model_path")


# ---- finding 5: registry rows are never overwritten -------------------------------------------


def test_sampler_seq_id_reused_is_refused(alice: Tenant) -> None:
    session_id = alice.session()
    model_id = alice.model(session_id)
    snapshot = {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 7}
    submitted = alice.post("save_weights_for_sampler", snapshot)
    first = alice.result(submitted)
    assert first.status_code == 200, first.text
    again = {"model_id": model_id, "seq_id": 2, "sampling_session_seq_id": 7}
    _error(alice.post("save_weights_for_sampler", again), 409, "sampling_session_seq_id")
    saved = alice.save(model_id, 3, "other", "save_weights_for_sampler")
    other = {"session_id": session_id, "sampling_session_seq_id": 7, "model_path": saved}
    _error(alice.post("create_sampling_session", other), 409, "sampling_session_seq_id")
    # A retry of the very request that made it is answered again, not refused.
    retry = alice.post("save_weights_for_sampler", snapshot)
    assert retry.status_code == 200, retry.text
    assert retry.json()["request_id"] == submitted.json()["request_id"]


def test_recreating_a_run_lost_in_a_restart_is_a_410_and_changes_nothing(
    tmp_path: Path,
) -> None:
    with _serve(tmp_path) as live, Tenant(live, live.key) as tenant:
        session_id = tenant.session()
        model_id = tenant.model(session_id)
        saved = tenant.save(model_id, 1, "kept")
        before = tenant.http.get(
            f"/api/v1/training_runs/{model_id}", headers={"x-api-key": live.key}
        ).json()
    with _serve(tmp_path) as live, Tenant(live, live.key) as tenant:
        body = {
            "session_id": session_id,
            "model_seq_id": 0,
            "base_model": FAKE,
            "lora_config": {"rank": 8, "seed": 2},  # another rank: would have rewritten the row
        }
        lost = _error(tenant.post("create_model", body), 410, "model_seq_id")
        assert lost["reason"] == "server_restarted"
        after = tenant.http.get(
            f"/api/v1/training_runs/{model_id}", headers={"x-api-key": live.key}
        ).json()
        assert after["lora_rank"] == before["lora_rank"] == 4
        # Its checkpoint still loads, into a new run of the same session.
        load = {"session_id": session_id, "model_seq_id": 1, "path": saved}
        loaded = tenant.result(tenant.post("load_weights", load))
        assert loaded.status_code == 200, loaded.text


# ---- finding 6: revocation at once -------------------------------------------------------------


def _revoke(data_dir: Path, key: str) -> None:
    digest = key_hash(key)
    key_id = next(
        r.key_id for r in KeyStore(data_dir / "keys.json").list() if r.key_sha256 == digest
    )
    command = [
        sys.executable,
        "-m",
        "tuneloop",
        "keys",
        "revoke",
        key_id,
        "--data-dir",
        str(data_dir),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=WAIT_S)


def test_revoked_key_ends_its_long_poll_and_queued_work(server: LiveServer, alice: Tenant) -> None:
    with Tenant(server, create_key(server.data_dir, "alice")) as doomed:
        _revocation(server, alice, doomed)


def _revocation(server: LiveServer, alice: Tenant, doomed: Tenant) -> None:
    session_id = alice.session()
    model_id = alice.model(session_id)
    # seq 2 waits for seq 1, which has not come: queued work of the key to be revoked.
    queued = doomed.post("save_weights", {"model_id": model_id, "seq_id": 2, "path": "dropped"})
    assert queued.status_code == 200, queued.text
    request_id = queued.json()["request_id"]
    polled: dict[str, Any] = {}

    def poll() -> None:
        response = doomed.post("retrieve_future", {"request_id": request_id})
        polled["status"], polled["at"] = response.status_code, time.monotonic()
        polled["body"] = response.json()

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.5)  # the long-poll is waiting (it holds 5 s)
    _revoke(server.data_dir, doomed.key)
    revoked_at = time.monotonic()
    poller.join(WAIT_S)
    assert polled["status"] == 401, polled
    # Within a second of the keys file changing (before the CLI even exits), plus slack for a
    # loaded machine.
    assert polled["at"] - revoked_at < 2.0
    assert doomed.post("create_session", {}).status_code == 401
    # The stream goes on without the dropped request: seq 1 and 3 (another key) run.
    assert alice.result(alice.forward_backward(model_id, 1, [_datum([1, 2, 3])])).status_code == 200
    done = alice.result(
        alice.post("save_weights", {"model_id": model_id, "seq_id": 3, "path": "kept"})
    )
    assert done.status_code == 200, done.text
    names = {
        c["checkpoint_id"]
        for c in alice.http.get(
            f"/api/v1/training_runs/{model_id}/checkpoints", headers={"x-api-key": alice.key}
        ).json()["checkpoints"]
    }
    assert names == {"weights/kept"}  # the revoked key's save never ran
    dropped = alice.post("retrieve_future", {"request_id": request_id})
    assert dropped.json()["category"] == "unauthorized"


# ---- finding 8: stored metadata, file modes, half-sent requests -------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"user_metadata": {"blob": "x" * 10_000_000}}, "user_metadata"),
        ({"tags": [str(i) for i in range(100_000)]}, "tags"),
        ({"tags": ["t" * 129]}, "tags[0]"),
    ],
)
def test_session_metadata_and_tags_are_bounded(
    alice: Tenant, body: dict[str, Any], field: str
) -> None:
    _error(alice.post("create_session", body), 400, field)


def test_run_and_checkpoint_metadata_are_bounded(alice: Tenant) -> None:
    session_id = alice.session()
    big = {"blob": "x" * 100_000}
    create = {"session_id": session_id, "model_seq_id": 0, "base_model": FAKE, "user_metadata": big}
    _error(alice.post("create_model", create), 400, "user_metadata")
    model_id = alice.model(session_id, 1)
    save = {"model_id": model_id, "seq_id": 1, "path": "meta", "user_metadata": big}
    _error(alice.post("save_weights", save), 400, "user_metadata")


def test_data_dir_is_private(server: LiveServer, alice: Tenant) -> None:
    model_id = alice.model(alice.session())
    alice.save(model_id, 1, "private")
    seen = 0
    for path in [server.data_dir, *server.data_dir.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {oct(mode)}"
        seen += 1
    assert (server.data_dir / "registry.sqlite3").exists()
    assert seen > 5


def _address(server: LiveServer) -> tuple[str, int]:
    parts = urlsplit(server.url)
    assert parts.hostname is not None
    assert parts.port is not None
    return parts.hostname, parts.port


def _closed_after(server: LiveServer, sent: bytes) -> float:
    """Seconds until the server closes a connection that sent only `sent`."""
    with socket.create_connection(_address(server), timeout=WAIT_S) as sock:
        sock.sendall(sent)
        started = time.monotonic()
        while sock.recv(4096):  # whatever it answers, until it closes
            pass
        return time.monotonic() - started


@pytest.mark.parametrize(
    "sent",
    [
        b"POST /api/v1/create_session HTTP/1.1\r\nHost: tuneloop\r\nX-API-",
        b"POST /api/v1/create_session HTTP/1.1\r\nHost: tuneloop\r\n"
        b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"tags":',
        b"",
    ],
    ids=["half-headers", "half-body", "nothing"],
)
def test_half_sent_requests_are_disconnected(server: LiveServer, sent: bytes) -> None:
    assert _closed_after(server, sent) < READ_TIMEOUT_S + SLACK_S
    # Meanwhile, and after, everyone else is answered.
    assert httpx.get(f"{server.url}/api/v1/healthz", timeout=WAIT_S).status_code == 200


def test_a_slow_but_steady_client_is_not_cut_off(server: LiveServer) -> None:
    body = b'{"tags": [], "sdk_version": "slow"}'
    head = (
        b"POST /api/v1/create_session HTTP/1.1\r\nHost: tuneloop\r\n"
        + f"X-API-Key: {server.key}\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
    )
    with socket.create_connection(_address(server), timeout=WAIT_S) as sock:
        sock.sendall(head)
        for i in range(0, len(body), 12):  # a read every 0.4 s: under the body bound each time
            time.sleep(READ_TIMEOUT_S * 0.4)
            sock.sendall(body[i : i + 12])
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


# ---- the torch engine: a checkpoint whose files are gone but whose row remains -----------------


@pytest.mark.slow
def test_sampling_session_on_checkpoint_files_gone_is_a_410(tmp_path: Path) -> None:
    cache = ("--cache-dir", str(tmp_path / "cache"))
    with _serve(tmp_path, *cache, backend="torch") as live, Tenant(live, live.key) as tenant:
        session_id = tenant.session()
        model_id = tenant.model(session_id, base_model=TINY)
        path = tenant.save(model_id, 1, "gone", "save_weights_for_sampler")
        folders = [p for p in (tmp_path / "checkpoints").rglob("gone") if p.is_dir()]
        assert len(folders) == 1
        for file in folders[0].iterdir():
            os.remove(file)  # removed by hand: the row remains
        body = {"session_id": session_id, "sampling_session_seq_id": 0, "model_path": path}
        _error(tenant.post("create_sampling_session", body), 410, "model_path")
        folders[0].rmdir()
        _error(tenant.post("create_sampling_session", body), 410, "model_path")
        # The server is fine: the base model still samples.
        base = {"session_id": session_id, "sampling_session_seq_id": 1, "base_model": TINY}
        assert tenant.post("create_sampling_session", base).status_code == 200
