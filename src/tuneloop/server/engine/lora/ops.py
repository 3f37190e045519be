"""Multi-adapter LoRA matmuls over segments of rows: the plain-torch reference and a kernel seam.

`add_lora(out, x, sizes, factors)` adds, to each segment of rows, its adapter's
`scale * x @ A.T @ B.T`: the contract of punica's SGMV (shrink then expand over segments,
one adapter index per segment), as vLLM's `vllm/lora/ops` implements it with Triton. On the CPU,
and wherever no kernel is registered, it runs as plain torch: one pair of 2-D matmuls per
segment, or two batched matmuls when every segment has the same size and rank (the decode step
of many requests). A GPU kernel plugs in with `register_kernel`; it gets the same arguments and
must return the same values and gradients (tests compare it against `add_lora_torch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tuneloop.server.engine import cpu_fp32_matmul
from tuneloop.server.engine.lora import native_grads, native_summed

__all__ = [
    "HALF",
    "Factors",
    "add_lora",
    "add_lora_torch",
    "kernel_on",
    "one_adapter_linear",
    "register_kernel",
    "registered_kernel",
    "scaled_",
    "shrink",
    "summed_linear",
]

# One adapter's factors on one layer: A [r, in], B [out, r], scale (alpha / r).
Factors = tuple[torch.Tensor, torch.Tensor, float]
Stacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Kernel = Callable[
    [torch.Tensor, torch.Tensor, Sequence[int], Sequence["Factors | None"], "dict[str, Stacked]"],
    torch.Tensor,
]

HALF = (torch.bfloat16, torch.float16)
_EXACT_DELTA = True  # (bench/train_variants.py switches it off to compare: --micro, exact-delta)

_kernel: Kernel | None = None
_kernel_devices: frozenset[str] = frozenset()


def register_kernel(kernel: Kernel | None, devices: Sequence[str] = ("cuda",)) -> None:
    """Use `kernel` for inputs on these device types (None: back to plain torch everywhere)."""
    global _kernel, _kernel_devices
    _kernel = kernel
    _kernel_devices = frozenset(devices) if kernel is not None else frozenset()


def registered_kernel() -> Kernel | None:
    return _kernel


def kernel_on(device: torch.device) -> bool:
    """Whether a registered kernel serves inputs on `device`."""
    return _kernel is not None and device.type in _kernel_devices


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    sizes: Sequence[int],
    factors: Sequence[Factors | None],
    cache: dict[str, Stacked],
) -> torch.Tensor:
    """out [N, out] + each segment's LoRA delta of x [N, in]; segment i has sizes[i] rows and
    factors[i] (None: no delta). `cache` keeps stacked factors across calls of one routing.
    `out` is the base layer's fresh output: it may be updated in place and returned."""
    if _kernel is not None and kernel_on(x.device):
        return _kernel(out, x, sizes, factors, cache)
    return add_lora_torch(out, x, sizes, factors, cache)


def shrink(x: torch.Tensor, factors: Factors) -> torch.Tensor:
    """scale * x @ A.T ([rows, r], in A's dtype): the first of a delta's two products.

    The scale goes on this small product (not on B, [out, r], re-scaled every call: 1.5M
    elements for a 49k-vocab head, per adapter, per decode step)."""
    a, _, scale = factors
    low = x.to(a.dtype) @ a.t()
    # alpha = rank (the default) makes the scale 1: multiplying by it changes no bit but is one
    # more kernel per adapted layer (~250 a decode step of an 8B Qwen3 on a GPU) and one more
    # autograd node in training.
    return low if scale == 1.0 else low * scale


def scaled_(product: torch.Tensor, scale: float) -> torch.Tensor:
    """A fresh product times the adapter's scale, in place; as it is where the scale is 1 (alpha =
    rank, the default), which changes no bit: a kernel and its dispatch fewer per product (14 a
    decoder layer's backward pass, a host cost that a GPU's step pays per layer)."""
    return product if scale == 1.0 else product.mul_(scale)


def _delta(x: torch.Tensor, factors: Factors, dtype: torch.dtype) -> torch.Tensor:
    return (shrink(x, factors) @ factors[1].t()).to(dtype)


