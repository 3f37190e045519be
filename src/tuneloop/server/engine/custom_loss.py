"""Server-side custom losses: a torch.fx node list (as the official SDK uploads it) checked
against an allow-list of pure tensor operations, and run per datum by a small interpreter.

Nothing in a graph is ever imported, looked up by attribute or evaluated: every call target
must be a name in `FUNCTIONS` or `METHODS` (maps built here from torch, math and operator
objects), `getattr` may only read the shape-like attributes in `ATTRIBUTES`, and `get_attr`
(captured tensors) and `call_module` nodes are refused. No allowed operation does I/O, touches a
module, moves data between devices or creates a tensor whose size a constant chooses, so the
only way to grow memory is broadcasting and concatenation; the interpreter bounds both before
it calls (`MAX_ELEMENTS` per value, `MAX_TOTAL_ELEMENTS` per datum).

A refused graph raises `GraphError` naming the node; a datum the loss fails on raises a user
`EngineError` (that request fails, its neighbours in the batch do not).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the usual alias)
from torch.fx.node import _get_qualified_name

from tuneloop.server.engine.types import EngineError

__all__ = [
    "ATTRIBUTES",
    "FUNCTIONS",
    "MAX_ELEMENTS",
    "METHODS",
    "CustomLoss",
    "GraphError",
    "compile_loss",
    "input_tensors",
    "reduce_metrics",
    "run_custom_loss",
    "value_and_grad",
]

MAX_NODES = 512
MAX_ELEMENTS = 1 << 24  # one value: 16M elements, 64 MiB in float32
MAX_TOTAL_ELEMENTS = 1 << 26  # every value of one datum's run together
MAX_INT = 1 << 62  # Python ints (shapes, constants) stay small: no 10**10**10 through pow
MAX_ARG_DEPTH = 6
MAX_ARG_ITEMS = 64
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")

_TENSOR_OPS = (
    "abs", "add", "sub", "mul", "div", "true_divide", "neg", "exp", "log", "log1p", "expm1",
    "log2", "exp2", "sigmoid", "tanh", "sqrt", "rsqrt", "square", "pow", "clamp", "clamp_min",
    "clamp_max", "clip", "sum", "mean", "prod", "std", "var", "max", "min", "amax", "amin",
    "logsumexp", "softmax", "log_softmax", "cumsum", "sign", "relu", "minimum", "maximum",
    "where", "masked_fill", "gather", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
    "logical_or", "logical_not", "isfinite", "nan_to_num", "unsqueeze", "squeeze", "flatten",
    "reshape", "transpose", "detach", "square", "floor", "ceil", "round", "reciprocal",
)  # fmt: skip
# Methods: the tensor ops plus views and dtype casts that never grow a tensor.
_METHOD_ONLY = (
    "view", "t", "contiguous", "size", "dim", "numel", "float", "double", "bool", "long",
    "int", "type_as",
)  # fmt: skip
ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T"})
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64,
           "int32": torch.int32, "bool": torch.bool}  # fmt: skip


def _public_functions() -> dict[str, Callable[..., Any]]:
    table: dict[str, Callable[..., Any]] = {}
    for name in (*_TENSOR_OPS, "stack", "cat", "zeros_like", "ones_like", "full_like"):
        if hasattr(torch, name):
            table[f"torch.{name}"] = getattr(torch, name)
    for name in ("logsigmoid", "softplus", "log_softmax", "softmax", "relu", "sigmoid", "silu"):
        table[f"torch.nn.functional.{name}"] = getattr(F, name)
    for name in ("log", "exp", "sqrt", "log1p", "expm1", "tanh", "fabs"):
        table[f"math.{name}"] = getattr(math, name)
    for name in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "neg", "pos", "pow", "abs",
        "getitem", "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "xor", "invert",
    ):  # fmt: skip
        table[f"operator.{name}"] = getattr(operator, name)
    # The names torch.fx records for the same objects (e.g. F.logsigmoid is
    # torch._C._nn.log_sigmoid; operator functions live in _operator, sent as operator.).
    for fn in list(table.values()):
        try:
            qualified = _get_qualified_name(fn)
        except Exception:  # pragma: no cover - a name fx cannot produce needs no alias
            continue
        table.setdefault(qualified.replace("_operator.", "operator.", 1), fn)
    return table


FUNCTIONS: Mapping[str, Callable[..., Any]] = _public_functions()
METHODS = frozenset(m for m in (*_TENSOR_OPS, *_METHOD_ONLY) if hasattr(torch.Tensor, m))


class GraphError(ValueError):
    """A graph the server will not run; `node` is the offending node's name (or a field)."""

    def __init__(self, node: str, message: str) -> None:
        super().__init__(f"node {node!r}: {message}")
        self.node = node


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Node:
    op: str
    name: str
    target: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class CustomLoss:
    """A checked graph, plain data (it travels to worker processes): inputs in order, with
    ``logprobs`` first, and the nodes after the placeholders, the output last."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    nodes: tuple[_Node, ...]
    output: tuple[Any, tuple[tuple[str, Any], ...]]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The ``loss_fn_inputs`` keys the loss reads, in order (``logprobs`` excluded)."""
        return tuple(name for name, _ in self.inputs[1:])


