"""The `run_python` contract over a SandboxFusion service (`--sandbox-url`).

SandboxFusion (github.com/bytedance/SandboxFusion) runs code in its own containers behind
`POST {url}/run_code`: request `{code, language: "python", run_timeout, compile_timeout,
memory_limit_MB, stdin}`, response `{status: "Success" | "Failed" | "SandboxError", message,
run_result: {status: "Finished" | "Error" | "TimeLimitExceeded", execution_time, return_code,
stdout, stderr}, ...}`. Its verdict is the exit code alone, so the program sent is a small runner
that executes the solution, then the tests, in one namespace and prints a per-request nonce last,
as the local sandbox does: a solution that exits early does not pass. The runner also names the
exception that ended the run on stderr, which maps to the same statuses as `run_python`.

A service that cannot be reached, or answers 5xx, is retried a few times, then reported as a
`SandboxResult` with status "error": one bad request fails its own sample, not the recipe.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import httpx

from tuneloop.recipes.sandbox import CodeRunner, SandboxResult, SandboxStatus, run_python

__all__ = ["SandboxFusionClient", "code_runner"]

_EXCEPTION_MARK = "__tuneloop_sandbox_exception__"
# The runner sent to the service: solution then tests, exits judged as in sandbox_child.py.
_RUNNER = """\
import sys, traceback
_phases = [("solution", "solution.py", {code!r})]
if {tests!r} is not None:
    _phases.append(("tests", "tests.py", {tests!r}))
_namespace = {{"__name__": "__main__"}}
for _index, (_phase, _filename, _source) in enumerate(_phases):
    try:
        exec(compile(_source, _filename, "exec"), _namespace)
    except BaseException as _exc:
        if isinstance(_exc, SystemExit) and _exc.code in (0, None) and _index == len(_phases) - 1:
            break
        if not isinstance(_exc, SystemExit):
            traceback.print_exception(type(_exc), _exc, _exc.__traceback__.tb_next)
        print({mark!r}, type(_exc).__name__, _phase, file=sys.stderr, flush=True)
        sys.stdout.flush()
        _code = _exc.code if isinstance(_exc, SystemExit) else 1
        sys.exit(_code if isinstance(_code, int) and _code != 0 else 1)
sys.stdout.flush()
print()
print({nonce!r}, flush=True)
"""


class SandboxFusionClient:
    """`run_python` against a SandboxFusion endpoint; thread-safe (one pooled httpx client)."""

    def __init__(
        self,
        url: str,
        *,
        request_timeout_s: float = 30,
        retries: int = 2,
        backoff_s: float = 0.5,
        tail_chars: int = 8192,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.tail_chars = tail_chars
        self.request_timeout_s = request_timeout_s
        self._http = httpx.Client(transport=transport, timeout=request_timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SandboxFusionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_python(
        self,
        code: str,
        tests: str | None = None,
        *,
        timeout_s: float = 10,
        memory_mb: int = 512,
        stdin: str | None = None,
    ) -> SandboxResult:
        """Same contract as `tuneloop.recipes.sandbox.run_python`, run by the service."""
        nonce = secrets.token_hex(16)
        program = _RUNNER.format(code=code, tests=tests, mark=_EXCEPTION_MARK, nonce=nonce)
        request = {
            "code": program,
            "language": "python",
            "run_timeout": timeout_s,
            "compile_timeout": timeout_s,
            "memory_limit_MB": memory_mb,
            "stdin": stdin,
        }
        started = time.monotonic()
        try:
            body = self._post(request, timeout_s)
        except (httpx.HTTPError, ValueError) as exc:
            return self._result("error", None, "", "", started, f"sandbox-fusion: {exc}")
        return self._interpret(body, nonce, started, timeout_s)

    def _post(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        # The run itself may take timeout_s: the HTTP timeout must outlast it.
        timeout = httpx.Timeout(self.request_timeout_s + timeout_s, connect=10)
        for attempt in range(self.retries + 1):
            try:
                response = self._http.post(f"{self.url}/run_code", json=request, timeout=timeout)
                if response.status_code < 500 or attempt == self.retries:
                    response.raise_for_status()
                    body = response.json()
                    if not isinstance(body, dict):
                        raise ValueError(f"unexpected response: {body!r:.200}")
                    return body
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
            time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _interpret(
        self, body: dict[str, Any], nonce: str, started: float, timeout_s: float
    ) -> SandboxResult:
        run = body.get("run_result") or {}
        stdout = str(run.get("stdout") or "")
        stderr = str(run.get("stderr") or "")
        code = run.get("return_code")
        exit_code = code if isinstance(code, int) else None
        exception, phase = _exception(stderr)
        stderr = "\n".join(line for line in stderr.splitlines() if _EXCEPTION_MARK not in line)
        lines = stdout.rstrip("\n").split("\n")
        done = lines[-1] == nonce
        if done:
            # the runner's blank line and nonce are not the program's output
            stdout = "\n".join(lines[:-2]) + ("\n" if len(lines) > 2 else "")
        status: SandboxStatus
        if body.get("status") == "SandboxError" or run.get("status") == "Error":
            status, why = "error", f"sandbox-fusion error: {body.get('message') or stderr[-200:]}"
        elif run.get("status") == "TimeLimitExceeded":
            status, why, exit_code = "timeout", f"wall-time limit of {timeout_s:g} s reached", None
        elif done and exit_code == 0:
            status, why = "passed", "all tests passed"
        elif exception == "MemoryError":
            status, why = "memory", "memory limit reached (MemoryError)"
        elif exception == "AssertionError":
            status, why = "failed", f"AssertionError in {phase}"
        elif exception not in (None, "SystemExit"):
            status, why = "error", f"{exception} in {phase}"
        elif exit_code is not None and (exit_code < 0 or exit_code > 128):
            status, why = "killed", f"killed (exit {exit_code})"
        elif exit_code not in (0, None):
            status, why = "failed", f"exited with code {exit_code}"
        else:
            status, why = "failed", "exited before its tests completed"
        return self._result(status, exit_code, stdout, stderr, started, why)

    def _result(
        self,
        status: SandboxStatus,
        exit_code: int | None,
        stdout: str,
        stderr: str,
        started: float,
        details: str,
    ) -> SandboxResult:
        return SandboxResult(
            passed=status == "passed",
            status=status,
            exit_code=exit_code,
            stdout=stdout[-self.tail_chars :],
            stderr=stderr[-self.tail_chars :],
            duration_s=time.monotonic() - started,
            details=details,
            isolation=("sandbox-fusion",),
        )


def _exception(stderr: str) -> tuple[str | None, str]:
    for line in reversed(stderr.splitlines()):
        if line.startswith(_EXCEPTION_MARK):
            parts = line.split()
            if len(parts) == 3:
                return parts[1], parts[2]
    return None, ""


def code_runner(sandbox_url: str | None) -> CodeRunner:
    """What a recipe's `--sandbox-url` selects: the local sandbox, or the service at that URL."""
    if sandbox_url is None:
        return run_python
    return SandboxFusionClient(sandbox_url).run_python
