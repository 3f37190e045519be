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

At fp32 on a CPU the loops run too, their products and sums rounded to fp32 as eager's
operations round them: forward (an fp32 model's sampling steps, probed at fp32 the same way;
the eight operations' dispatch is most of a one-row step's rotary) and, where a probe of the
node forward and backward gives the family's bits, as the recorded node of an fp32 training
pass (each of eager's five to six passes over q and k a single loop's).

Every other model (other dtypes, a GPU, an fp32 CPU model whose loops were not built or did not
agree) gets the recorded case only, in torch's own operations (`_TorchRotary`): eager's forward
operations run without recording them, and the backward takes each gradient back through the
rotation in five operations a tensor, where eager autograd's nodes run about ten (the rotated
halves' slices each write into a zero-filled tensor of the whole size, then the pieces are
summed), with eager's bits. On a GPU each is a kernel launch and a pass over memory. On a CPU at
fp32 the node's forward and backward ran 1.04-1.07x at 1,400 tokens of 9 to 32 heads, and 1.00x
at a narrow model's sizes, where its Python backward costs the host what eager's C++ nodes cost
(docs/benchmarks.md). Its probe runs forward and backward in the model's dtype on its device.
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

__all__ = [
    "backward_kernel",
    "install",
    "installed",
    "native_kernel",
    "rotate",
    "switched",
    "uninstall",
]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rotary.cpp")
NAME = "apply_rotary_pos_emb"
# The family modules switched in this process: module name -> the family's own function.
_ORIGINALS: dict[str, Callable[..., Any]] = {}
# Of those, the families whose function the C++ loops reproduce (the dtypes probed on a CPU:
# bf16, fp32), and those whose recorded rotation `_TorchRotary` reproduces (probed in a model's
# dtype and device: the (dtype, device type) pairs probed).
_LOOPS: dict[str, set[torch.dtype]] = {}
# The loops' entry points by dtype, forward and backward
_KERNELS = {torch.bfloat16: "rotary_bf16", torch.float32: "rotary_fp32"}
_BACKWARDS = {torch.bfloat16: "rotary_backward_bf16", torch.float32: "rotary_backward_fp32"}
_NODES: dict[str, set[tuple[torch.dtype, str]]] = {}
# Of the looped families, those whose fp32 loops as a recorded node (`_Rotary`) gave the
# family's bits forward and backward on a probe (at bf16 the node is taken unprobed: its
# backward loop's arithmetic is eager's, tested bit for bit).
_LOOPED_NODES: dict[str, set[torch.dtype]] = {}


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


def native_kernel(dtype: torch.dtype = torch.bfloat16) -> Any:
    """rotary.cpp's entry point for `dtype` (bf16 or fp32; its arguments below), or None where
    it cannot be built (or for another dtype)."""
    if dtype not in _KERNELS:
        return None
    return native.function(SOURCE, _KERNELS[dtype], _signature())


def backward_kernel(dtype: torch.dtype = torch.bfloat16) -> Any:
    """rotary.cpp's backward for `dtype` (the gradients of the outputs in place of q and k),
    or None."""
    if dtype not in _BACKWARDS:
        return None
    return native.function(SOURCE, _BACKWARDS[dtype], _signature())


def _fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the loops read these: q [1, heads, tokens, dim] and k [1, kv_heads, tokens,
    dim] with cos and sin [1, tokens, dim], all bf16 or all fp32 on a CPU, every head size
    contiguous."""
    tensors = (q, k, cos, sin)
    if q.dtype not in _KERNELS:
        return False
    if any(t.dtype != q.dtype or t.device.type != "cpu" for t in tensors):
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
    if not native.without_autograd(q.dtype, q, k, cos, sin) or not _fits(q, k, cos, sin):
        return None
    kernel = native_kernel(q.dtype)
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
        return _run(native_kernel(q.dtype), q, k, cos, sin)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_q: torch.Tensor, grad_k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors  # type: ignore[attr-defined]
        grads = [g if g.stride(-1) == 1 else g.contiguous() for g in (grad_q, grad_k)]
        d_q, d_k = _run(backward_kernel(grads[0].dtype), grads[0], grads[1], cos, sin)
        return d_q, d_k, None, None


def _trained(
    name: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rotation as one autograd node of the loops where autograd records q or k (and not
    cos or sin): at bf16, or at a dtype whose node family `name` agreed with
    (`_LOOPED_NODES`); None where the loops do not take them."""
    if q.dtype != torch.bfloat16 and q.dtype not in _LOOPED_NODES.get(name, ()):
        return None
    if cos.requires_grad or sin.requires_grad or not _fits(q, k, cos, sin):
        return None
    if native_kernel(q.dtype) is None or backward_kernel(q.dtype) is None:
        return None
    out: tuple[torch.Tensor, torch.Tensor] = _Rotary.apply(q, k, cos, sin)
    return out


