"""Both ends of a sandboxed test run: the solution's call server and the tests' harness.

Loaded by `sandbox_child.py` by path (the child runs in isolated mode, outside the package), so
it uses the stdlib only. With tests, the child runs two confined processes that share nothing
but one socket pair:

- the solution process runs the solution module, then answers calls (`serve`): the harness names
  one of the module's functions and sends its arguments, the solution process calls it and sends
  the result back as plain data (`encode`);
- the harness process (`run_tests`) holds the tests, read from a descriptor the solution process
  never had, and runs them with the solution's functions replaced by `RemoteFunction` stubs that
  make those calls; it alone (with the supervisor) holds the pipe the verdict goes out on.

So the tests' source, their expected values and the verdict never exist in the solution's
process, whatever it does to itself (frame walking, `gc`, patched builtins, an exit, forged
messages): all it decides is the values it answers with, and those arrive in the harness as fresh
builtin objects (`decode` builds nothing else), compared there by the harness's own code. Only
None, bool, int, float, complex, str, bytes, and lists, tuples, sets, frozensets and dicts of
them cross; a subclass of one of those crosses as its base type's value, so an object whose
`__eq__` is always True either does not cross or leaves that `__eq__` behind.

The solution's names reach the tests as follows: its functions (anything callable) as stubs, its
plain module-level values as copies made once it has loaded, the standard-library modules it
imported as the harness's own imports; never under a builtin's name (a solution's `abs` would
otherwise decide `assert abs(f(x) - y) < 1e-6`), and only names the tests' code mentions.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import linecache
import socket
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any

__all__ = ["Channel", "RemoteFunction", "SolutionGone", "UnencodableError", "decode", "encode"]

MAX_MESSAGE = 16 << 20  # bytes in one message, either way
MAX_VALUE = 1 << 20  # bytes of one module-level value sent with the solution's names
MAX_DEPTH = 100  # nesting of one value
_SCALARS = (bool, int, float, str)
_TAGS: dict[type[Any], str] = {list: "l", tuple: "t", set: "s", frozenset: "f"}


class UnencodableError(TypeError):
    """A value that is not plain data."""


class SolutionGone(BaseException):
    """The solution process ended, or broke the protocol, while the tests needed it. A
    BaseException so that the tests' `except Exception` does not swallow it; the run fails even
    when they catch it."""


def encode(value: Any, ref: Callable[[Any], str | None] | None = None, depth: int = 0) -> Any:
    """`value` as JSON-ready data. A subclass of a builtin type goes as its base type's value,
    read with the base type's own methods (a namedtuple as a tuple, a Counter as a dict, an int
    subclass as the int), so none of the subclass's behaviour, `__eq__` included, goes along.
    `ref` names objects sent by reference (the harness's stubs of the solution's functions)."""
    if value is None or type(value) is bool:
        return value
    if ref is not None and (name := ref(value)) is not None:
        return {"r": name}
    if depth >= MAX_DEPTH:
        raise UnencodableError(f"nested deeper than {MAX_DEPTH}")
    inner = depth + 1
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    for kind, tag in _TAGS.items():
        if isinstance(value, kind):
            items: Any = kind.__iter__(value)  # the base type's own iterator
            return {tag: [encode(item, ref, inner) for item in items]}
    if isinstance(value, dict):
        return {"d": [[encode(k, ref, inner), encode(v, ref, inner)] for k, v in dict.items(value)]}
    if isinstance(value, bytes | bytearray):
        return {"b": bytes(value).hex()}
    if isinstance(value, complex):
        return {"c": [complex.__complex__(value).real, complex.__complex__(value).imag]}
    raise UnencodableError(type(value).__name__)


def decode(data: Any, ref: Callable[[str], Any] | None = None, depth: int = 0) -> Any:
    """The plain value `encode` produced, built from builtin types only; ValueError if `data`
    is not such an encoding (or names a reference `ref` does not resolve)."""
    if data is None or type(data) in _SCALARS:
        return data
    if type(data) is not dict or len(data) != 1 or depth >= MAX_DEPTH:
        raise ValueError("not an encoded value")
    ((tag, body),) = data.items()
    items = body if type(body) is list else None
    if tag in ("l", "t", "s", "f") and items is not None:
        values = [decode(item, ref, depth + 1) for item in items]
        make: dict[str, Callable[[list[Any]], Any]] = {
            "l": list,
            "t": tuple,
            "s": set,
            "f": frozenset,
        }
        try:
            return make[tag](values)
        except TypeError as exc:  # an unhashable member of a set
            raise ValueError(str(exc)) from None
    if tag == "d" and items is not None:
        pairs = [pair for pair in items if type(pair) is list and len(pair) == 2]
        if len(pairs) != len(items):
            raise ValueError("not an encoded dict")
        try:
            return {decode(k, ref, depth + 1): decode(v, ref, depth + 1) for k, v in pairs}
        except TypeError as exc:
            raise ValueError(str(exc)) from None
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    numbers = items is not None and all(type(part) in (int, float) for part in items)
    if tag == "c" and items is not None and len(items) == 2 and numbers:
        return complex(items[0], items[1])
    if tag == "r" and type(body) is str and ref is not None:
        return ref(body)
    raise ValueError(f"not an encoded value (tag {tag!r})")


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def _receive(reader: Any) -> dict[str, Any] | None:
    """One message, None at the end of the stream; ValueError for anything malformed."""
    line = reader.readline(MAX_MESSAGE + 1)
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise ValueError(f"a message longer than {MAX_MESSAGE} bytes, or cut off")
    try:
        message = json.loads(line)
    except (RecursionError, ValueError) as exc:  # deep nesting, bad JSON, a huge int
        raise ValueError(f"malformed message: {type(exc).__name__}") from None
    if type(message) is not dict:
        raise ValueError("malformed message")
    return message


# ---- the solution's side: runs inside the solution process, under its control ---------------


def _describe(namespace: dict[str, Any]) -> dict[str, Any]:
    names: dict[str, Any] = {}
    for name, value in list(namespace.items()):
        if name.startswith("__") and name.endswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            names[name] = {"module": value.__name__}
        elif callable(value):
            names[name] = {"function": True}
        else:
            try:
                encoded = encode(value)
                if len(json.dumps(encoded)) > MAX_VALUE:
                    raise UnencodableError(f"larger than {MAX_VALUE} bytes")
                names[name] = {"value": encoded}
            except (UnencodableError, ValueError, RecursionError):
                names[name] = {"other": type(value).__name__}
    return names


def _first_builtin(kind: type) -> str:
    for cls in kind.__mro__:
        if getattr(builtins, cls.__name__, None) is cls:
            return cls.__name__
    return "Exception"


def serve(sock: socket.socket, namespace: dict[str, Any], flush: Callable[[], None]) -> None:
    """Send the module's names, then answer calls until the harness hangs up (or the socket
    fails: the harness has its verdict then). An exit of the solution (SystemExit) propagates:
    the process ends, and the harness sees it end."""
    with contextlib.suppress(OSError):
        _serve(sock, namespace, flush)


def _serve(sock: socket.socket, namespace: dict[str, Any], flush: Callable[[], None]) -> None:
    reader = sock.makefile("rb")
    flush()  # before each message: once the tests end, this process is killed
    _send(sock, {"ready": _describe(namespace)})
    while (message := _receive(reader)) is not None:
        reply: dict[str, Any] = {"id": message.get("id")}
        if "ping" in message:
            flush()
            _send(sock, {**reply, "pong": True})
            continue
        try:
            function = namespace[message["call"]]
            args = decode(message["args"], namespace.__getitem__)
            kwargs = decode(message["kwargs"], namespace.__getitem__)
            result = function(*args, **kwargs)
        except Exception as exc:
            # from the solution's frames down: this file's frame is noise to the reader
            traceback.print_exception(
                type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None
            )
            reply |= {"raised": type(exc).__name__, "builtin": _first_builtin(type(exc))}
            reply["message"] = str(exc)[:2000]
        else:
            try:
                reply["value"] = encode(result)
            except (UnencodableError, RecursionError) as exc:
                reply["unencodable"] = type(result).__name__ + (f" ({exc})" if str(exc) else "")
        flush()
        try:
            _send(sock, reply)
        except ValueError:  # an int too large for JSON
            _send(sock, {"id": reply["id"], "unencodable": "int (too many digits)"})


# ---- the harness's side: runs in the harness process, never reachable by the solution --------


class Channel:
    """The harness's end of the socket pair. Everything read from it is untrusted data."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("rb")
        self.gone: str | None = None  # why the solution can no longer answer
        self.next_id = 0

    def fail(self, why: str) -> SolutionGone:
        self.gone = self.gone or why
        return SolutionGone(self.gone)

    def hello(self) -> dict[str, Any] | None:
        """The solution module's names, None when it ended (or broke the protocol) before."""
        try:
            message = _receive(self.reader)
        except (OSError, ValueError) as exc:
            self.fail(f"the solution process broke the protocol: {exc}")
            return None
        if message is None or type(message.get("ready")) is not dict:
            self.fail("the solution process ended before its tests ran")
            return None
        return message["ready"]

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.gone:
            raise SolutionGone(self.gone)
        self.next_id += 1
        message["id"] = self.next_id
        try:
            data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        except ValueError as exc:  # an int of more digits than Python converts
            raise TypeError(f"an argument cannot be passed to the solution: {exc}") from None
        try:
            self.sock.sendall(data)
            reply = _receive(self.reader)
        except OSError:
            reply = None
        except ValueError as exc:
            raise self.fail(f"the solution process broke the protocol: {exc}") from None
        if reply is None:
            raise self.fail("the solution process ended during its tests")
        if reply.get("id") != self.next_id:
            raise self.fail("the solution process broke the protocol: an answer out of turn")
        return reply

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        def ref(value: Any) -> str | None:
            return value.__name__ if type(value) is RemoteFunction else None

        try:
            message = {"call": name, "args": encode(list(args), ref), "kwargs": encode(kwargs, ref)}
        except UnencodableError as exc:
            raise TypeError(f"an argument of type {exc} cannot be passed to the solution") from None
        reply = self.request(message)
        if "value" in reply:
            try:
                return decode(reply["value"])
            except (ValueError, RecursionError) as exc:
                raise self.fail(f"the solution process broke the protocol: {exc}") from None
        if "unencodable" in reply:
            raise _remote(
                TypeError(
                    f"{name}() returned a {str(reply['unencodable'])[:200]}, which is not "
                    "plain data: only None, bool, int, float, complex, str, bytes and lists, "
                    "tuples, sets, frozensets and dicts of them leave the sandbox"
                ),
                "TypeError",
            )
        if "raised" in reply:
            raised, message_text = str(reply["raised"])[:100], str(reply.get("message", ""))[:2000]
            kind = getattr(builtins, str(reply.get("builtin")), None)
            raise _remote(_rebuilt(kind, message_text), raised)
        raise self.fail("the solution process broke the protocol: an empty answer")


