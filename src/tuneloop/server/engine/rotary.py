"""The rotary embedding at bf16 on a CPU as one C++ call a layer, forward and backward (rotary.cpp).

transformers applies the rotary embedding with a function of each model family's module,
`apply_rotary_pos_emb(q, k, cos, sin)`: q * cos + rotate_half(q) * sin, and the same for k,
eight small operations on [1, heads, tokens, head size] views. In a decode step of 128 rows
on an AVX-512 EPYC they took ~140 us a layer, 4 ms of a ~150 ms step (30 layers), where one
loop over both tensors takes a few microseconds; in a training step of 1,233 tokens on an
AMX Xeon 0.85 ms forward and ~2 ms backward a layer. `install(model)` points the function of
the model's family at `_apply` (as liger-kernel patches these modules): on bf16 CPU tensors
it runs the loop, which rounds each product and the sum to bf16 as eager torch does, so it
gives the same bits; where autograd records q or k, as one node (`_Rotary`) whose backward
loop makes eager autograd's gradients bit for bit (the rotation back, each product and the
sum rounded as eager's nodes round them). In every other case (other dtypes and devices,
layouts it does not take) it calls the family's own function. A family is switched only
after the two agree bit for bit on a probe, so a family whose rotary differs (interleaved
pairs, partial rotary) keeps its own.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tuneloop.server.engine import native

__all__ = ["backward_kernel", "install", "installed", "native_kernel", "rotate", "uninstall"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rotary.cpp")
NAME = "apply_rotary_pos_emb"
# The family modules switched in this process: module name -> the family's own function.
_ORIGINALS: dict[str, Callable[..., Any]] = {}


def _signature() -> tuple[Any, ...]:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    return (
        *(pointer, size, size, size) * 2,  # q and k: data, token stride, head stride, heads
        pointer,
        pointer,
        size,  # cos, sin, their token stride
        size,
        size,  # tokens, head size
        pointer,
        pointer,
        ctypes.c_int,
    )


def native_kernel() -> Any:
    """rotary.cpp's entry point (its arguments below), or None where it cannot be built."""
    return native.function(SOURCE, "rotary_bf16", _signature())


def backward_kernel() -> Any:
    """rotary.cpp's backward (the gradients of the outputs in place of q and k), or None."""
    return native.function(SOURCE, "rotary_backward_bf16", _signature())


