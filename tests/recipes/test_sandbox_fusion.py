"""The SandboxFusion client (`tuneloop.recipes.sandbox_fusion`) against a stand-in service.

The real SandboxFusion service is not available offline, so `StandInSandboxFusion` stands in for
it on 127.0.0.1: it implements the documented `POST /run_code` shape (request `code`, `language`,
`run_timeout`, `memory_limit_MB`, `stdin`; response `status`, `message`, `run_result` with
`status` Finished/TimeLimitExceeded, `return_code`, `stdout`, `stderr`, `execution_time`) by
running the program with a plain `python -I` subprocess (no containment: the code here is ours).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tuneloop.recipes.sandbox import reward, run_python
from tuneloop.recipes.sandbox_fusion import SandboxFusionClient, code_runner


class StandInSandboxFusion(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict[str, Any]] = []
        # scripted failures, consumed first: ("http", 503) or ("body", {...})
        self.script: list[tuple[str, Any]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: StandInSandboxFusion

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(request)
        if self.path != "/run_code":
            return self._send(404, {"detail": "Not Found"})
        if self.server.script:
            kind, value = self.server.script.pop(0)
            return (
                self._send(value, {"detail": "down"}) if kind == "http" else self._send(200, value)
            )
        return self._send(200, _run(request))

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _run(request: dict[str, Any]) -> dict[str, Any]:
    assert request["language"] == "python"
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", request["code"]],
            input=request.get("stdin") or "",
            capture_output=True,
            text=True,
            timeout=request["run_timeout"],
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        result = {
            "status": "TimeLimitExceeded",
            "return_code": None,
            "stdout": str(exc.stdout or ""),
        }
        return {"status": "Failed", "message": "", "run_result": result}
    result = {
        "status": "Finished",
        "execution_time": time.monotonic() - started,
        "return_code": done.returncode,
        "stdout": done.stdout,
        "stderr": done.stderr,
    }
    status = "Success" if done.returncode == 0 else "Failed"
    return {"status": status, "message": "", "compile_result": None, "run_result": result}


@pytest.fixture
def service() -> Iterator[StandInSandboxFusion]:
    server = StandInSandboxFusion()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def client(service: StandInSandboxFusion) -> Iterator[SandboxFusionClient]:
    with SandboxFusionClient(service.url + "/", request_timeout_s=10, backoff_s=0.01) as client:
        yield client


TESTS = "assert add(2, 3) == 5\n"


def test_request_shape_and_a_pass(
    service: StandInSandboxFusion, client: SandboxFusionClient
) -> None:
    result = client.run_python(
        "def add(a, b):\n    print('adding')\n    return a + b\n", TESTS, timeout_s=5, memory_mb=256
    )
    assert result.passed, result
    assert (result.status, result.exit_code, result.stdout) == ("passed", 0, "adding\n")
    assert result.isolation == ("sandbox-fusion",)
    (sent,) = service.requests
    assert sent["language"] == "python"
    assert (sent["run_timeout"], sent["memory_limit_MB"], sent["stdin"]) == (5, 256, None)


def test_failures_map_to_the_local_statuses(client: SandboxFusionClient) -> None:
    wrong = client.run_python("def add(a, b):\n    return a - b\n", TESTS)
    assert (wrong.passed, wrong.status, wrong.details) == (
        False,
        "failed",
        "AssertionError in tests",
    )
    assert "AssertionError" in wrong.stderr
    assert "__tuneloop" not in wrong.stderr
    broken = client.run_python("def add(a, b)\n", TESTS)
    assert (broken.status, broken.details) == ("error", "SyntaxError in solution")
    memory = client.run_python("raise MemoryError\n", TESTS)
    assert memory.status == "memory"
    looping = client.run_python("while True:\n    pass\n", TESTS, timeout_s=1)
    assert (looping.status, looping.exit_code) == ("timeout", None)


def test_an_early_exit_does_not_pass(client: SandboxFusionClient) -> None:
    for code in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
        result = client.run_python(code, "assert False\n")
        assert (result.passed, result.status) == (False, "failed"), (code, result)


def test_program_mode_with_stdin(client: SandboxFusionClient) -> None:
    result = client.run_python("a, b = map(int, input().split())\nprint(a * b)\n", stdin="6 7\n")
    assert result.passed, result
    assert result.stdout == "42\n"
    exits = client.run_python("import sys\nsys.exit(4)\n")
    assert (exits.status, exits.exit_code) == ("failed", 4)


def test_service_errors_are_results_not_exceptions(
    service: StandInSandboxFusion, client: SandboxFusionClient
) -> None:
    service.script = [("http", 503), ("http", 502)]
    retried = client.run_python("def add(a, b):\n    return a + b\n", TESTS)
    assert retried.passed, retried
    assert len(service.requests) == 3

    service.script = [("http", 503)] * 3
    down = client.run_python("pass\n")
    assert (down.passed, down.status) == (False, "error")
    assert "503" in down.details

    service.script = [
        ("body", {"status": "SandboxError", "message": "no runner", "run_result": None})
    ]
    sandbox_error = client.run_python("pass\n")
    assert sandbox_error.status == "error"
    assert "no runner" in sandbox_error.details


def test_an_unreachable_service_is_an_error_result() -> None:
    with SandboxFusionClient("http://127.0.0.1:9", retries=1, backoff_s=0.01) as client:
        started = time.monotonic()
        result = client.run_python("pass\n")
    assert (result.passed, result.status) == (False, "error")
    assert "sandbox-fusion" in result.details
    assert time.monotonic() - started < 5


def test_code_runner_selects_by_url_and_feeds_reward(service: StandInSandboxFusion) -> None:
    assert code_runner(None) is run_python
    runner = code_runner(service.url)
    completion = "```python\ndef add(a, b):\n    return a + b\n```"
    assert reward(completion, TESTS, runner=runner) == 1.0
    assert reward("```python\nadd = max\n```", "assert add(-1, -2) == -3\n", runner=runner) == 0.0
    assert reward("no code", TESTS, runner=runner) == -0.1
    assert len(service.requests) == 2
