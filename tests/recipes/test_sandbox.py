"""The code-RL sandbox (`tuneloop.recipes.sandbox`): verdicts, and containment of hostile code.

What these tests rely on, as the project's CI runs them (root on Debian with util-linux):
- root: the solution runs as a fresh uid, so leftover processes are found by that uid and
  root-only files are unreadable; without root only the user-namespace test below applies;
- namespaces (network, mount, pid): as root a missing one FAILS the containment tests (CI must
  provide them); not root, they are skipped naming what the host refused.
Each hostile solution comes with tests that would pass only if the attack worked, so a leak shows
up as a `passed` verdict; after each, a plain run must still pass (the recipe continues).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tuneloop.recipes import sandbox
from tuneloop.recipes.sandbox import SandboxResult, extract_code, processes_of, reward, run_python

REPO = Path(__file__).resolve().parents[2]
ROOT = os.geteuid() == 0


def _uid(result: SandboxResult) -> int:
    return next(int(item[4:]) for item in result.isolation if item.startswith("uid:"))


def _assert_no_survivors(result: SandboxResult) -> None:
    if ROOT:
        assert processes_of(uid=_uid(result)) == [], "a sandbox process survived its run"


def _assert_next_run_works() -> None:
    result = run_python("def f():\n    return 41 + 1\n", "assert f() == 42\n", timeout_s=5)
    assert result.passed, result


@pytest.fixture(scope="module")
def isolation() -> tuple[str, ...]:
    """What this host grants, from one plain run; the containment tests need all of it."""
    result = run_python("pass")
    assert result.passed, result
    needed = {"netns", "mountns", "pidns", "readonly-fs"}
    missing = needed - set(result.isolation)
    if missing:
        reason = f"this host refused {sorted(missing)}: {result.details}"
        if ROOT:
            pytest.fail(f"running as root, the sandbox must get namespaces; {reason}")
        pytest.skip(reason)
    return result.isolation


# ---- verdicts ---------------------------------------------------------------------------------


def test_passing_and_failing_solutions() -> None:
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
    good = run_python("def add(a, b):\n    print('adding')\n    return a + b\n", tests)
    assert good.passed
    assert good.status == "passed"
    assert good.exit_code == 0
    assert good.stdout == "adding\nadding\n"
    assert 0 < good.duration_s < 5

    bad = run_python("def add(a, b):\n    return a - b\n", tests)
    assert (bad.passed, bad.status, bad.exit_code) == (False, "failed", 1)
    assert "AssertionError" in bad.stderr
    assert "tests.py" in bad.stderr

    broken = run_python("def add(a, b)\n    return a + b\n", tests)
    assert (broken.status, broken.details) == ("error", "SyntaxError in solution")

    raising = run_python("def add(a, b):\n    return a + None\n", tests)
    assert raising.status == "error"
    assert "TypeError" in raising.details


def test_program_mode_reads_stdin_and_exit_codes_count() -> None:
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    result = run_python(code, stdin="3 4\n")
    assert result.passed
    assert result.stdout == "7\n"

    exits = run_python("import sys\nsys.exit(3)\n")
    assert (exits.passed, exits.status, exits.exit_code) == (False, "failed", 3)
    # with no tests the exit code is the whole verdict, however the program ends
    assert run_python("import os\nos._exit(0)\n").passed


def test_an_early_exit_does_not_pass_the_tests() -> None:
    failing_tests = "assert False, 'never reached'\n"
    for code in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "raise SystemExit\n"):
        result = run_python(code, failing_tests)
        assert (result.passed, result.status) == (False, "failed"), (code, result)
    # a test runner's own exit(0) after its checks is a pass
    unittest_style = "import sys\nassert VALUE == 1\nsys.exit(0)\n"
    assert run_python("VALUE = 1\n", unittest_style).passed


def test_the_solution_cannot_rewrite_its_tests() -> None:
    code = "open('tests.py', 'w').write('pass\\n')\n"
    result = run_python(code, "assert False, 'the real test'\n")
    assert result.status == "failed"
    assert "the real test" in result.stderr


def test_the_work_dir_is_private_writable_and_removed(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import os, tempfile
        open("notes.txt", "w").write("scratch")
        fd, path = tempfile.mkstemp()
        print(open("notes.txt").read(), os.path.dirname(path) == os.getcwd())
        """
    )
    result = run_python(code, work_root=str(tmp_path))
    assert result.passed, result
    assert result.stdout == "scratch True\n"
    assert list(tmp_path.iterdir()) == [], "the work dir must be removed after the run"