def _rebuilt(kind: Any, message: str) -> Exception:
    """An exception of the builtin type the solution raised (so the tests' `except ValueError`
    still works), or a plain Exception; never a BaseException that is not an Exception."""
    bases = kind.__mro__ if isinstance(kind, type) and issubclass(kind, Exception) else (Exception,)
    for base in bases:
        try:
            exc = base(message)
        except Exception:  # e.g. UnicodeDecodeError wants five arguments
            continue
        if isinstance(exc, Exception):
            return exc
    return Exception(message)


def _remote(exc: Exception, name: str) -> Exception:
    exc.sandbox_remote = name  # type: ignore[attr-defined]
    return exc


class RemoteFunction:
    """A function of the solution's module, called in the solution process."""

    def __init__(self, channel: Channel, name: str) -> None:
        self._channel = channel
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._channel.call(self.__name__, args, kwargs)

    def __repr__(self) -> str:
        return f"<function {self.__name__} of the sandboxed solution>"


class _Unavailable:
    """A module-level object of the solution that is not plain data: any use says so."""

    def __init__(self, name: str, kind: str) -> None:
        self._why = (
            f"the solution's {name!r} is a {kind}: only its functions, modules and plain values"
            " reach the tests"
        )

    def __getattr__(self, attribute: str) -> Any:
        raise TypeError(self._why)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(self._why)

    def __bool__(self) -> bool:
        raise TypeError(self._why)

    def __eq__(self, other: object) -> bool:
        raise TypeError(self._why)

    __hash__ = None  # type: ignore[assignment]


