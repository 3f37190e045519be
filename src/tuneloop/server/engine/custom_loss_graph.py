"""Server-side custom losses, the checking half: a torch.fx node list (as the official SDK
uploads it) checked against an allow-list of pure tensor operations. Pure data, no torch, so
the API can refuse a graph without loading the engine; `custom_loss` runs what passes.

Nothing in a graph is ever imported, looked up by attribute or evaluated: every call target
must be a name in `FUNCTIONS` or `METHODS` (resolved by `custom_loss` from torch, math and
operator only), `getattr` may only read the shape-like attributes in `ATTRIBUTES`, and
`get_attr` (captured tensors) and `call_module` nodes are refused. No allowed operation does
I/O, touches a module, moves data between devices or makes a tensor whose size a constant
chooses (no `torch.ones(n)`, `expand`, `repeat`, `new_*`), and no in-place method is allowed,
so memory only grows by broadcasting and concatenation, which the interpreter bounds before it
calls. Integer constants, list lengths, nesting and the node count are bounded here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ATTRIBUTES",
    "DTYPES",
    "FUNCTIONS",
    "MAX_ELEMENTS",
    "MAX_INT",
    "MAX_NODES",
    "METHODS",
    "CustomLoss",
    "Dtype",
    "GraphError",
    "Node",
    "Ref",
    "compile_loss",
    "reduce_metrics",
]

MAX_NODES = 512
MAX_ELEMENTS = 1 << 24  # one value (or input) of a loss: 16M elements, 64 MiB in float32
MAX_INT = 1 << 62  # Python ints (shapes, constants) stay small: no 10**10**10 through pow
MAX_ARG_DEPTH = 6
MAX_ARG_ITEMS = 64
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")

# Element-wise maths, reductions, comparisons, and views that never grow a tensor.
_TENSOR_OPS = (
    "abs", "add", "sub", "mul", "div", "true_divide", "neg", "exp", "log", "log1p", "expm1",
    "log2", "exp2", "sigmoid", "tanh", "sqrt", "rsqrt", "square", "pow", "clamp", "clamp_min",
    "clamp_max", "clip", "sum", "mean", "prod", "std", "var", "max", "min", "amax", "amin",
    "logsumexp", "softmax", "log_softmax", "cumsum", "sign", "relu", "minimum", "maximum",
    "where", "masked_fill", "gather", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
    "logical_or", "logical_not", "isfinite", "nan_to_num", "unsqueeze", "squeeze", "flatten",
    "reshape", "transpose", "detach", "floor", "ceil", "round", "reciprocal",
)  # fmt: skip
_METHOD_ONLY = (
    "view", "t", "contiguous", "size", "dim", "numel", "float", "double", "bool", "long",
    "int", "type_as",
)  # fmt: skip
_OPERATOR = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "neg", "pos", "pow", "abs", "getitem",
    "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "xor", "invert",
)  # fmt: skip
_FUNCTIONAL = ("logsigmoid", "softplus", "log_softmax", "softmax", "relu", "sigmoid", "silu")

FUNCTIONS: frozenset[str] = frozenset(
    [f"torch.{n}" for n in (*_TENSOR_OPS, "stack", "cat", "zeros_like", "ones_like", "full_like")]
    + [f"torch.nn.functional.{n}" for n in _FUNCTIONAL]
    # the names torch.fx records for the C builtins behind F.logsigmoid and F.softplus
    + ["torch._C._nn.log_sigmoid", "torch._C._nn.softplus"]
    + [f"math.{n}" for n in ("log", "exp", "sqrt", "log1p", "expm1", "tanh", "fabs")]
    + [f"operator.{n}" for n in _OPERATOR]
)
METHODS: frozenset[str] = frozenset((*_TENSOR_OPS, *_METHOD_ONLY))
ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T"})
DTYPES = frozenset({"float32", "float64", "int64", "int32", "bool"})
_GETATTR = ("getattr", "builtins.getattr")


class GraphError(ValueError):
    """A graph the server will not run; `node` names the offending node (or "inputs"/"graph")."""

    def __init__(self, node: str, message: str) -> None:
        super().__init__(f"node {node!r}: {message}")
        self.node = node


@dataclass(frozen=True)
class Ref:
    """An argument that is an earlier node's value."""

    name: str


@dataclass(frozen=True)
class Dtype:
    """A torch dtype constant, by name (resolved when the loss runs)."""

    name: str


@dataclass(frozen=True)
class Node:
    op: str  # call_function or call_method
    name: str
    target: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]

    @property
    def is_getattr(self) -> bool:
        return self.op == "call_function" and self.target in _GETATTR


