"""A local sandbox for model-written Python: run it against unit tests, contained.

`run_python(code, tests)` runs the solution, then the tests against it, in a separate process
tree (`sandbox_child.py`, started with the base interpreter in isolated mode) and returns a
`SandboxResult`. What contains the run, as root (how the project's CI runs it):

- its own temporary work dir (its cwd, HOME and TMPDIR; removed afterwards), the only writable
  place: every mount is read-only in a private mount namespace, and /tmp, /var/tmp, /dev/shm,
  /run, /root, /home, /mnt, /media, /srv and the temp root are replaced by empty read-only
  tmpfs (the interpreter's prefix and the work dir are bound back at their own paths). Files
  readable by any user elsewhere (the system, the repository when it lives outside those areas)
  stay readable: "outside" means secrets, scratch areas, sockets and other runs' files;
- a network namespace with no usable interface: no host is reachable, 127.0.0.1 included;
- a pid namespace whose init is the worker's supervisor: when it exits every process the
  solution started dies with it; and the whole process group is SIGKILLed at the wall-time limit;
- a fresh uid/gid per run that owns nothing but the work dir, no supplementary groups,
  no_new_privs; so root-only files are unreadable and RLIMIT_NPROC binds (fork bombs stop at
  `max_processes`), and leftover processes are found and killed by that uid;
- resource limits: address space (`memory_mb`), CPU seconds, processes, file size, open files,
  no core dumps; stdout/stderr read through pipes with a byte cap (over it the run is killed),
  and only a bounded tail kept.

Degraded modes, each written into `SandboxResult.details` and `.isolation`:
- not root: the namespaces are entered inside a user namespace (where the kernel allows it),
  with a nested one as the privilege drop; the run keeps the caller's uid, so RLIMIT_NPROC
  counts the caller's own processes and root-only files stay unreadable only by permissions;
- namespaces unavailable (or `namespaces=False`): only the limits, the session and (as root)
  the uid; no network, filesystem or pid isolation.

The verdict is the tests' own, made where the solution cannot reach (`sandbox_harness.py`): the
tests run in a harness process of their own (its own uid as root; non-dumpable, so no ptrace or
/proc/PID/mem,fd access by a process of the same uid otherwise), which calls the solution's
functions in the solution's process over a socket pair and gets their results back as plain
data (None, bool, int, float, complex, str, bytes and lists, tuples, sets, frozensets and dicts
of them), compared there. The solution's process never holds the tests' source (a nameless file
only the harness gets), the expected values or the pipe the verdict goes out on; only the
supervisor and the harness do. So whatever the solution does to its own process (walk its
frames, search `gc` or its memory, patch builtins, return an object whose `__eq__` is always
True, exit with 0 before, during or after the tests, forge lines on any descriptor it has, fork
a child that outlives it) it changes only the values it answers with, and any exit or protocol
breach before the tests end fails the run. What it does not defend against: a solution that
computes the expected answers (e.g. from memorised public tests, or from the arguments of
calls it sees, or tests that trust solution-side helpers such as HumanEval/38's
`encode_cyclic`); a host that runs it without namespaces and not as root (then the solution
runs as the caller, unconfined, and can rewrite the interpreter the harness uses).
Limits of the boundary: a solution's module-level values are copied when it has loaded;
arguments are copies (an in-place change is not seen by the tests); classes and other objects
reach the tests only through functions that return plain data.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

__all__ = [
    "NO_CODE_PENALTY",
    "CodeRunner",
    "SandboxResult",
    "SandboxStatus",
    "extract_code",
    "reward",
    "run_python",
]

SandboxStatus = Literal["passed", "failed", "timeout", "memory", "error", "killed"]

NO_CODE_PENALTY = 0.1

_CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
# Per-run uids come from a range no distribution or container runtime hands out (they use
# < 65536 and subuid ranges from 100000 upwards), so a sandbox uid owns nothing on the host.
_UID_BASE = 1_500_000_000
_UID_SPAN = 1 << 24
_HIDDEN_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/root", "/home", "/mnt", "/media", "/srv")
_PATH = "/usr/local/bin:/usr/bin:/bin"
# After the process exits, how long to wait for its pipes to drain (anything still holding them
# has been killed by then).
_DRAIN_S = 1.0


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sandboxed run.

    status: "passed" (all tests passed, as the harness saw it; with no tests, the program exited
    0), "failed" (a test failed: AssertionError, a non-zero exit, or the solution ended or broke
    the call protocol before the tests completed), "timeout" (wall-time or CPU-time limit),
    "memory" (the memory limit), "error" (another exception, e.g. a SyntaxError, a result that is
    not plain data, or the sandbox could not start), "killed" (a signal or the output limit).
    exit_code: with tests, the tests' (0, 1 for a failed check or an exception, N for their own
    `sys.exit(N)`), or the solution's own when it ended first; without, the program's; None when
    a signal or the sandbox ended it.
    stdout/stderr: the last `tail_bytes` of each, the solution's output then the tests'.
    details: why, plus any degraded isolation. isolation: what confinement applied ("netns",
    "mountns", "pidns", "uid:N", "harness-uid:N", ...).
    """

    passed: bool
    status: SandboxStatus
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    details: str
    isolation: tuple[str, ...] = ()