def _referenced(code: types.CodeType) -> set[str]:
    names = set(code.co_names)  # the globals it loads (and attribute names: harmless extras)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _referenced(constant)
    return names


def _bind(channel: Channel, names: dict[str, Any], wanted: set[str]) -> dict[str, Any]:
    """The solution's names that the tests use, as the tests will see them. A builtin's name is
    never bound: a solution's own `abs` or `AssertionError` would decide the tests' checks."""
    bound: dict[str, Any] = {}
    for name, what in names.items():
        if type(name) is not str or name not in wanted or hasattr(builtins, name):
            continue
        if type(what) is not dict:
            continue
        if "function" in what:
            bound[name] = RemoteFunction(channel, name)
        elif "value" in what:
            try:
                bound[name] = decode(what["value"])
            except (ValueError, RecursionError):
                continue
        elif type(module := what.get("module")) is str:
            # the harness imports the module itself, and only from the standard library
            if module.partition(".")[0] in sys.stdlib_module_names:
                try:
                    bound[name] = __import__(module, fromlist=["_"])
                except Exception:
                    continue  # the tests then see no such name
        else:
            bound[name] = _Unavailable(name, str(what.get("other", "object"))[:100])
    return bound


def main_module(filename: str) -> dict[str, Any]:
    """A fresh `__main__` module's namespace, registered as such: what `unittest.main()`,
    pickle and dataclasses look up through `sys.modules`."""
    module = types.ModuleType("__main__")
    module.__file__ = filename
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = module
    return module.__dict__