def _plus_delta(
    out: torch.Tensor, x: torch.Tensor, factors: Factors, *, in_place: bool = False
) -> torch.Tensor:
    """out + the delta of x; by `addmm` where the factors are in out's dtype (`lookup_as` casts
    them to it), so the product's pass makes the sum instead of another pass over [rows, out]
    (the separate adds were ~5 % of a training step on SmolLM2). `in_place` (out is the base
    layer's fresh output, which no backward pass reads) also saves addmm's copy of out where
    no graph is recorded: on a recorded view autograd would copy the gradient per layer."""
    a, b, _ = factors
    if a.dtype != out.dtype or x.dtype != out.dtype:
        return out + _delta(x, factors, out.dtype)
    low = shrink(x, factors)
    if in_place and not (torch.is_grad_enabled() and out.requires_grad):
        return out.addmm_(low, b.t())
    return torch.addmm(out, low, b.t())


def add_lora_torch(
    out: torch.Tensor,
    x: torch.Tensor,
    sizes: Sequence[int],
    factors: Sequence[Factors | None],
    cache: dict[str, Stacked],
) -> torch.Tensor:
    if len(sizes) == 1:  # one adapter for the whole batch, the common case
        return out if factors[0] is None else _plus_delta(out, x, factors[0], in_place=True)
    grouped = _grouped(x, sizes, factors, cache, out.dtype)
    if grouped is not None:
        return out + grouped
    # Split into segments, add each one's delta, concatenate once. (An index_add per adapter
    # copied the whole output each time; slicing instead of split makes the backward pass
    # zero-fill a full-size gradient per segment.)
    pieces = []
    for item, x_seg, out_seg in zip(
        factors, x.split(list(sizes)), out.split(list(sizes)), strict=True
    ):
        pieces.append(out_seg if item is None else _plus_delta(out_seg, x_seg, item))
    return torch.cat(pieces, dim=0)