@dataclass(frozen=True)
class CustomLoss:
    """A checked graph, plain data (it travels to worker processes): inputs in order with
    ``logprobs`` first and their ranks, the call nodes in order, and what the output returns."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    nodes: tuple[Node, ...]
    output: tuple[Ref, tuple[tuple[str, Ref], ...]]

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
            return Ref(value)
        if kind == "tuple" and isinstance(value, list):
            return tuple(_decode(value, known, node, depth + 1))
        if kind == "dict" and isinstance(value, dict) and len(value) <= MAX_ARG_ITEMS:
            return {str(k): _decode(v, known, node, depth + 1) for k, v in value.items()}
        if kind == "slice" and isinstance(value, list) and len(value) == 3:
            return slice(*(_decode(v, known, node, depth + 1) for v in value))
        if kind == "ellipsis" and value is True:
            return Ellipsis
        if kind == "float" and value in ("inf", "-inf", "nan"):
            return float(value)
        if kind == "dtype" and value in DTYPES:
            return Dtype(value)
        raise GraphError(
            node,
            f"argument {{{kind!r}: ...}} is not allowed (nor are devices, layouts and memory "
            "formats: the loss runs where the logprobs are)",
        )
    raise GraphError(node, f"unsupported argument {type(arg).__name__}")


def _check_call(op: str, target: str, args: tuple[Any, ...], node: str) -> None:
    if op == "call_function":
        if target in _GETATTR:
            if len(args) != 2 or not isinstance(args[0], Ref) or args[1] not in ATTRIBUTES:
                raise GraphError(
                    node, f"getattr may only read {', '.join(sorted(ATTRIBUTES))} of a value"
                )
        elif target not in FUNCTIONS:
            raise GraphError(node, f"calls {target!r}, which is not an allowed tensor operation")
    elif op == "call_method":
        if target not in METHODS:
            raise GraphError(node, f"calls method {target!r}, which is not allowed")
        if not args or not isinstance(args[0], Ref):
            raise GraphError(node, "a method call needs a value to call it on")
    elif op == "get_attr":
        raise GraphError(node, "captures a tensor (get_attr); a loss reads only its inputs")
    else:
        raise GraphError(node, f"{op} nodes are not allowed")


def _check_output(args: tuple[Any, ...], node: str) -> tuple[Ref, tuple[tuple[str, Ref], ...]]:
    value = args[0] if len(args) == 1 else None
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise GraphError(node, "the loss must return (loss, metrics)")
    loss, metrics = value
    if not isinstance(loss, Ref) or not isinstance(metrics, dict):
        raise GraphError(node, "the loss must return a tensor and a dict of metric tensors")
    checked: list[tuple[str, Ref]] = []
    for key, metric in metrics.items():
        if not _METRIC_KEY.fullmatch(key) or not isinstance(metric, Ref):
            raise GraphError(node, f"metric {key!r} must be a tensor named custom/<name>:sum|mean")
        checked.append((key, metric))
    return loss, tuple(checked)


def compile_loss(
    name: str, inputs: Sequence[tuple[str, int]], nodes: Sequence[Mapping[str, Any]]
) -> CustomLoss:
    """Check an uploaded graph (nodes as dicts: op, name, target, args, kwargs)."""
    if len(nodes) > MAX_NODES:
        raise GraphError("graph", f"{len(nodes)} nodes, at most {MAX_NODES}")
    if not inputs or inputs[0][0] != "logprobs" or inputs[0][1] not in (1, 2):
        raise GraphError("inputs", "the first input must be logprobs, of rank 1 or 2")
    if len({n for n, _ in inputs}) != len(inputs):
        raise GraphError("inputs", "input names repeat")
    known: set[str] = set()
    body: list[Node] = []
    output: tuple[Ref, tuple[tuple[str, Ref], ...]] | None = None
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
            expected = inputs[placeholders][0] if placeholders < len(inputs) else None
            if target != expected or node != expected or body:
                raise GraphError(node, "placeholders must be the declared inputs, in order")
            placeholders += 1
        elif op == "output":
            output = _check_output(args, node)
        else:
            _check_call(op, target, args, node)
            body.append(Node(op, node, target, args, tuple(kwargs.items())))
        known.add(node)
    if placeholders != len(inputs):
        raise GraphError("inputs", f"{len(inputs)} inputs declared, {placeholders} placeholders")
    if output is None:
        raise GraphError("graph", "no output node")
    return CustomLoss(name, tuple((n, int(r)) for n, r in inputs), tuple(body), output)


def reduce_metrics(sums: Mapping[str, float], datums: int) -> dict[str, float]:
    """Per-request metrics from per-datum sums: ``:mean`` keys divided by the datum count (as
    the official SDK's client-side run of a loss handle reduces them)."""
    return {k: (v / datums if k.endswith(":mean") and datums else v) for k, v in sums.items()}
