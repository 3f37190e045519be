"""The sandbox's side of `tuneloop.recipes.sandbox.run_python`: run as a script, never imported.

`run_python` starts `python -I sandbox_child.py CONFIG_JSON` in a session of its own. This script
confines itself step by step, then runs the solution in a forked worker and, with tests, the
tests in a forked harness of their own:

1. namespaces (`unshare` through ctypes: Python 3.11 has no `os.unshare`): network (only a
   loopback that is down, so no host is reachable: not 127.0.0.1:5432, not the internet), mount,
   pid, IPC and UTS. Not root: the same inside a user namespace that maps our uid to 0.
2. mounts (in the private mount namespace): empty read-only tmpfs over the shared scratch and
   home areas (/tmp, /var/tmp, /dev/shm, /run, /root, /home, ...) so other runs' files, sockets
   such as PostgreSQL's /run/postgresql and users' secrets are not even visible; the work dir and
   the interpreter's prefix bound back at their own paths; then every mount read-only except
   the work dir. Then every process of the run is made non-dumpable (inherited by fork): none
   can be ptraced or have its /proc/PID/mem or /proc/PID/fd opened by another of the same uid.
3. a fork: the child is pid 1 of the new pid namespace (mounts a fresh read-only /proc) and the
   supervisor; when it exits the kernel kills every process left in the namespace, so nothing
   the solution started survives it.
4. with tests, the harness (`sandbox_harness.run_tests`): its own stdout/stderr pipes, the tests'
   source from a descriptor closed in the supervisor before the worker is forked, its own uid
   (root) or nested user namespace, limits; it runs the tests, calling the solution's functions
   over a socket pair, and alone writes the verdict on the result pipe.
5. the worker: it closes every descriptor but its stdio, its end of the socket pair and the
   report pipe; resource limits, then the privilege drop (root: a uid/gid that owns nothing but
   the work dir, no groups; in a user namespace: a nested user namespace, which holds no
   capability over our mounts), no_new_privs (setuid binaries gain nothing), then the solution,
   then (with tests) it answers the harness's calls (`sandbox_harness.serve`).

Every step that fails is written down and the run continues with what worked; the first line on
the result pipe tells the parent which isolation applied. Only the stdlib is used here and in
`sandbox_harness.py`, and no process runs code of this package after its privilege drop but
these two files'.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import resource
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38

# statvfs flags -> the mount flags a read-only remount must repeat: leaving one out would be an
# attempt to clear it, which the kernel refuses for locked mounts (inside a user namespace).
_KEPT_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)

_libc = ctypes.CDLL(None, use_errno=True)


def _sibling(name: str) -> ModuleType:
    # Loaded now, before the mounts may hide the package's directory.
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:
    from tuneloop.recipes import sandbox_harness
else:
    sandbox_harness = _sibling("sandbox_harness")


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), "prctl")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class Setup:
    """What confinement applied, reported to the parent before any solution code runs."""

    def __init__(self) -> None:
        self.isolation: list[str] = []
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


def unshare_namespaces(root: bool, setup: Setup) -> int:
    """Enter new namespaces; returns the CLONE_* flags that took effect."""
    wanted = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.getuid(), os.getgid()
    flags = wanted if root else wanted | CLONE_NEWUSER
    if _libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        setup.note(
            f"namespaces unavailable ({os.strerror(err)}): no network, mount or pid isolation"
        )
        return 0
    if not root:
        # Map our own uid/gid to 0 in the new user namespace: that grants the capabilities needed
        # to mount inside the mount namespace it owns, and nothing outside.
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")
        setup.isolation.append("userns")
    setup.isolation += ["netns", "mountns", "pidns", "ipcns", "utsns"]
    return flags


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            # mountinfo escapes space, tab, newline and backslash as octal
            points.append(point.encode().decode("unicode_escape"))
    return points


def _bind_back(fd: int, path: str, writable: bool) -> None:
    """Bind the directory open as `fd` at `path` (which an empty tmpfs may now hide)."""
    os.makedirs(path, mode=0o755, exist_ok=True)
    _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    if writable:
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)


def confine_mounts(cfg: dict[str, Any], setup: Setup) -> None:
    """Hide the scratch and home areas, bind back what the run needs, make the rest read-only."""
    workdir: str = cfg["workdir"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Open what must stay visible before a tmpfs hides the way to it.
    keep_fds = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in cfg["keep"]}
    work_fd = os.open(workdir, os.O_PATH | os.O_DIRECTORY)
    hidden = []
    for path in cfg["hide"]:
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
            hidden.append(path)
        except OSError as exc:
            setup.note(f"could not hide {path}: {exc.strerror}")
    for path, fd in keep_fds.items():
        if any(path == h or path.startswith(h + "/") for h in hidden):
            _bind_back(fd, path, writable=False)
        os.close(fd)
    _bind_back(work_fd, workdir, writable=True)
    os.close(work_fd)
    failed = []
    for point in _mount_points():
        if point == workdir:
            continue
        try:
            kept = os.statvfs(point).f_flag
        except OSError:
            continue  # under a hidden directory: unreachable anyway
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        flags |= sum(ms for st, ms in _KEPT_FLAGS if kept & st)
        try:
            _mount(None, point, None, flags)
        except OSError:
            failed.append(point)
    if "/" in failed:
        setup.note("could not make / read-only: writes outside the work dir are not contained")
    elif failed:
        setup.note(f"left writable: {', '.join(failed[:5])}")
    setup.isolation += ["readonly-fs", "hidden:" + ",".join(hidden)]


def _exit_code(status: int) -> int:
    # A signal becomes 128+N, as a shell reports it; the parent reads the processes' own
    # statuses from the result pipe, so this only matters when those lines are missing.
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _report(fd: int, record: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, (json.dumps(record) + "\n").encode())


def _keep_only(*fds: int) -> None:
    """Close every descriptor above stderr but `fds`: what a process does not hold, it cannot
    write to (nor reopen through /proc/self/fd)."""
    try:
        open_fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: every number the limit allows
        open_fds = list(range(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
    for fd in open_fds:
        if fd > 2 and fd not in fds:
            with contextlib.suppress(OSError):  # the listing's own descriptor, gone already
                os.close(fd)


def _fork(run: Callable[[], None], report_fd: int) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            run()
        except BaseException as exc:
            # each process ends itself once it runs user code: this is its setup failing
            traceback.print_exc()
            _report(report_fd, {"setup_error": f"{type(exc).__name__}: {exc}"})
        finally:
            os._exit(70)
    return pid


def supervise(cfg: dict[str, Any], setup: Setup) -> None:
    """Fork the tests' harness (with tests) and the solution's worker, reap every child (as pid 1
    orphans come to us), report the two statuses, exit."""
    fds: dict[str, int] = cfg["fds"]
    result_fd = fds["result"]
    _report(result_fd, {"setup": setup.isolation, "notes": setup.notes})
    roles: dict[int, str] = {}
    worker_end = -1
    if cfg["has_tests"]:
        harness_sock, worker_sock = socket.socketpair()
        harness_end, worker_end = harness_sock.detach(), worker_sock.detach()
        # The harness first, then the tests' descriptor is closed here: the worker never has it.
        roles[_fork(lambda: run_harness(cfg, harness_end), result_fd)] = "harness"
        os.close(harness_end)
        os.close(fds["tests"])
    for name in ("harness_out", "harness_err"):
        os.close(fds[name])
    roles[_fork(lambda: run_worker(cfg, worker_end), fds["report"])] = "worker"
    if worker_end >= 0:
        os.close(worker_end)
    os.close(fds["report"])
    main_role = "harness" if cfg["has_tests"] else "worker"
    main_status = 0
    stopped: set[int] = set()
    while roles:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        role = roles.pop(pid, None)
        if role is None:
            continue  # an orphan of the solution's, reaped
        if role == main_role:
            main_status = status
        record = _status(status)
        if pid in stopped:
            record["stopped"] = 1
        _report(result_fd, {role: record})
        if role == "harness":
            # The verdict is in: the worker has nothing left to do. Unless it has ended already
            # (then its own status is the one reported), it is killed.
            for other in list(roles):
                done, status = os.waitpid(other, os.WNOHANG)
                if done:
                    _report(result_fd, {roles.pop(other): _status(status)})
                else:
                    os.kill(other, signal.SIGKILL)
                    stopped.add(other)
    os._exit(_exit_code(main_status))


def _status(status: int) -> dict[str, int]:
    if os.WIFEXITED(status):
        return {"exit": os.WEXITSTATUS(status)}
    return {"signal": os.WTERMSIG(status)}


def _set_limits(cfg: dict[str, Any]) -> None:
    limits = cfg["limits"]
    pairs = {
        resource.RLIMIT_AS: limits["memory_bytes"],
        resource.RLIMIT_CPU: limits["cpu_s"],
        resource.RLIMIT_NPROC: limits["processes"],
        resource.RLIMIT_FSIZE: limits["file_bytes"],
        resource.RLIMIT_NOFILE: limits["open_files"],
        resource.RLIMIT_CORE: 0,
    }
    for which, value in pairs.items():
        # Never above the hard limit we inherited: raising it needs CAP_SYS_RESOURCE.
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))


def _confine(cfg: dict[str, Any], uid: int | None) -> None:
    """Limits, then the privilege drop to `uid` (root) or a nested user namespace of its own."""
    _set_limits(cfg)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    elif cfg["userns"]:
        # A nested user namespace keeps our uid but holds no capability over the mount namespace
        # above it, so the code cannot undo the read-only mounts.
        _check(_libc.unshare(CLONE_NEWUSER), "unshare user")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    # Set after the uid change, which clears them: die with the supervisor, and stay out of
    # reach of ptrace and /proc/PID/{mem,fd} for a process of the same uid.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(PR_SET_DUMPABLE, 0)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        # a closed or broken stream must not turn a pass into a crash
        with contextlib.suppress(Exception):
            stream.flush()


def run_harness(cfg: dict[str, Any], channel_fd: int) -> None:
    """The tests' process: its own output pipes, the tests' source, a uid of its own (root) or a
    user namespace of its own; it never reads the work dir or imports from it. Runs the tests
    against the solution behind `channel_fd` and writes the verdict on the result pipe."""
    fds: dict[str, int] = cfg["fds"]
    _keep_only(fds["result"], fds["tests"], fds["harness_out"], fds["harness_err"], channel_fd)
    empty_r, empty_w = os.pipe()
    os.close(empty_w)
    for fd, target in ((empty_r, 0), (fds["harness_out"], 1), (fds["harness_err"], 2)):
        os.dup2(fd, target)
        os.close(fd)
    with os.fdopen(fds["tests"], "rb") as f:
        f.seek(0)
        source = f.read().decode("utf-8", errors="replace")
    _confine(cfg, cfg["harness_uid"])
    os.chdir("/")
    os.umask(0o077)
    os.environ.clear()
    os.environ.update(cfg["harness_env"])
    sys.argv = ["tests.py"]
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    channel = sandbox_harness.Channel(socket.socket(fileno=channel_fd))
    verdict = sandbox_harness.run_tests(channel, source, _flush)
    _flush()
    _report(fds["result"], {"verdict": verdict})
    os._exit(0)


def run_worker(cfg: dict[str, Any], channel_fd: int) -> None:
    """The solution's process: confine it, run the solution module, then (with tests) answer
    the harness's calls; it holds no descriptor but its stdio, the call channel and the
    report pipe (whose lines the parent takes as the solution's word only)."""
    report_fd: int = cfg["fds"]["report"]
    _keep_only(report_fd, channel_fd)
    workdir: str = cfg["workdir"]
    _confine(cfg, cfg["uid"])
    os.chdir(workdir)
    os.umask(0o077)
    os.environ.clear()
    os.environ.update(cfg["env"])
    sys.argv = ["solution.py"]
    sys.path.insert(0, workdir)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    namespace = sandbox_harness.main_module("solution.py")
    try:
        with open("solution.py", encoding="utf-8") as f:
            exec(compile(f.read(), "solution.py", "exec"), namespace)
        if channel_fd >= 0:
            sandbox_harness.serve(socket.socket(fileno=channel_fd), namespace, _flush)
    except BaseException as exc:
        if not isinstance(exc, SystemExit):
            # from the solution's own frames down: this file's frame is noise to the reader
            tb = exc.__traceback__.tb_next if exc.__traceback__ else None
            traceback.print_exception(type(exc), exc, tb)
        _report(report_fd, {"phase": "solution", "exception": type(exc).__name__})
        _flush()
        code = exc.code if isinstance(exc, SystemExit) else 1
        os._exit(code if isinstance(code, int) else (0 if code is None else 1))
    _flush()
    os._exit(0)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    # Die with the process that started us (SIGKILL), so a crashed trainer leaves no sandbox.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != cfg["parent_pid"]:
        os._exit(70)
    setup = Setup()
    root = os.geteuid() == 0
    flags = unshare_namespaces(root, setup) if cfg["namespaces"] else 0
    if not cfg["namespaces"]:
        setup.note("namespaces disabled by the caller: no network, mount or pid isolation")
    if flags & CLONE_NEWNS:
        try:
            confine_mounts(cfg, setup)
        except OSError as exc:
            setup.note(f"mount confinement failed: {exc}")
    # From here on (the uid maps are written) every process of the run is out of reach of
    # ptrace and /proc/PID/{mem,fd}, whatever its uid: the flag is inherited by fork.
    _prctl(PR_SET_DUMPABLE, 0)
    cfg["userns"] = bool(flags & CLONE_NEWUSER)
    if cfg["uid"] is not None:
        setup.isolation += [f"uid:{cfg['uid']}", f"harness-uid:{cfg['harness_uid']}"]
    elif cfg["userns"]:
        setup.isolation.append("nested-userns")
    else:
        setup.note("not root: the solution runs as the caller's own user")
    if not flags & CLONE_NEWPID:
        supervise(cfg, setup)
    init = os.fork()
    if init == 0:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        except OSError as exc:
            setup.note(f"could not mount a private /proc: {exc.strerror}")
        supervise(cfg, setup)
    # Only init and its children need the pipes and the tests.
    _keep_only()
    _, status = os.waitpid(init, 0)
    os._exit(_exit_code(status))


if __name__ == "__main__":
    main()