def _half_turned(x: torch.Tensor) -> torch.Tensor:
    """transformers' `rotate_half`: [-second half, first half] of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _turned_back(t: torch.Tensor) -> torch.Tensor:
    """The gradient through `_half_turned`: [second half, -first half]."""
    half = t.shape[-1] // 2
    return torch.cat((t[..., half:], -t[..., :half]), dim=-1)


class _TorchRotary(torch.autograd.Function):
    """q * cos + rotate_half(q) * sin and the same for k (cos and sin [batch, tokens, dim],
    unsqueezed at dimension 1, no gradient) as one node in torch's operations. The gradient of
    q is g * cos + the rotation back of g * sin: the two terms eager autograd adds (its two
    slices' zero-filled gradients add nothing else), each product and the sum rounded as its
    nodes round them."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        ctx.save_for_backward(cos, sin)
        return q * cos + _half_turned(q) * sin, k * cos + _half_turned(k) * sin

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_q: torch.Tensor, grad_k: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        cos, sin = ctx.saved_tensors  # type: ignore[attr-defined]
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        d_q = grad_q * cos + _turned_back(grad_q * sin) if needs[0] else None
        d_k = grad_k * cos + _turned_back(grad_k * sin) if needs[1] else None
        return d_q, d_k, None, None


def _node_takes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `_TorchRotary` computes what the family's function computes for these: one
    dtype and device, q and k [batch, heads, tokens, dim] with cos and sin [batch, tokens,
    dim] (an even dim), cos and sin without gradient."""
    tensors = (q, k, cos, sin)
    if not all(native.plain(t) for t in tensors):
        return False  # (a tensor subclass, e.g. a sharded DTensor: the family's own function)
    if any(t.dtype != q.dtype or t.device != q.device for t in tensors):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    batch, _, tokens, dim = q.shape
    if k.shape[0] != batch or k.shape[2:] != q.shape[2:] or dim % 2:
        return False
    if cos.shape != (batch, tokens, dim) and cos.shape != (1, tokens, dim):
        return False
    return not (cos.requires_grad or sin.requires_grad)


def _replacement(name: str, own: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(own)
    def _apply(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:
            recorded = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
            done = None
            if q.dtype in _LOOPS.get(name, ()):
                done = _trained(name, q, k, cos, sin) if recorded else rotate(q, k, cos, sin)
            if done is None and recorded and (q.dtype, q.device.type) in _NODES.get(name, ()):
                done = _TorchRotary.apply(q, k, cos, sin) if _node_takes(q, k, cos, sin) else None
            if done is not None:
                return done
        return own(q, k, cos, sin, *args, **kwargs)

    _apply.__dict__["_tuneloop_own"] = own
    return _apply


def _agrees(
    own: Callable[..., Any], heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> bool:
    """Whether `rotate` gives the bits of the family's own function on a probe in `dtype`
    shaped like the model's attention (its projections' transposed views)."""
    gen = torch.Generator().manual_seed(0)
    tokens = 5
    q = torch.randn((1, tokens, heads, dim), generator=gen).mul(4).to(dtype).transpose(1, 2)
    k = torch.randn((1, tokens, kv_heads, dim), generator=gen).mul(4).to(dtype).transpose(1, 2)
    angles = torch.randn((1, tokens, dim), generator=gen).mul(3)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    with torch.no_grad():
        want = own(q, k, cos, sin)
        got = rotate(q, k, cos, sin)
    if got is None or not isinstance(want, tuple) or len(want) != 2:
        return False
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _node_agrees(
    own: Callable[..., Any],
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    node: Callable[..., Any] | None = None,
) -> bool:
    """Whether `node` (`_TorchRotary`'s by default) gives the family's bits, forward and the
    gradients of q and k as the projections' transposed views of one tensor, on a probe in
    `dtype` on `device`."""
    heads, kv_heads, dim = shape
    if dim % 2:
        return False
    gen = torch.Generator().manual_seed(0)
    tokens = 5
    both = torch.randn((1, tokens, (heads + kv_heads) * dim), generator=gen).mul(4)
    angles = torch.randn((1, tokens, dim), generator=gen).mul(3)
    upstream = [torch.randn((1, n, tokens, dim), generator=gen) for n in (heads, kv_heads)]
    cast = [t.to(device=device, dtype=dtype) for t in (both, angles.cos(), angles.sin())]
    upstream = [u.to(device=device, dtype=dtype) for u in upstream]

    def run(rotate: Callable[..., Any]) -> list[torch.Tensor]:
        with torch.enable_grad():
            x = cast[0].clone().requires_grad_(True)
            q = x[..., : heads * dim].view(1, tokens, heads, dim).transpose(1, 2)
            k = x[..., heads * dim :].reshape(1, tokens, kv_heads, dim).transpose(1, 2)
            out = rotate(q, k, cast[1], cast[2])
            if not isinstance(out, tuple) or len(out) != 2:
                return []
            return [o.detach() for o in out] + list(torch.autograd.grad(out, (x,), upstream))

    want, got = run(own), run(node or _TorchRotary.apply)
    return len(want) == len(got) == 3 and all(
        torch.equal(g, w) for g, w in zip(got, want, strict=True)
    )


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


def _probed(name: str, what: str, probe: Callable[[], bool]) -> bool:
    try:
        return probe()
    except Exception as exc:  # a family whose function takes other arguments
        log.info("%s.%s kept for %s: %s", name, NAME, what, exc)
        return False


def install(model: nn.Module, *, loops: bool = True) -> int:
    """Point the rotary function of `model`'s families at the native loops where the model
    is bf16 or fp32 on a CPU, `loops` allows them and they agree with the family's function
    (at fp32 as a recorded node only where that agrees too, forward and backward), and, where
    the loops do not record the rotation, at the recorded node in torch's operations where it
    agrees in the model's dtype and device; returns how many of the model's families are
    switched for this model (0 where none)."""
    weight = next(model.parameters(), None)
    if weight is None:
        return 0
    dtype = weight.dtype
    loops = loops and weight.device.type == "cpu" and native_kernel(dtype) is not None
    kind = (dtype, weight.device.type)
    count = 0
    for name, shape in _families(model).items():
        family = sys.modules[name]
        own = _ORIGINALS.get(name, getattr(family, NAME))
        agrees = functools.partial(_agrees, own, *shape, dtype)
        unprobed = loops and dtype not in _LOOPS.get(name, ())
        if unprobed and _probed(name, f"the {dtype} loop", agrees):
            _LOOPS.setdefault(name, set()).add(dtype)
        looped = loops and dtype in _LOOPS.get(name, ())
        recordable = looped and dtype != torch.bfloat16 and backward_kernel(dtype) is not None
        if recordable and dtype not in _LOOPED_NODES.get(name, ()):
            probe = functools.partial(_node_agrees, own, shape, dtype, weight.device, _Rotary.apply)
            if _probed(name, f"the {dtype} loops' node", probe):
                _LOOPED_NODES.setdefault(name, set()).add(dtype)
        if not (looped and dtype == torch.bfloat16) and kind not in _NODES.get(name, ()):
            probe = functools.partial(_node_agrees, own, shape, dtype, weight.device)
            if _probed(name, f"{dtype} on {weight.device.type}", probe):
                _NODES.setdefault(name, set()).add(kind)
        if looped or kind in _NODES.get(name, ()):
            if name not in _ORIGINALS:
                _ORIGINALS[name] = own
                setattr(family, NAME, _replacement(name, own))
            count += 1
    return count


def installed(dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """The family modules whose function the native loop of `dtype` takes in this process."""
    return sorted(name for name, dtypes in _LOOPS.items() if dtype in dtypes)


def switched() -> list[str]:
    """The family modules switched in this process: to the loops, the recorded node or both."""
    return sorted(_ORIGINALS)


def uninstall() -> int:
    """Every switched family back to its own function; returns how many."""
    for name, own in _ORIGINALS.items():
        setattr(sys.modules[name], NAME, own)
    count = len(_ORIGINALS)
    _ORIGINALS.clear()
    _LOOPS.clear()
    _NODES.clear()
    _LOOPED_NODES.clear()
    return count