def _grouped(
    x: torch.Tensor,
    sizes: Sequence[int],
    factors: Sequence[Factors | None],
    cache: dict[str, Stacked],
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """All segments' deltas in two batched matmuls, when the segments allow it.

    Needs equal-size segments whose adapters all have factors here with one rank: the decode
    steps of a batch of requests with the same num_samples. There, per-adapter matmuls of a few
    rows each cost more in per-operation overhead than in arithmetic (measured: 8 adapters x 1
    row per decode step ran at 0.6x of one adapter x 8 rows).
    """
    present = [f for f in factors if f is not None]
    if len(present) != len(factors) or len(set(sizes)) != 1:
        return None
    if len({f[0].shape[0] for f in present}) != 1:
        return None
    stacked = cache.get("grouped")
    if stacked is None:
        a = torch.stack([f[0] for f in present])  # [G, r, in]
        b = torch.stack([f[1] for f in present])  # [G, out, r]
        scale = torch.tensor([f[2] for f in present], dtype=a.dtype, device=a.device)
        stacked = cache["grouped"] = (a, b, scale)
    a, b, scale = stacked
    groups = x.reshape(len(sizes), -1, x.shape[-1]).to(a.dtype)  # [G, rows, in]
    low = torch.bmm(groups, a.transpose(1, 2))  # [G, rows, r]
    if any(f[2] != 1.0 for f in present):
        low = low * scale[:, None, None]
    return torch.bmm(low, b.transpose(1, 2)).reshape(x.shape[0], -1).to(dtype)


def summed_linear(
    x: torch.Tensor,
    low: torch.Tensor,
    weight: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x @ W.T + low @ B.T (+ bias) as one matmul of [x | low] by [W | B]: the delta summed
    with the base in fp32 and the sum rounded once. Added to a rounded half-precision output
    instead, a young adapter's delta (far below the output's last bit) is mostly lost
    (fused.py's docstring). Costs a copy of W per call: for passes over many tokens."""
    wide = torch.cat([weight, b], dim=1)
    return torch.nn.functional.linear(torch.cat([x, low], dim=1), wide, bias)


class _OneAdapterLinear(torch.autograd.Function):
    """x @ W.T (+ bias) + scale * x @ A.T @ B.T with W and the bias frozen, as one graph node.

    What autograd records for the base layer followed by `_plus_delta` is four nodes (the base
    matmul, the down-projection, its scale, the addmm of the up-projection), an addmm that
    copies the base output to add into it, and an input gradient made of two [rows, in]
    tensors summed by one more pass. Here the up-projection is added into the fresh base output
    in place, the scale rides on the small [rows, r] products, and the delta's input gradient
    is added by `addmm_` into the base's: on SmolLM2-135M's layer shapes (1,408 tokens, rank
    32, bf16, an AMX Xeon) a decoder layer's seven adapted linears forward + backward took
    29.8-30.9 ms against 31.7-32.5 ms (1.05-1.06x; bench/train_variants.py --micro).

    At half precision the forward is one matmul of [x | x @ A.T] by [W | scale * B]: the delta
    summed with the base in fp32 and rounded once. Added to the rounded output instead (what
    the two-node path and PEFT do), a young adapter's delta, far below the output's last bit,
    is mostly lost: bench/fused_linears.py measures about half of it kept. The decode step's
    fused weights (fused.py) compute the same sum, so sampler and trainer see the same policy.
    The copy of W this takes per call is one pass over the weight per forward pass: a bf16
    training step on an AVX-512-BF16 Xeon read 0.98x, within its step-to-step noise
    (bench/train_variants.py --variant exact-delta, docs/benchmarks.md). On CPUs with
    AVX512-BF16 the native kernel makes the same sums without the copies (native_summed.py).
    Gradients as the two-node path's to rounding.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a: torch.Tensor,
        b: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        low = flat @ a.t()  # [rows, r], before its scale
        packed = None
        if _EXACT_DELTA and native_summed.available(flat, (weight,), (flat.shape[1], a.shape[0])):
            packed = native_summed.frozen((weight,))
        if packed is not None:  # (the same sums without joining them: native_summed.py)
            blocks = native_summed.b_blocks((b,), (scale,))
            out = native_summed.summed(flat, low, packed, blocks, bias)
        elif _EXACT_DELTA and weight.dtype in HALF:
            out = summed_linear(flat, low, weight, b * scale, bias)
        else:
            out = cpu_fp32_matmul.linear(flat, weight, bias)
            out.addmm_(low, b.t(), alpha=scale)
        ctx.save_for_backward(flat, weight, a, b, low)
        ctx.scale = scale  # type: ignore[attr-defined]
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        flat, weight, a, b, low = ctx.saved_tensors  # type: ignore[attr-defined]
        scale: float = ctx.scale  # type: ignore[attr-defined]
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        shape = (*grad.shape[:-1], flat.shape[-1])
        dy = grad.reshape(-1, grad.shape[-1])
        d_low = dy @ b  # [rows, r], the gradient of low before its scale
        d_x = d_a = d_b = None
        if needs[0] and native_summed.available(flat, (weight,), (dy.shape[1], a.shape[0])):
            scaled = d_low if scale == 1.0 else d_low * scale
            d_x = native_summed.input_grad((dy,), scaled, (weight,), a)
            if d_x is not None:
                d_x = d_x.view(shape)
        if needs[0] and d_x is None:
            d_x = cpu_fp32_matmul.matmul(dy, weight).addmm_(d_low, a, alpha=scale).view(shape)
        if needs[3]:
            d_a = scaled_(native_grads.transposed_product(d_low, flat), scale)
        if needs[4]:
            d_b = scaled_(native_grads.transposed_product(low, dy, transposed=True), scale)
        return d_x, None, None, d_a, d_b, None


def one_adapter_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, factors: Factors
) -> torch.Tensor:
    """`linear(x, weight, bias)` plus one adapter's delta on every row, for passes over many
    tokens: the weight and bias frozen, the factors in x's dtype (their gradients reach their
    masters through the cast that made them)."""
    a, b, scale = factors
    out: torch.Tensor = _OneAdapterLinear.apply(x, weight, bias, a, b, scale)
    return out