class CodeRunner(Protocol):
    """What `reward` needs: `run_python` itself, or `SandboxFusionClient.run_python`."""

    def __call__(
        self, code: str, tests: str | None = None, *, timeout_s: float = ..., memory_mb: int = ...
    ) -> SandboxResult: ...


class _Tail:
    """The last `keep` bytes of a stream, and how many bytes went by in all."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.data = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.data += chunk
        if len(self.data) > self.keep:
            del self.data[: len(self.data) - self.keep]

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def run_python(
    code: str,
    tests: str | None = None,
    *,
    timeout_s: float = 10,
    memory_mb: int = 512,
    stdin: str | None = None,
    max_processes: int = 32,
    max_file_mb: int = 16,
    max_open_files: int = 256,
    max_output_bytes: int = 4 << 20,
    tail_bytes: int = 8192,
    namespaces: bool = True,
    work_root: str | None = None,
) -> SandboxResult:
    """Run `code`, then `tests` against it (Python source that uses the solution's module-level
    names: its functions, its plain values, the stdlib modules it imported), contained.

    Passed means the tests ran to their end (or, with no tests, the program exited 0).
    `stdin` is fed to the program; `max_output_bytes` bounds stdout+stderr (the run is killed
    beyond it); `namespaces=False` keeps only limits, session and uid (for hosts that forbid
    namespaces); `work_root` is where the temporary work dir is made (default: the temp dir).
    """
    sizes = {"memory_mb": memory_mb, "max_processes": max_processes, "max_file_mb": max_file_mb}
    sizes |= {"max_open_files": max_open_files, "max_output_bytes": max_output_bytes}
    for name, value in {"timeout_s": timeout_s, **sizes, "tail_bytes": tail_bytes}.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    started = time.monotonic()
    root = os.geteuid() == 0
    uid = harness_uid = None
    if root:
        uid, harness_uid = _UID_BASE + secrets.randbelow(_UID_SPAN), None
        while harness_uid in (None, uid):
            harness_uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
    workdir = tempfile.mkdtemp(prefix="tuneloop-sandbox-", dir=work_root)
    try:
        _write_solution(Path(workdir), code, uid)
        # Both files are nameless (O_TMPFILE): only the descriptors reach them. The tests'
        # goes to the harness alone, never to the solution's process.
        with tempfile.TemporaryFile() as stdin_file, tempfile.TemporaryFile() as tests_file:
            stdin_file.write((stdin or "").encode())
            stdin_file.seek(0)
            tests_file.write((tests or "").encode())
            tests_file.flush()
            outcome = _execute(
                workdir=workdir,
                uids=(uid, harness_uid),
                tests_fd=tests_file.fileno() if tests is not None else None,
                stdin_fd=stdin_file.fileno(),
                timeout_s=timeout_s,
                limits={
                    "memory_bytes": memory_mb << 20,
                    # CPU time backs the wall clock up (a spinning solution uses both equally).
                    "cpu_s": max(1, int(timeout_s) + 1),
                    "processes": max_processes,
                    "file_bytes": max_file_mb << 20,
                    "open_files": max_open_files,
                },
                namespaces=namespaces,
                max_output_bytes=max_output_bytes,
                tail_bytes=tail_bytes,
            )
    finally:
        _remove_tree(workdir)
    return _classify(outcome, timeout_s, time.monotonic() - started, tail_bytes)


def _write_solution(workdir: Path, code: str, uid: int | None) -> None:
    (workdir / "solution.py").write_text(code, encoding="utf-8")
    if uid is not None:
        for path in (workdir, *workdir.iterdir()):
            os.chown(path, uid, uid)


@dataclass
class _Outcome:
    returncode: int
    has_tests: bool
    records: list[dict[str, object]]  # the result pipe: the supervisor's and the harness's
    reports: list[dict[str, object]]  # the report pipe: the solution's word, never a pass
    streams: dict[str, _Tail]  # stdout, stderr (the solution's), tests_out, tests_err
    timed_out: bool
    output_exceeded: bool
    survivors_killed: int


def _interpreter() -> str:
    # The base interpreter, not a virtualenv's: the solution needs only the stdlib, and a venv
    # may live under /tmp, which the sandbox hides.
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _lines(tail: _Tail) -> list[dict[str, object]]:
    records = []
    for line in tail.text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def _execute(
    *,
    workdir: str,
    uids: tuple[int | None, int | None],
    tests_fd: int | None,
    stdin_fd: int,
    timeout_s: float,
    limits: dict[str, int],
    namespaces: bool,
    max_output_bytes: int,
    tail_bytes: int,
) -> _Outcome:
    # result: written by the supervisor and the harness only; report: by the solution's worker;
    # tests_out/err: the harness's own stdout and stderr, which the solution cannot read back.
    pipes = {name: os.pipe() for name in ("result", "report", "tests_out", "tests_err")}
    fds = {"result": pipes["result"][1], "report": pipes["report"][1]}
    fds |= {"harness_out": pipes["tests_out"][1], "harness_err": pipes["tests_err"][1]}
    if tests_fd is not None:
        fds["tests"] = tests_fd
    hidden = sorted({*_HIDDEN_DIRS, os.path.realpath(tempfile.gettempdir())})
    cfg = {
        "workdir": workdir,
        "uid": uids[0],
        "harness_uid": uids[1],
        "has_tests": tests_fd is not None,
        "namespaces": namespaces,
        "limits": limits,
        "hide": hidden,
        "keep": sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}),
        "fds": fds,
        "parent_pid": os.getpid(),
        "env": {"PATH": _PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
        "harness_env": {"PATH": _PATH, "HOME": "/", "LANG": "C.UTF-8"},
    }
    try:
        proc = subprocess.Popen(
            [_interpreter(), "-I", "-X", "utf8", str(_CHILD_SCRIPT), json.dumps(cfg)],
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=tuple(fds.values()),
            start_new_session=True,
            env={"PATH": _PATH, "LANG": "C.UTF-8"},
            cwd="/",
        )
    finally:
        for _, write_end in pipes.values():
            os.close(write_end)
    assert proc.stdout is not None
    assert proc.stderr is not None
    tails = {name: _Tail(tail_bytes) for name in ("stdout", "stderr", "tests_out", "tests_err")}
    tails |= {"result": _Tail(1 << 20), "report": _Tail(1 << 20)}
    streams = {proc.stdout.fileno(): tails["stdout"], proc.stderr.fileno(): tails["stderr"]}
    streams |= {pipes[name][0]: tails[name] for name in pipes}
    output = [tails[name] for name in ("stdout", "stderr", "tests_out", "tests_err")]
    timed_out = output_exceeded = False
    killed = 0
    deadline = time.monotonic() + timeout_s
    exit_seen: float | None = None
    pidfd = os.pidfd_open(proc.pid)
    with selectors.DefaultSelector() as selector:
        for fd in (*streams, pidfd):
            selector.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if exit_seen is None:
                if now >= deadline and not timed_out:
                    timed_out = True
                    _kill_group(proc.pid)
                wait = deadline - now if not timed_out else _DRAIN_S
            elif not selector.get_map() or now - exit_seen > _DRAIN_S:
                break
            else:
                wait = exit_seen + _DRAIN_S - now
            for key, _ in selector.select(timeout=max(0.0, wait)):
                if key.fd == pidfd:
                    selector.unregister(pidfd)
                    exit_seen = time.monotonic()
                    # Stragglers outside the pid namespace (degraded modes) die now.
                    _kill_group(proc.pid)
                    killed += _kill_run(uids, proc.pid)
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                streams[key.fd].add(chunk)
                if sum(t.total for t in output) > max_output_bytes and not output_exceeded:
                    output_exceeded = True
                    _kill_group(proc.pid)
    os.close(pidfd)
    returncode = proc.wait()
    killed += _kill_run(uids, proc.pid)
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    for read_end, _ in pipes.values():
        os.close(read_end)
    return _Outcome(
        returncode,
        tests_fd is not None,
        _lines(tails["result"]),
        _lines(tails["report"]),
        {name: tails[name] for name in ("stdout", "stderr", "tests_out", "tests_err")},
        timed_out,
        output_exceeded,
        killed,
    )


def _kill_run(uids: tuple[int | None, int | None], session: int) -> int:
    if uids[0] is None:
        return _kill_leftovers(None, session)
    return sum(_kill_leftovers(uid, session) for uid in uids if uid is not None)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _kill_leftovers(uid: int | None, session: int) -> int:
    """SIGKILL every process of the run's uid (or, without one, of its session) until none is
    left; returns how many were killed. A fork bomb may fork while we scan, hence the rounds."""
    killed = 0
    for _ in range(100):
        pids = processes_of(uid=uid) if uid is not None else processes_of(session=session)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.01)
    return killed


def processes_of(*, uid: int | None = None, session: int | None = None) -> list[int]:
    """Live (not zombie) pids whose real uid is `uid`, or whose session id is `session`."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
            # fields after the command name (which may hold spaces and parentheses)
            fields = stat[stat.rindex(b")") + 2 :].split()
            if fields[0] in (b"Z", b"X"):
                continue
            if session is not None and int(fields[3]) != session:
                continue
            if uid is not None and _real_uid(entry.name) != uid:
                continue
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
        found.append(int(entry.name))
    return found