def test_concurrent_runs_are_independent() -> None:
    results: list[SandboxResult] = []

    def one(i: int) -> None:
        results.append(run_python(f"X = {i}\n", f"assert X == {i}\n"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert [r.passed for r in results] == [True] * 3, results
    if ROOT:
        assert len({_uid(r) for r in results}) == 3, "each run gets a uid of its own"


# ---- hostile code -----------------------------------------------------------------------------


def test_infinite_loop_is_killed_at_the_wall_time_limit(isolation: tuple[str, ...]) -> None:
    result = run_python("while True:\n    pass\n", "assert True\n", timeout_s=1)
    assert (result.passed, result.status, result.exit_code) == (False, "timeout", None)
    assert 1 <= result.duration_s < 2.5
    _assert_no_survivors(result)
    _assert_next_run_works()


def test_sleeping_loop_with_children_is_killed_with_them(isolation: tuple[str, ...]) -> None:
    code = textwrap.dedent(
        """
        import subprocess, time
        subprocess.Popen(["sleep", "60"], start_new_session=True)
        time.sleep(60)
        """
    )
    result = run_python(code, timeout_s=1)
    assert result.status == "timeout"
    assert result.duration_s < 2.5
    _assert_no_survivors(result)


def test_fork_bomb_is_contained(isolation: tuple[str, ...]) -> None:
    bomb = textwrap.dedent(
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """
    )
    result = run_python(bomb, "assert True\n", timeout_s=2, max_processes=16)
    assert (result.passed, result.status) == (False, "timeout"), result
    assert result.duration_s < 4
    _assert_no_survivors(result)
    # the machine stays usable: this process can still start processes, and sandboxes still run
    assert subprocess.run(["true"], check=False, timeout=10).returncode == 0
    _assert_next_run_works()


def test_huge_allocation_is_a_memory_error(isolation: tuple[str, ...]) -> None:
    at_once = run_python("blob = bytearray(8 << 30)\n", "assert len(blob)\n", memory_mb=256)
    assert (at_once.passed, at_once.status) == (False, "memory"), at_once
    growing = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    gradual = run_python(growing, memory_mb=256, timeout_s=5)
    assert gradual.status == "memory", gradual
    assert gradual.duration_s < 4
    _assert_next_run_works()


def test_output_flood_is_cut_off(isolation: tuple[str, ...]) -> None:
    result = run_python(
        "while True:\n    print('x' * 1000)\n", max_output_bytes=1 << 20, tail_bytes=4096
    )
    assert (result.passed, result.status) == (False, "killed"), result
    assert "output limit" in result.details
    assert len(result.stdout) <= 4096
    assert result.duration_s < 5
    _assert_no_survivors(result)


def test_reading_files_outside_the_work_dir_fails(
    isolation: tuple[str, ...], tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    secret.chmod(0o600)
    shared = tmp_path / "shared.txt"
    shared.write_text("SHARED")
    shared.chmod(0o644)
    targets = [str(secret), str(shared), "/etc/shadow", "/proc/1/environ", "/root/.bashrc"]
    code = textwrap.dedent(
        f"""
        leaked = []
        for path in {targets!r}:
            try:
                leaked.append((path, open(path).read(100)))
            except OSError as exc:
                print(path, type(exc).__name__)
        """
    )
    result = run_python(code, "assert leaked, 'nothing leaked'\n")
    assert (result.passed, result.status) == (False, "failed"), result
    assert "nothing leaked" in result.stderr
    assert len(result.stdout.splitlines()) == len(targets)
    # the scratch areas are not even listable: other runs' files, sockets, users' homes
    listing = run_python("import os\nprint(os.listdir('/tmp'), os.listdir('/run'))\n")
    assert listing.passed
    assert "pytest" not in listing.stdout
    assert "postgresql" not in listing.stdout
    _assert_next_run_works()


@pytest.fixture
def tcp_listener() -> Iterator[socket.socket]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    yield listener
    listener.close()


def test_network_access_fails(isolation: tuple[str, ...], tcp_listener: socket.socket) -> None:
    port = tcp_listener.getsockname()[1]
    # The listener is reachable from here, so a connection from the sandbox would be seen.
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    time.sleep(0.05)
    tcp_listener.accept()[0].close()
    sock_dir = tempfile.mkdtemp(prefix="tl-sock-")
    unix_path = os.path.join(sock_dir, "s")
    unix_listener = socket.socket(socket.AF_UNIX)
    unix_listener.bind(unix_path)
    unix_listener.listen(1)
    unix_listener.setblocking(False)
    try:
        code = textwrap.dedent(
            f"""
            import socket
            connected = []
            for address in [("127.0.0.1", {port}), ("127.0.0.1", 5432), ("1.1.1.1", 53),
                            ("8.8.8.8", 443)]:
                try:
                    socket.create_connection(address, timeout=1).close()
                    connected.append(address)
                except OSError as exc:
                    print(address, type(exc).__name__)
            for path in [{unix_path!r}, "/run/postgresql/.s.PGSQL.5432"]:
                try:
                    s = socket.socket(socket.AF_UNIX)
                    s.settimeout(1)
                    s.connect(path)
                    connected.append(path)
                except OSError as exc:
                    print(path, type(exc).__name__)
            """
        )
        result = run_python(code, "assert connected, 'no connection'\n", timeout_s=10)
        assert (result.passed, result.status) == (False, "failed"), result
        assert len(result.stdout.splitlines()) == 6, result.stdout
        for listener in (tcp_listener, unix_listener):
            with pytest.raises(BlockingIOError):
                listener.accept()
    finally:
        unix_listener.close()
        shutil.rmtree(sock_dir)
    _assert_next_run_works()


def test_writes_outside_the_work_dir_fail(isolation: tuple[str, ...], tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    targets = [
        tmp_path / f"out-{tag}",
        Path(tempfile.gettempdir()) / f"tuneloop-probe-{tag}",
        Path("/var/tmp") / f"tuneloop-probe-{tag}",
        Path("/dev/shm") / f"tuneloop-probe-{tag}",
        REPO / f"probe-{tag}",
    ]
    tmp_path.chmod(0o777)  # even a world-writable directory outside is not writable
    code = textwrap.dedent(
        f"""
        import os
        wrote = []
        for path in {[str(t) for t in targets]!r}:
            for attempt in (lambda: open(path, "w").write("x"), lambda: os.mkdir(path + ".d")):
                try:
                    attempt()
                    wrote.append(path)
                except OSError as exc:
                    print(path, type(exc).__name__)
        open("inside.txt", "w").write("fine")
        """
    )
    result = run_python(code, "assert wrote, 'nothing written'\n")
    assert (result.passed, result.status) == (False, "failed"), result
    assert len(result.stdout.splitlines()) == 2 * len(targets)
    for target in targets:
        assert not target.exists(), target
        assert not Path(f"{target}.d").exists(), target
    _assert_next_run_works()


# Only modules the interpreter has loaded already: without a mount namespace the sandbox uid may
# not be able to read the interpreter's stdlib (here it lives in root's home).
BACKGROUND = textwrap.dedent(
    """
    import os, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(60)
        os._exit(0)
    if os.fork() == 0:
        os.setpgid(0, 0)
        os.execv("/bin/sleep", ["sleep", "60"])
    print("main done")
    """
)


def test_a_child_left_running_after_exit_is_killed(isolation: tuple[str, ...]) -> None:
    result = run_python(BACKGROUND)
    assert result.stdout == "main done\n"
    assert result.duration_s < 3
    _assert_no_survivors(result)
    _assert_next_run_works()


# ---- degraded modes ---------------------------------------------------------------------------


@pytest.mark.skipif(not ROOT, reason="the uid sweep needs root (a fresh uid per run)")
def test_without_namespaces_root_still_contains_processes_and_secrets(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    secret.chmod(0o600)
    result = run_python(BACKGROUND, namespaces=False)
    assert "namespaces disabled" in result.details
    assert "netns" not in result.isolation
    if not sandbox._readable_by_others(sys.base_prefix):
        assert "not readable by other users" in result.details
    assert result.stdout == "main done\n"
    _assert_no_survivors(result)
    looping = run_python("while True:\n    pass\n", timeout_s=1, namespaces=False)
    assert looping.status == "timeout"
    assert looping.duration_s < 2.5
    _assert_no_survivors(looping)
    reading = run_python(f"open({str(secret)!r}).read()\n", namespaces=False)
    assert reading.status == "error"
    assert "PermissionError" in reading.stderr


def _python_for_nobody() -> str | None:
    """An interpreter (3.11+) that uid 65534 may run: the base one may sit in root's home."""
    for candidate in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        try:
            probe = subprocess.run(
                [candidate, "-c", "import sys; assert sys.version_info >= (3, 11)"],
                user=65534,
                group=65534,
                extra_groups=[],
                capture_output=True,
                check=False,
                timeout=30,
            )
        except OSError:
            continue
        if probe.returncode == 0:
            return candidate
    return None


@pytest.mark.skipif(not ROOT, reason="starting a process as another user needs root")
def test_an_unprivileged_caller_gets_a_user_namespace_sandbox() -> None:
    """The sandbox started by uid 65534: namespaces inside a user namespace, nested for the drop.
    `sandbox.py` is loaded by path (stdlib only), as the package's dependencies may not be
    readable by that user."""
    python = _python_for_nobody()
    if python is None:
        pytest.skip("no Python 3.11+ interpreter that uid 65534 can run on this host")
    hostile = textwrap.dedent(
        """
        import ctypes, os, socket
        for attempt in (lambda: socket.create_connection(("127.0.0.1", 5432), timeout=1),
                        lambda: open("/tmp/tuneloop-nobody-probe", "w"),
                        lambda: open("/run/postgresql/.s.PGSQL.5432.lock")):
            try:
                attempt()
                print("LEAK")
            except OSError as exc:
                print(type(exc).__name__)
        libc = ctypes.CDLL(None, use_errno=True)
        print("remount", libc.mount(None, b"/", None, 32 | 4096, None))  # MS_REMOUNT|MS_BIND
        """
    )
    driver = textwrap.dedent(
        f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("sbx", {str(Path(sandbox.__file__))!r})
        module = importlib.util.module_from_spec(spec)
        sys.modules["sbx"] = module
        spec.loader.exec_module(module)
        result = module.run_python({hostile!r})
        print(result.status, "|", ",".join(result.isolation), "|", result.stdout.split())
        """
    )
    run = subprocess.run(
        [python, "-I", "-c", driver],
        user=65534,
        group=65534,
        extra_groups=[],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        cwd="/",
    )
    assert run.returncode == 0, run.stderr
    status, isolation, stdout = (part.strip() for part in run.stdout.split("|"))
    if "userns" not in isolation:
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {run.stdout}")
    assert {"netns", "mountns", "pidns", "nested-userns"} <= set(isolation.split(","))
    assert status == "passed"
    assert "LEAK" not in stdout, stdout
    assert "'remount', '-1']" in stdout, stdout
    assert not Path("/tmp/tuneloop-nobody-probe").exists()


# ---- extract_code and reward ------------------------------------------------------------------


def test_extract_code_takes_the_last_python_block() -> None:
    text = "Draft:\n```python\nx = 1\n```\nShell:\n```bash\nls\n```\nFinal:\n```py\nx = 2\n```\n"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```Python3\nprint(1)\n```") == "print(1)\n"
    assert extract_code("```\nuntagged = True\n```\nand ```bash\nls\n```") == "untagged = True\n"
    assert extract_code("```bash\nls\n```") is None
    assert extract_code("no code at all") is None
    assert extract_code("cut off by the token limit\n```python\ndef f():\n") is None


def test_reward_penalises_a_missing_code_block_and_runs_the_rest() -> None:
    calls: list[tuple[str, str | None]] = []

    def fake_runner(
        code: str, tests: str | None = None, *, timeout_s: float = 10, memory_mb: int = 512
    ) -> SandboxResult:
        calls.append((code, tests))
        return SandboxResult(True, "passed", 0, "", "", 0.0, "fake")

    assert reward("I would write a loop.", "assert True", runner=fake_runner) == -0.1
    assert calls == []
    assert reward("```python\nok = 1\n```", "assert ok", runner=fake_runner) == 1.0
    assert calls == [("ok = 1\n", "assert ok")]

    tests = "assert square(3) == 9\n"
    right = "Here:\n```python\ndef square(x):\n    return x * x\n```"
    wrong = "Here:\n```python\ndef square(x):\n    return x + x\n```"
    assert reward(right, tests) == 1.0
    assert reward(wrong, tests) == 0.0


def test_bad_limits_are_refused_and_a_failed_setup_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="max_processes"):
        run_python("pass", max_processes=0)
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=-1)
    # a sandbox whose own setup fails reports it as an error result, not a test failure
    monkeypatch.setattr(sandbox, "_CHILD_SCRIPT", Path("/nonexistent/sandbox_child.py"))
    result = run_python("pass", "assert True")
    assert (result.passed, result.status) == (False, "error")
    assert "did not start" in result.details
