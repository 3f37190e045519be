"""The sandbox's side of `tuneloop.recipes.sandbox.run_python`: run as a script, never imported.

`run_python` starts `python -I sandbox_child.py CONFIG_JSON` in a session of its own. This script
confines itself step by step, then runs the solution and its tests in a forked worker:

1. namespaces (`unshare` through ctypes: Python 3.11 has no `os.unshare`): network (only a
   loopback that is down, so no host is reachable: not 127.0.0.1:5432, not the internet), mount,
   pid, IPC and UTS. Not root: the same inside a user namespace that maps our uid to 0.
2. mounts (in the private mount namespace): empty read-only tmpfs over the shared scratch and
   home areas (/tmp, /var/tmp, /dev/shm, /run, /root, /home, ...) so other runs' files, sockets
   such as PostgreSQL's /run/postgresql and users' secrets are not even visible; the work dir and
   the interpreter's prefix bound back at their own paths; then every mount read-only except
   the work dir.
3. a fork: the child is pid 1 of the new pid namespace (mounts a fresh read-only /proc) and the
   worker's supervisor; when it exits the kernel kills every process left in the namespace, so
   nothing the solution started survives it.
4. the worker: resource limits, then the privilege drop (root: a uid/gid that owns nothing but the
   work dir, no groups; in a user namespace: a nested user namespace, which holds no capability
   over our mounts), no_new_privs (setuid binaries gain nothing), then the solution and the tests
   in one module namespace.

Every step that fails is written down and the run continues with what worked; the first line on
the result pipe tells the parent which isolation applied. Only the stdlib is used here, and the
worker runs no code of this package after the privilege drop but this file's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import traceback
from typing import Any

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
    # A signal becomes 128+N, as a shell reports it; the parent reads the worker's own status
    # from the result pipe, so this only matters when that line is missing.
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def supervise(cfg: dict[str, Any], nonce: str, setup: Setup) -> None:
    """Fork the worker, reap every child (as pid 1 orphans come to us), report its status, exit."""
    result_fd: int = cfg["result_fd"]
    os.write(
        result_fd, (json.dumps({"setup": setup.isolation, "notes": setup.notes}) + "\n").encode()
    )
    worker = os.fork()
    if worker == 0:
        try:
            run_worker(cfg, nonce)
        except BaseException as exc:
            # run_worker ends the process itself once the solution runs: this is its setup
            traceback.print_exc()
            _report(result_fd, {"setup_error": f"{type(exc).__name__}: {exc}"})
        finally:
            os._exit(70)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(70)
        if pid == worker:
            break
    report: dict[str, int] = (
        {"exit": os.WEXITSTATUS(status)}
        if os.WIFEXITED(status)
        else {"signal": os.WTERMSIG(status)}
    )
    with contextlib.suppress(OSError):
        os.write(result_fd, (json.dumps({"worker": report}) + "\n").encode())
    os._exit(_exit_code(status))


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


def _drop_privileges(cfg: dict[str, Any]) -> None:
    uid, gid = cfg["uid"], cfg["gid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    elif cfg["userns"]:
        # A nested user namespace keeps our uid but holds no capability over the mount namespace
        # above it, so the solution cannot undo the read-only mounts.
        _check(_libc.unshare(CLONE_NEWUSER), "unshare user")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    # Set after the uid change, which clears it: die with the supervisor.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _report(result_fd: int, record: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        os.write(result_fd, (json.dumps(record) + "\n").encode())


def _run_phase(source: str, filename: str, namespace: dict[str, Any]) -> BaseException | None:
    try:
        exec(compile(source, filename, "exec"), namespace)
    except BaseException as exc:
        return exc
    return None


def run_worker(cfg: dict[str, Any], nonce: str) -> None:
    """Confine this process, run solution then tests, report, and exit."""
    result_fd: int = cfg["result_fd"]
    workdir: str = cfg["workdir"]
    _set_limits(cfg)
    _drop_privileges(cfg)
    os.chdir(workdir)
    os.umask(0o077)
    os.environ.clear()
    os.environ.update(cfg["env"])
    sys.argv = ["solution.py"]
    sys.path.insert(0, workdir)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    phases = [("solution", "solution.py")]
    if cfg["has_tests"]:
        phases.append(("tests", "tests.py"))
    # Read both before running either: the solution may write its work dir, tests.py included.
    sources = []
    for _, filename in phases:
        with open(filename, encoding="utf-8") as f:
            sources.append(f.read())
    for (phase, filename), source in zip(phases, sources, strict=True):
        exc = _run_phase(source, filename, namespace)
        if exc is None:
            continue
        ended_well = isinstance(exc, SystemExit) and exc.code in (0, None)
        # An exit before the tests ran proves nothing: only the tests' own exit(0) passes.
        if ended_well and phase == phases[-1][0]:
            break
        if not isinstance(exc, SystemExit):
            # from the solution's own frames down: this file's frame is noise to the reader
            tb = exc.__traceback__.tb_next if exc.__traceback__ else None
            traceback.print_exception(type(exc), exc, tb)
        _report(result_fd, {"phase": phase, "exception": type(exc).__name__})
        _flush()
        os._exit(exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1)
    _flush()
    _report(result_fd, {"done": nonce})
    os._exit(0)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        # a closed or broken stream must not turn a pass into a crash
        with contextlib.suppress(Exception):
            stream.flush()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    with os.fdopen(cfg["nonce_fd"], "r") as f:
        nonce = f.read().strip()
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
    cfg["userns"] = bool(flags & CLONE_NEWUSER)
    if cfg["uid"] is not None:
        setup.isolation.append(f"uid:{cfg['uid']}")
    elif cfg["userns"]:
        setup.isolation.append("nested-userns")
    else:
        setup.note("not root: the solution runs as the caller's own user")
    if not flags & CLONE_NEWPID:
        supervise(cfg, nonce, setup)
    init = os.fork()
    if init == 0:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        except OSError as exc:
            setup.note(f"could not mount a private /proc: {exc.strerror}")
        supervise(cfg, nonce, setup)
    _, status = os.waitpid(init, 0)
    os._exit(_exit_code(status))


if __name__ == "__main__":
    main()