def _decode(arg: Any, known: set[str], node: str, depth: int = 0) -> Any:
    if depth > MAX_ARG_DEPTH:
        raise GraphError(node, f"arguments nest deeper than {MAX_ARG_DEPTH}")
    if arg is None or isinstance(arg, bool | float):
        return arg
    if isinstance(arg, int):
        if abs(arg) > MAX_INT:
            raise GraphError(node, f"integer constant {arg} is too large")
        return arg
    if isinstance(arg, str):
        if len(arg) > 64:
            raise GraphError(node, "string constant longer than 64 characters")
        return arg
    if isinstance(arg, list):
        if len(arg) > MAX_ARG_ITEMS:
            raise GraphError(node, f"a list argument of more than {MAX_ARG_ITEMS} items")
        return [_decode(a, known, node, depth + 1) for a in arg]
    if isinstance(arg, dict) and len(arg) == 1:
        ((kind, value),) = arg.items()
        if kind == "ref" and isinstance(value, str):
            if value not in known:
                raise GraphError(node, f"refers to {value!r}, which is not an earlier node")
            return _Ref(value)
        if kind == "tuple" and isinstance(value, list):
            return tuple(_decode([*value], known, node, depth + 1))
        if kind == "dict" and isinstance(value, dict) and len(value) <= MAX_ARG_ITEMS:
            return {str(k): _decode(v, known, node, depth + 1) for k, v in value.items()}
        if kind == "slice" and isinstance(value, list) and len(value) == 3:
            return slice(*(_decode(v, known, node, depth + 1) for v in value))
        if kind == "ellipsis" and value is True:
            return Ellipsis
        if kind == "float" and value in ("inf", "-inf", "nan"):
            return float(value)
        if kind == "dtype" and value in _DTYPES:
            return _DTYPES[value]
        raise GraphError(
            node, f"argument {{{kind!r}: ...}} is not allowed (devices, layouts and "
            "memory formats included: the loss runs where the logprobs are)"
        )  # fmt: skip
    raise GraphError(node, f"unsupported argument {type(arg).__name__}")


def _check_call(op: str, target: str, args: tuple[Any, ...], node: str) -> None:
    if op == "call_function":
        if target in ("getattr", "builtins.getattr"):
            if len(args) != 2 or not isinstance(args[0], _Ref) or args[1] not in ATTRIBUTES:
                raise GraphError(
                    node, f"getattr may only read {', '.join(sorted(ATTRIBUTES))} of a value"
                )
        elif target not in FUNCTIONS:
            raise GraphError(node, f"calls {target!r}, which is not an allowed tensor operation")
    elif op == "call_method":
        if target not in METHODS:
            raise GraphError(node, f"calls method {target!r}, which is not allowed")
        if not args or not isinstance(args[0], _Ref):
            raise GraphError(node, "a method call needs a value to call it on")
    elif op == "get_attr":
        raise GraphError(node, "captures a tensor (get_attr); a loss reads only its inputs")
    else:
        raise GraphError(node, f"{op} nodes are not allowed")


