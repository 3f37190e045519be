"""ServiceClient() with no address starts a local server and never leaves it behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

# The user's loop, unchanged whether the server is local or remote. The fake backend keeps the
# test fast; the default is the torch engine.
SCRIPT = textwrap.dedent(
    """
    import sys, time
    import tuneloop
    from tuneloop import AdamParams, Datum, ModelInput
    from tuneloop import _embedded

    service = tuneloop.ServiceClient()
    print("server-pid", _embedded._server.process.pid, flush=True)
    training = service.create_lora_training_client("tuneloop/fake-tiny", rank=4)
    datum = Datum(model_input=ModelInput.from_ints([1, 2, 3]),
                  loss_fn_inputs={"target_tokens": [2, 3, 4]})
    loss = training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    training.optim_step(AdamParams(learning_rate=0.01)).result()
    print("trained", loss, flush=True)
    if sys.argv[1] == "close":
        service.close()
        print("closed", flush=True)
    elif sys.argv[1] == "exit":
        print("exiting without close", flush=True)
    else:
        time.sleep(600)  # killed by the test
    """
)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TUNELOOP_BASE_URL",)}
    env.update(TUNELOOP_HOME=str(tmp_path), TUNELOOP_SERVE_ARGS="--backend fake")
    return env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.2)
    return False


def _server_pid(output: str) -> int:
    line = next(x for x in output.splitlines() if x.startswith("server-pid"))
    return int(line.split()[1])


@pytest.mark.parametrize("ending", ["close", "exit"])
def test_local_server_starts_trains_and_stops_with_the_client(tmp_path: Path, ending: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, ending],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trained" in done.stdout
    assert _gone_within(_server_pid(done.stdout), 15), "the local server outlived its client"
    # The local tenant's key is kept (owner-only) and reused by the next start.
    key_file = tmp_path / "embedded" / "local-api-key"
    assert key_file.read_text().startswith("tml-")
    assert key_file.stat().st_mode & 0o077 == 0


def test_local_server_stops_when_its_client_is_killed(tmp_path: Path) -> None:
    client = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "hang"],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert client.stdout is not None
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = client.stdout.readline()
            lines.append(line)
            if line.startswith("trained") or not line:
                break
        server_pid = _server_pid("".join(lines))
        client.send_signal(signal.SIGKILL)  # no atexit, no close(): the server must notice
        client.wait(30)
        assert _gone_within(server_pid, 15), "the local server outlived a killed client"
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(30)
        if client.stdout is not None:
            client.stdout.close()