def _real_uid(pid: str) -> int:
    # Not the owner of /proc/PID: a process whose uid changed is non-dumpable, and those
    # directories belong to root.
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"Uid:"):
                return int(line.split()[1])
    return -1


def _remove_tree(path: str) -> None:
    def make_writable(func: object, target: str, exc: object) -> None:
        # A solution may chmod its own dirs to 000; the owner (or root) can always undo that.
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
        with contextlib.suppress(OSError):
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target, ignore_errors=True)
            else:
                os.unlink(target)

    shutil.rmtree(path, onerror=make_writable)


def _strings(value: object) -> list[str]:
    return [str(item) for item in value] if isinstance(value, list) else []


def _readable_by_others(path: str) -> bool:
    """Whether an unrelated uid can reach `path` (every directory on the way searchable)."""
    current = Path(os.path.realpath(path))
    for directory in (current, *current.parents):
        with contextlib.suppress(OSError):
            if not directory.stat().st_mode & 0o001:
                return False
    return True


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last(records: list[dict[str, object]], key: str) -> dict[str, object] | None:
    value = next((r[key] for r in reversed(records) if key in r), None)
    return value if isinstance(value, dict) else None


def _int(record: dict[str, object] | None, key: str) -> int | None:
    value = record.get(key) if record else None
    return value if type(value) is int else None