def compile_loss(
    name: str, inputs: Sequence[tuple[str, int]], nodes: Sequence[Mapping[str, Any]]
) -> CustomLoss:
    """Check an uploaded graph (nodes as dicts: op, name, target, args, kwargs)."""
    if len(nodes) > MAX_NODES:
        raise GraphError("graph", f"{len(nodes)} nodes, at most {MAX_NODES}")
    if not inputs or inputs[0][0] != "logprobs":
        raise GraphError("inputs", "the first input must be logprobs")
    if len({n for n, _ in inputs}) != len(inputs):
        raise GraphError("inputs", "input names repeat")
    known: set[str] = set()
    body: list[_Node] = []
    output: tuple[Any, tuple[tuple[str, Any], ...]] | None = None
    placeholders = 0
    for raw in nodes:
        node = str(raw["name"])
        if not _NAME.fullmatch(node) or node in known:
            raise GraphError(node, "node names must be unique identifiers")
        if output is not None:
            raise GraphError(node, "nodes after the output")
        op, target = str(raw["op"]), str(raw["target"])
        args = tuple(_decode(list(raw.get("args", [])), known, node))
        kwargs = _decode({"dict": dict(raw.get("kwargs", {}))}, known, node)
        if op == "placeholder":
            if placeholders >= len(inputs) or target != inputs[placeholders][0] or body:
                raise GraphError(node, "placeholders must be the declared inputs, in order")
            placeholders += 1
        elif op == "output":
            output = _check_output(args, node)
        else:
            _check_call(op, target, args, node)
            body.append(_Node(op, node, target, args, tuple(kwargs.items())))
        known.add(node)
    if placeholders != len(inputs):
        raise GraphError("inputs", f"{len(inputs)} inputs declared, {placeholders} placeholders")
    if output is None:
        raise GraphError("graph", "no output node")
    return CustomLoss(name, tuple((n, int(r)) for n, r in inputs), tuple(body), output)


def _check_output(args: tuple[Any, ...], node: str) -> tuple[Any, tuple[tuple[str, Any], ...]]:
    value = args[0] if len(args) == 1 else None
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise GraphError(node, "the loss must return (loss, metrics)")
    loss, metrics = value
    if not isinstance(loss, _Ref) or not isinstance(metrics, dict):
        raise GraphError(node, "the loss must return a tensor and a dict of metric tensors")
    for key, metric in metrics.items():
        if not _METRIC_KEY.fullmatch(key) or not isinstance(metric, _Ref):
            raise GraphError(node, f"metric {key!r} must be a tensor named custom/<name>:sum|mean")
    return loss, tuple(metrics.items())


class _Budget:
    def __init__(self, node: str) -> None:
        self.node = node
        self.total = 0

    def _refuse(self, message: str) -> EngineError:
        return EngineError(f"custom loss node {self.node!r}: {message}", "user")

    def before(self, args: Sequence[Any]) -> None:
        """Refuse a call whose result would be too large, before it allocates."""
        tensors = [a for a in _flatten(args) if isinstance(a, torch.Tensor)]
        if not tensors:
            return
        try:
            broadcast = math.prod(torch.broadcast_shapes(*(t.shape for t in tensors)))
        except RuntimeError:
            broadcast = 0
        largest = max(broadcast, sum(t.numel() for t in tensors))
        if largest > MAX_ELEMENTS:
            raise self._refuse(f"would make {largest} elements, at most {MAX_ELEMENTS}")

    def after(self, value: Any) -> None:
        for item in _flatten([value]):
            if isinstance(item, torch.Tensor):
                if item.numel() > MAX_ELEMENTS:
                    raise self._refuse(f"made {item.numel()} elements, at most {MAX_ELEMENTS}")
                self.total += item.numel()
            elif isinstance(item, int) and abs(item) > MAX_INT:
                raise self._refuse("an integer grew too large")
        if self.total > MAX_TOTAL_ELEMENTS:
            raise self._refuse(f"the loss holds more than {MAX_TOTAL_ELEMENTS} elements")