def _fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the loops read these: q [1, heads, tokens, dim] and k [1, kv_heads, tokens,
    dim] with cos and sin [1, tokens, dim], all bf16 on a CPU, every head size contiguous."""
    tensors = (q, k, cos, sin)
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    _, _, tokens, dim = q.shape
    if q.shape[0] != 1 or k.shape[0] != 1 or k.shape[2:] != q.shape[2:] or dim % 2:
        return False
    if cos.shape != (1, tokens, dim) or cos.stride() != sin.stride():
        return False
    return all(t.stride(-1) == 1 for t in tensors)


def _run(
    kernel: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of the forward or backward loop (`_fits`' inputs); its results laid out
    [tokens, heads, dim] in memory, as eager torch lays out its results for the
    projections' transposed views."""
    _, heads, tokens, dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty((tokens, heads, dim), dtype=q.dtype)
    k_out = torch.empty((tokens, kv_heads, dim), dtype=k.dtype)
    kernel(
        q.data_ptr(), q.stride(2), q.stride(1), heads, k.data_ptr(), k.stride(2), k.stride(1),
        kv_heads, cos.data_ptr(), sin.data_ptr(), cos.stride(1), tokens, dim, q_out.data_ptr(),
        k_out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return q_out.transpose(0, 1)[None], k_out.transpose(0, 1)[None]


def rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`apply_rotary_pos_emb(q, k, cos, sin)` by the C++ loop for inputs autograd does not
    record (`_fits`' shapes); None for anything else (or where the loop was not built)."""
    if not native.bf16_without_autograd(q, k, cos, sin) or not _fits(q, k, cos, sin):
        return None
    kernel = native_kernel()
    return None if kernel is None else _run(kernel, q, k, cos, sin)


class _Rotary(torch.autograd.Function):
    """The rotation by the forward loop and its gradient by the backward loop (eager's bits
    both ways); cos and sin take no gradient."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        return _run(native_kernel(), q, k, cos, sin)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_q: torch.Tensor, grad_k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors  # type: ignore[attr-defined]
        grads = [g if g.stride(-1) == 1 else g.contiguous() for g in (grad_q, grad_k)]
        d_q, d_k = _run(backward_kernel(), grads[0], grads[1], cos, sin)
        return d_q, d_k, None, None


def _trained(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rotation as one autograd node of the loops where autograd records q or k (and not
    cos or sin); None where the loops do not take them."""
    if cos.requires_grad or sin.requires_grad or not _fits(q, k, cos, sin):
        return None
    if native_kernel() is None or backward_kernel() is None:
        return None
    out: tuple[torch.Tensor, torch.Tensor] = _Rotary.apply(q, k, cos, sin)
    return out


def _replacement(own: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(own)
    def _apply(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:
            recorded = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
            done = _trained(q, k, cos, sin) if recorded else rotate(q, k, cos, sin)
            if done is not None:
                return done
        return own(q, k, cos, sin, *args, **kwargs)

    _apply.__dict__["_tuneloop_own"] = own
    return _apply


def _agrees(own: Callable[..., Any], heads: int, kv_heads: int, dim: int) -> bool:
    """Whether `rotate` gives the bits of the family's own function on a probe shaped like
    the model's attention (its projections' transposed views)."""
    gen = torch.Generator().manual_seed(0)
    tokens = 5
    q = torch.randn((1, tokens, heads, dim), generator=gen).mul(4).bfloat16().transpose(1, 2)
    k = torch.randn((1, tokens, kv_heads, dim), generator=gen).mul(4).bfloat16().transpose(1, 2)
    angles = torch.randn((1, tokens, dim), generator=gen).mul(3)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    with torch.no_grad():
        want = own(q, k, cos, sin)
        got = rotate(q, k, cos, sin)
    if got is None or not isinstance(want, tuple) or len(want) != 2:
        return False
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _families(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """The modules of the model's attention classes that define `apply_rotary_pos_emb`, with
    the attention's (heads, key heads, head size) from the model's config."""
    config: Any = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or (
        config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None
    )
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and isinstance(dim, int)):
        return {}
    found: dict[str, tuple[int, int, int]] = {}
    for module in model.modules():
        name = type(module).__module__
        if name.startswith("transformers.") and "Attention" in type(module).__name__:
            family = sys.modules.get(name)
            if isinstance(family, types.ModuleType) and callable(getattr(family, NAME, None)):
                found[name] = (heads, kv_heads, dim)
    return found


def install(model: nn.Module) -> int:
    """Point the rotary function of `model`'s families at the native form where it agrees
    with theirs; returns how many families are switched for it (0 where none, for a model
    that is not bf16 on a CPU, or where the loop cannot be built)."""
    weight = next(model.parameters(), None)
    if weight is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return 0  # (the loop would never apply: no wrapper in its way)
    if native_kernel() is None:
        return 0
    count = 0
    for name, (heads, kv_heads, dim) in _families(model).items():
        family = sys.modules[name]
        current = getattr(family, NAME)
        if name in _ORIGINALS:
            count += 1  # switched already (another model of the family)
            continue
        try:
            agrees = _agrees(current, heads, kv_heads, dim)
        except Exception as exc:  # a family whose function takes other arguments
            log.info("%s.%s kept: %s", name, NAME, exc)
            agrees = False
        if agrees:
            _ORIGINALS[name] = current
            setattr(family, NAME, _replacement(current))
            count += 1
    return count


def installed() -> list[str]:
    """The family modules switched in this process."""
    return sorted(_ORIGINALS)


def uninstall() -> int:
    """Every switched family back to its own function; returns how many."""
    for name, own in _ORIGINALS.items():
        setattr(sys.modules[name], NAME, own)
    count = len(_ORIGINALS)
    _ORIGINALS.clear()
    return count