def _joined(first: _Tail, second: _Tail, keep: int) -> str:
    return bytes(first.data + second.data)[-keep:].decode("utf-8", errors="replace")


def _classify(
    outcome: _Outcome, timeout_s: float, duration_s: float, tail_bytes: int
) -> SandboxResult:
    # Trusted: the result pipe (supervisor, harness). The report pipe is the solution's own word:
    # it may say why the solution failed, it never makes a pass.
    records, reports = outcome.records, outcome.reports
    setup = next((r for r in records if "setup" in r), None)
    worker, harness, verdict = (_last(records, k) for k in ("worker", "harness", "verdict"))
    setup_error = next((r["setup_error"] for r in records + reports if "setup_error" in r), None)
    setup_error = str(setup_error)[:500] if setup_error is not None else None
    solution_failure = next((r for r in reports if "exception" in r), None)
    if outcome.has_tests:
        passed = verdict is not None and verdict.get("passed") is True
        passed = passed and harness == {"exit": 0}
    else:
        passed = worker == {"exit": 0}
    exception: str | None = None
    phase = "solution"
    ended = worker  # whose status explains a failure
    if outcome.has_tests and verdict is None:
        ended = harness  # the harness itself died: a signal, a limit
    elif verdict is not None and not verdict.get("gone"):
        # the harness ran the tests: its own account, not the solution's
        ended = None
        exception = str(verdict["exception"]) if verdict.get("exception") else None
        phase = str(verdict.get("phase", "tests"))
    if ended is worker and solution_failure is not None:
        exception = str(solution_failure["exception"])[:100]
    exit_code = _int(verdict, "exit") if ended is None else _int(ended, "exit")
    sig = None if ended is None or (ended or {}).get("stopped") else _int(ended, "signal")
    if ended is None and worker is None and harness is None and outcome.returncode < 0:
        sig = -outcome.returncode
    stdout = _joined(outcome.streams["stdout"], outcome.streams["tests_out"], tail_bytes)
    stderr = _joined(outcome.streams["stderr"], outcome.streams["tests_err"], tail_bytes)
    gone = str(verdict["gone"]) if verdict and verdict.get("gone") else None
    status: SandboxStatus
    if outcome.timed_out:
        status, why = "timeout", f"wall-time limit of {timeout_s:g} s reached: killed"
        exit_code = None
    elif outcome.output_exceeded:
        status, why = "killed", "output limit exceeded: killed"
        exit_code = None
    elif passed:
        status, why = "passed", "all tests passed" if outcome.has_tests else "exited with code 0"
    elif setup_error is not None:
        status, why = "error", f"the sandbox could not start the solution: {setup_error}"
    elif setup is None:
        status, why = "error", f"the sandbox did not start (exit {outcome.returncode})"
    elif sig == signal.SIGXCPU:
        status, why = "timeout", "CPU-time limit reached"
    elif exception == "MemoryError" or (exception is None and "MemoryError" in stderr):
        status, why = "memory", "memory limit reached (MemoryError)"
    elif sig is not None:
        whose = " (the tests' process)" if ended is harness else ""
        status, why = "killed", f"killed by {_signal_name(sig)}{whose}"
    elif exception == "AssertionError":
        status, why = "failed", f"AssertionError in {phase}"
    elif exception in ("SystemExit", None) and exit_code not in (0, None):
        status, why = "failed", f"exited with code {exit_code}"
    elif exception not in (None, "SystemExit"):
        status, why = "error", f"{exception} in {phase}"
    elif outcome.has_tests and verdict is None:
        status, why = "error", "the tests' process ended without a verdict"
    else:
        status, why = "failed", gone or "exited before its tests completed"
    isolation = tuple(_strings(setup.get("setup"))) if setup else ()
    notes = _strings(setup.get("notes")) if setup else []
    if setup and "mountns" not in isolation and not _readable_by_others(sys.base_prefix):
        notes.append(
            f"{sys.base_prefix} is not readable by other users: without a mount namespace the"
            " solution can import only the modules the interpreter loaded at startup"
        )
    # In a pid namespace the kernel already killed them (the sweep only catches them dying).
    if outcome.survivors_killed and "pidns" not in isolation:
        notes.append(f"killed {outcome.survivors_killed} leftover process(es)")
    return SandboxResult(
        passed=status == "passed",
        status=status,
        exit_code=exit_code,
        stdout=stdout,
        stderr=stderr,
        duration_s=duration_s,
        details="; ".join([why, *notes]),
        isolation=isolation,
    )


_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}


def extract_code(text: str) -> str | None:
    """The answer's code: the LAST fenced block tagged python (py, python3), else the last
    untagged block; None when there is none (an unclosed fence, cut off by the token limit, does
    not count). The last, because models show a draft or an example first and the answer last."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(text)]
    tagged = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    untagged = [body for tag, body in blocks if not tag]
    chosen = tagged or untagged
    return chosen[-1] if chosen else None


def reward(
    completion: str,
    tests: str,
    *,
    runner: CodeRunner = run_python,
    timeout_s: float = 10,
    memory_mb: int = 512,
) -> float:
    """1.0 if the completion's code passes every test, else 0.0; -NO_CODE_PENALTY (-0.1) when
    the completion has no code block at all (nothing is run then)."""
    code = extract_code(completion)
    if code is None:
        return -NO_CODE_PENALTY
    result = runner(code, tests, timeout_s=timeout_s, memory_mb=memory_mb)
    return 1.0 if result.passed else 0.0