def run_tests(channel: Channel, source: str, flush: Callable[[], None]) -> dict[str, Any]:
    """Run the tests against the solution behind `channel`; the verdict, as the harness saw it:
    {"passed": bool, "exit": code, "phase": "tests" | "solution", "exception": name | None,
    "gone": why the solution stopped answering | None}."""
    linecache.cache["tests.py"] = (len(source), None, source.splitlines(True), "tests.py")
    verdict: dict[str, Any] = {"passed": False, "exit": 1, "phase": "tests", "exception": None}
    try:
        code = compile(source, "tests.py", "exec")
    except SyntaxError as exc:
        traceback.print_exception(type(exc), exc, None)
        return verdict | {"exception": "SyntaxError"}
    names = channel.hello()
    if names is None:
        return verdict | {"phase": "solution", "gone": channel.gone}
    namespace = main_module("tests.py")
    namespace |= _bind(channel, names, _referenced(code))
    try:
        exec(code, namespace)
        verdict["exit"] = 0
    except SystemExit as exc:
        # a test runner's own exit: 0 (or None) after its checks is a pass
        status = exc.code  # unittest.main() exits with False for success
        verdict["exit"] = int(status) if isinstance(status, int) else (0 if status is None else 1)
    except SolutionGone:
        pass
    except BaseException as exc:
        # from the tests' frames down: this file's frame is noise to the reader
        traceback.print_exception(
            type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None
        )
        remote = getattr(exc, "sandbox_remote", None)
        verdict |= {"exception": str(remote or type(exc).__name__)[:100]}
        verdict["phase"] = "solution" if remote else "tests"
    flush()
    if not channel.gone:
        # still there at the end: an exit after its last answer fails too
        with contextlib.suppress(SolutionGone):
            channel.request({"ping": True})
    if channel.gone:
        print(f"sandbox: {channel.gone}", file=sys.stderr)
        return verdict | {"passed": False, "phase": "solution", "gone": channel.gone}
    return verdict | {"passed": verdict["exit"] == 0 and verdict["exception"] is None}