def _flatten(values: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if isinstance(v, list | tuple):
            out.extend(_flatten(v))
        elif isinstance(v, dict):
            out.extend(_flatten(list(v.values())))
        else:
            out.append(v)
    return out


def _resolve(arg: Any, env: Mapping[str, Any]) -> Any:
    if isinstance(arg, _Ref):
        return env[arg.name]
    if isinstance(arg, list):
        return [_resolve(a, env) for a in arg]
    if isinstance(arg, tuple):
        return tuple(_resolve(a, env) for a in arg)
    if isinstance(arg, dict):
        return {k: _resolve(v, env) for k, v in arg.items()}
    if isinstance(arg, slice):
        return slice(_resolve(arg.start, env), _resolve(arg.stop, env), _resolve(arg.step, env))
    return arg


def _guard_pow(target: str, args: Sequence[Any], budget: _Budget) -> None:
    # Python-number pow is computed in full before any check could see it.
    if target == "operator.pow" and not any(isinstance(a, torch.Tensor) for a in args):
        base, exponent = args[0], args[1]
        if isinstance(exponent, int) and isinstance(base, int) and abs(exponent) > 64:
            raise budget._refuse("integer power with an exponent above 64")


def run_custom_loss(
    loss: CustomLoss, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """One datum: the scalar loss (differentiable w.r.t. ``logprobs``) and its metrics."""
    env: dict[str, Any] = {"logprobs": logprobs}
    for name, _rank in loss.inputs[1:]:
        env[name] = inputs[name]
    for node in loss.nodes:
        budget = _Budget(node.name)
        args = _resolve(node.args, env)
        kwargs = _resolve(dict(node.kwargs), env)
        budget.before([args, kwargs])
        try:
            if node.op == "call_method":
                if not isinstance(args[0], torch.Tensor):
                    raise budget._refuse(f"{node.target}() called on a non-tensor")
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            elif node.target in ("getattr", "builtins.getattr"):
                value = getattr(args[0], args[1])
            else:
                _guard_pow(node.target, args, budget)
                value = FUNCTIONS[node.target](*args, **kwargs)
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(
                f"custom loss {loss.name!r} node {node.name!r}: {type(exc).__name__}: {exc}", "user"
            ) from None
        budget.after(value)
        env[node.name] = value
    result = _resolve(loss.output[0], env)
    if not isinstance(result, torch.Tensor) or result.ndim != 0:
        shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise EngineError(
            f"custom loss {loss.name!r} must return a scalar loss, got {shape}", "user"
        )
    metrics: dict[str, float] = {}
    for key, ref in loss.output[1]:
        value = _resolve(ref, env)
        metrics[key] = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
    return result.to(torch.float32), metrics


def input_tensors(
    loss: CustomLoss, inputs: Mapping[str, np.ndarray], device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """The inputs the loss reads as tensors of their own dtype (float32 or int64), as the
    official SDK's client-side run of the same loss sees them."""
    out: dict[str, torch.Tensor] = {}
    for name in loss.input_names:
        array = inputs[name]
        dtype = torch.float32 if array.dtype.kind == "f" else torch.int64
        out[name] = torch.as_tensor(array, dtype=dtype, device=device)
    return out


def value_and_grad(
    loss: CustomLoss, lp: np.ndarray, inputs: Mapping[str, np.ndarray]
) -> tuple[float, np.ndarray, dict[str, float]]:
    """For NumPy engines: the loss of one datum, d loss / d lp (float64) and its metrics."""
    lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    value, metrics = run_custom_loss(loss, lp_t, input_tensors(loss, inputs))
    if value.requires_grad:
        (grad,) = torch.autograd.grad(value, lp_t, allow_unused=True)
    else:
        grad = None
    grad_np = np.zeros_like(lp) if grad is None else grad.numpy().astype(np.float64)
    return float(value.detach()), grad_np, metrics


def reduce_metrics(sums: Mapping[str, float], datums: int) -> dict[str, float]:
    """Per-request metrics from per-datum sums: ``:mean`` keys divided by the datum count."""
    return {k: (v / datums if k.endswith(":mean") and datums else v) for k, v in sums.items()}
