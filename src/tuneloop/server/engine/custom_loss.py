"""Server-side custom losses, the running half: a graph `custom_loss_graph` checked, run per
datum by a small interpreter over torch (no torch.fx, no code generation, no eval).

Every call name resolves only inside torch, torch.nn.functional, math or operator. Before each
call the interpreter bounds what it could allocate (broadcast shape and concatenation size of
the tensor arguments, `MAX_ELEMENTS`), after it the value and the datum's running total
(`MAX_TOTAL_ELEMENTS`); a datum the loss fails on raises a user `EngineError` (that request
fails, its neighbours in the batch do not).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the usual alias)

from tuneloop.server.engine.custom_loss_graph import (
    FUNCTIONS,
    MAX_ELEMENTS,
    MAX_INT,
    CustomLoss,
    Dtype,
    Ref,
)
from tuneloop.server.engine.types import EngineError

__all__ = [
    "MAX_ELEMENTS",
    "MAX_TOTAL_ELEMENTS",
    "functions",
    "input_tensors",
    "run_custom_loss",
    "value_and_grad",
]

MAX_TOTAL_ELEMENTS = 1 << 26  # every value of one datum's run together

_MODULES: Mapping[str, Any] = {
    "torch.nn.functional": F,
    "torch._C._nn": torch._C._nn,
    "torch": torch,
    "math": math,
    "operator": operator,
}


@functools.cache
def functions() -> Mapping[str, Callable[..., Any]]:
    """Every allowed function name, resolved in its own module (one attribute, never a path)."""
    table: dict[str, Callable[..., Any]] = {}
    for name in FUNCTIONS:
        module, _, attr = name.rpartition(".")
        fn = getattr(_MODULES[module], attr, None)
        if fn is not None:
            table[name] = fn
    return table


class _Budget:
    def __init__(self, loss: str) -> None:
        self.loss = loss
        self.node = ""
        self.total = 0

    def refuse(self, message: str) -> EngineError:
        return EngineError(f"custom loss {self.loss!r} node {self.node!r}: {message}", "user")

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
            raise self.refuse(f"would make {largest} elements, at most {MAX_ELEMENTS}")

    def after(self, value: Any) -> None:
        for item in _flatten([value]):
            if isinstance(item, torch.Tensor):
                if item.numel() > MAX_ELEMENTS:
                    raise self.refuse(f"made {item.numel()} elements, at most {MAX_ELEMENTS}")
                self.total += item.numel()
            elif isinstance(item, int) and abs(item) > MAX_INT:
                raise self.refuse("an integer grew too large")
        if self.total > MAX_TOTAL_ELEMENTS:
            raise self.refuse(f"the loss holds more than {MAX_TOTAL_ELEMENTS} elements")


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
    if isinstance(arg, Ref):
        return env[arg.name]
    if isinstance(arg, Dtype):
        return getattr(torch, arg.name)
    if isinstance(arg, list):
        return [_resolve(a, env) for a in arg]
    if isinstance(arg, tuple):
        return tuple(_resolve(a, env) for a in arg)
    if isinstance(arg, dict):
        return {k: _resolve(v, env) for k, v in arg.items()}
    if isinstance(arg, slice):
        return slice(_resolve(arg.start, env), _resolve(arg.stop, env), _resolve(arg.step, env))
    return arg


def _call(
    target: str, op: str, args: Sequence[Any], kwargs: Mapping[str, Any], budget: _Budget
) -> Any:
    if op == "call_method":
        if not isinstance(args[0], torch.Tensor):
            raise budget.refuse(f"{target}() called on a {type(args[0]).__name__}")
        return getattr(args[0], target)(*args[1:], **kwargs)
    if target in ("getattr", "builtins.getattr"):
        return getattr(args[0], args[1])  # the attribute name was checked at upload
    # A Python-number power is computed in full before any later check could see it.
    numbers_only = not any(isinstance(a, torch.Tensor) for a in args)
    if (
        target == "operator.pow"
        and numbers_only
        and isinstance(args[-1], int)
        and abs(args[-1]) > 64
    ):
        raise budget.refuse("integer power with an exponent above 64")
    return functions()[target](*args, **kwargs)


def run_custom_loss(
    loss: CustomLoss, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """One datum: the scalar loss (differentiable w.r.t. ``logprobs``) and its metrics."""
    env: dict[str, Any] = {"logprobs": logprobs}
    for name in loss.input_names:
        env[name] = inputs[name]
    budget = _Budget(loss.name)
    for node in loss.nodes:
        budget.node = node.name
        args = _resolve(node.args, env)
        kwargs = _resolve(dict(node.kwargs), env)
        budget.before([args, kwargs])
        try:
            value = _call(node.target, node.op, args, kwargs, budget)
        except EngineError:
            raise
        except Exception as exc:
            raise budget.refuse(f"{type(exc).__name__}: {exc}") from None
        budget.after(value)
        env[node.name] = value
    result = _resolve(loss.output[0], env)
    if not isinstance(result, torch.Tensor) or result.ndim != 0:
        got = list(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise EngineError(f"custom loss {loss.name!r} must return a scalar loss, got {got}", "user")
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
        # a copy: wire arrays are read-only views of the request body
        out[name] = torch.tensor(array, dtype=dtype, device=device)
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
