"""The gated MLP's SiLU product as C++ loops at bf16 on a CPU, forward and backward.

transformers' gated MLP (Llama, Qwen2/3, Mistral, SmolLM2) computes
`down_proj(act_fn(gate_proj(x)) * up_proj(x))` with act_fn SiLU. Between the matmuls, eager
torch runs silu and the product as two passes over [tokens, intermediate], each with its own
dispatch and thread hand-off: ~80 us a layer for a decode step's 128 rows of 1536 on two
threads (silu 57, the product 21). silu_mul.cpp's loop reads gate and up once and writes the
product once, silu looked up in a table of every bf16 value's (computed per element, exp and
the division alone cost what eager's silu does): 42 us with its call, the loop itself 35.
Small products stay eager (`MIN_ELEMENTS`). gate and up are often the two halves of one
matmul's output (the engine's sibling layers, lora/fused.py and lora/siblings.py), so the
loops read them through their row strides, without a copy.

Where autograd records the product (training), `_SiluMul` runs that loop forward and
silu_mul_backward_bf16 backward: one pass reads the output's gradient, gate and up and writes
both gradients, where eager makes four passes and keeps silu(gate) from the forward pass (on
1,408 tokens of SmolLM2 on an AMX Xeon: 0.38 against 0.81 ms forward, 1.06 against 1.26
backward; bench/train_variants.py --variant mlp-product).

The loops give eager's bits: silu in fp32 rounded to bf16, the product in fp32 rounded to
bf16 again, the table filled with an exp of the same reduction and polynomial as the one
torch's vectorized kernels call (equal to eager's silu for every bf16 input, in the tests);
backward, the two products rounded to bf16 and silu_backward's factors tabulated with eager's
roundings. They run on bf16 CPU tensors (no autograd, or the Function's); elsewhere the
module computes as before, and a module whose weights are in another dtype is not switched. A
module is switched only after its own forward and `down_proj(silu(gate_proj(x)) *
up_proj(x))` agree bit for bit on a probe input, so an MLP that computes something else keeps
its forward.

At fp32 no table can hold every input: `fp32_kernel` (silu_mul_fp32.cpp, AVX2) computes eager's
formula, x / (1 + exp(-x)) times up, in one pass, with torch's own vectorized exp (SLEEF's
expf8_u10, found in libtorch_cpu by name) passed in by its address, and is taken only after it
gave eager's bits on a probe. An fp32 model's sampling steps take it where their layers run
as one C++ call (native_layers.py); the modules keep eager's product, whose bits it gives.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tuneloop.server.engine import native

__all__ = [
    "backward_kernel",
    "eager_silu",
    "fp32_kernel",
    "gathers",
    "install",
    "native_kernel",
    "silu_mul",
    "switched",
    "uninstall",
]

log = logging.getLogger(__name__)

NATIVE_SOURCE = Path(__file__).with_name("silu_mul.cpp")
FP32_SOURCE = Path(__file__).with_name("silu_mul_fp32.cpp")
# torch's own vectorized exp for AVX2 (SLEEF's expf8_u10), which its fp32 silu calls
_TORCH_EXP = "Sleef_expf8_u10avx2"
# Products smaller than this stay eager: the loop's call costs ~7 us of Python and ctypes
# around it, eager's two operations ~4 us on one row of 1536, and they break even near six
# rows (measured on a 2-core AVX-512 EPYC: 128 rows 78 -> 42 us, 16 rows 20.5 -> 14.4).
MIN_ELEMENTS = 8192


def native_kernel() -> Any:
    """silu_mul.cpp's entry point (gate, gate's row stride, up, up's row stride, rows, width,
    out, threads), or None where it cannot be built."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    signature = (pointer, size, pointer, size, size, size, pointer, ctypes.c_int)
    return native.function(NATIVE_SOURCE, "silu_mul_bf16", signature)


def _torch_exp() -> int | None:
    """The address of torch's `_TORCH_EXP` in libtorch_cpu, or None where it has none."""
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return ctypes.cast(getattr(ctypes.CDLL(str(library)), _TORCH_EXP), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _eager_bits(kernel: Any) -> bool:
    """Whether `kernel` gives `silu(gate) * up`'s eager bits on a probe: random values over
    the range where silu changes, the edges where exp underflows or overflows, signed zeros,
    infinities and NaN, rows read through the strides of one matmul's halves. The width, 16
    times an odd number, leaves a tail to a torch whose vectorized loop steps by more than
    16 (AVX-512's 32), where eager's scalar exp would round apart: such a torch fails here."""
    generator = torch.Generator().manual_seed(0)
    rows, width = 64, 272
    both = torch.randn(rows, 2 * width, generator=generator) * 12
    edges = torch.tensor([0.0, -0.0, 88.7, 88.8, -88.7, -103.9, -104.1, -200.0, 1e-30, -1e-45])
    edges = torch.cat([edges, torch.tensor([float("inf"), float("-inf"), float("nan")])])
    both[0, : edges.numel()] = edges
    gate, up = both[:, :width], both[:, width:]
    out = torch.empty(rows, width)
    code = kernel(
        gate.data_ptr(), both.stride(0), up.data_ptr(), both.stride(0), rows, width,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    want = torch.nn.functional.silu(gate) * up
    same = torch.equal(out.view(torch.int32), want.view(torch.int32))
    return code == 0 and same


@functools.cache
def fp32_kernel() -> Any:
    """silu_mul_fp32.cpp's entry point (gate, gate's row stride, up, up's row stride, rows,
    width, out, threads; returns 0, or 1 where refused: widths must be multiples of 16), its
    exp set to torch's own; None where it cannot be built, torch carries no such exp, or it
    did not give eager's bits on a probe (a torch whose silu computes otherwise)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    signature = (pointer, size, pointer, size, size, size, pointer, ctypes.c_int)
    kernel = native.function(FP32_SOURCE, "silu_mul_fp32", signature, ctypes.c_int, ("avx2", "fma"))
    address = _torch_exp() if kernel is not None else None
    if kernel is None or address is None:
        return None
    use = native.function(FP32_SOURCE, "silu_mul_fp32_exp", (pointer,), ctypes.c_int)
    use(address)
    if not _eager_bits(kernel):
        log.info("the fp32 SiLU loop does not give eager's bits here: eager's product is kept")
        return None
    return kernel


def gathers(allowed: bool | None) -> bool:
    """Sets whether the loops read their tables by AVX-512 gathers (True) or one element at a
    time (False): the tests run both forms on one CPU. None, the default, has each loop
    measure both forms at its first call and keep the faster on this CPU (silu_mul.cpp).
    Returns whether the forward loop now takes the gathers (False where the CPU or the
    library has none)."""
    switch = native.function(NATIVE_SOURCE, "silu_mul_gathers", (ctypes.c_int,), ctypes.c_int)
    return switch is not None and bool(switch(-1 if allowed is None else int(allowed)))


def _row_stride(t: torch.Tensor) -> int | None:
    """The elements from one row of `t` to the next, `t` seen as [rows, width] (the half of
    one matmul's output: that output's width); None where its rows are not each contiguous
    and evenly spaced. (Read from the strides: a reshape and a view cost more than the loop
    on a row.)"""
    shape, strides = t.shape, t.stride()
    if strides[-1] != 1:
        return None
    if len(shape) == 2 or (len(shape) == 3 and shape[0] == 1):
        return strides[-2]  # a step's [tokens, width] or [1, tokens, width]
    step, span = None, 0
    for size, stride in zip(reversed(shape[:-1]), reversed(strides[:-1]), strict=True):
        if size == 1:
            continue  # (any stride)
        if step is None:
            step, span = stride, stride * size
        elif stride != span:
            return None
        else:
            span *= size
    return shape[-1] if step is None else step


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """`silu(gate) * up` of bf16 CPU tensors of one shape, without autograd, by the C++ loop
    (bit for bit eager's); None where it does not apply (or could not be built)."""
    if gate.shape != up.shape or gate.numel() == 0:
        return None
    if not native.bf16_without_autograd(gate, up):
        return None
    kernel = native_kernel()
    if kernel is None:
        return None
    width = gate.shape[-1]
    if (gate_stride := _row_stride(gate)) is None:
        gate, gate_stride = gate.contiguous(), width
    if (up_stride := _row_stride(up)) is None:
        up, up_stride = up.contiguous(), width
    out = torch.empty(gate.shape, dtype=torch.bfloat16)
    kernel(
        gate.data_ptr(),
        gate_stride,
        up.data_ptr(),
        up_stride,
        gate.numel() // width,
        width,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def backward_kernel() -> Any:
    """silu_mul.cpp's backward (grad, its row stride, gate, its row stride, up, its row
    stride, rows, width, grad_gate, grad_up, threads), or None where it cannot be built."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    signature = (pointer, size, pointer, size, pointer, size, size, size, pointer, pointer)
    return native.function(NATIVE_SOURCE, "silu_mul_backward_bf16", (*signature, ctypes.c_int))


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`t` and its row stride as the loops read it (a copy where its rows are not evenly
    spaced and each contiguous)."""
    stride = _row_stride(t)
    return (t, stride) if stride is not None else (t.contiguous(), t.shape[-1])


class _SiluMul(torch.autograd.Function):
    """`silu(gate) * up` in a pass that records a graph: the loop's forward and its backward
    (silu_mul_backward_bf16), each eager's bits. It keeps gate and up for the backward, where
    eager keeps silu(gate) besides them."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, gate: torch.Tensor, up: torch.Tensor
    ) -> torch.Tensor:
        with torch.no_grad():
            out = silu_mul(gate, up)
        assert out is not None, "taken where silu_mul applies (`_trained_product`)"
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors  # type: ignore[attr-defined]
        kernel = backward_kernel()
        assert kernel is not None, "taken where the backward loop was built"
        width = gate.shape[-1]
        (grad, grad_stride), (gate, gate_stride), (up, up_stride) = map(_rows, (grad, gate, up))
        grad_gate = torch.empty(gate.shape, dtype=torch.bfloat16)
        grad_up = torch.empty(up.shape, dtype=torch.bfloat16)
        kernel(
            grad.data_ptr(), grad_stride, gate.data_ptr(), gate_stride, up.data_ptr(),
            up_stride, gate.numel() // width, width, grad_gate.data_ptr(), grad_up.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return grad_gate, grad_up


def _trained_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """`silu(gate) * up` by the loops where autograd records it (bf16 CPU tensors of one
    shape); None elsewhere."""
    if gate.shape != up.shape or gate.numel() == 0:
        return None
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in (gate, up)):
        return None
    if native_kernel() is None or backward_kernel() is None:
        return None
    product: torch.Tensor = _SiluMul.apply(gate, up)
    return product


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    # gate before up, with the same x: sibling layers serve both from one matmul (fused.py).
    gate = self.gate_proj(x)
    up = self.up_proj(x)
    product = None
    if gate.numel() >= MIN_ELEMENTS:
        recorded = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
        product = _trained_product(gate, up) if recorded else silu_mul(gate, up)
    if product is None:  # what the module's own forward computes (`_agrees`)
        product = self.act_fn(gate) * up
    return self.down_proj(product)


@functools.cache
def _silu_types() -> tuple[type, ...]:
    """The activation classes that compute silu: torch's and transformers' (ACT2FN["silu"])."""
    try:
        from transformers.activations import ACT2FN
    except ImportError:
        return (nn.SiLU,)
    return (nn.SiLU, type(ACT2FN["silu"]))


def _weight(module: nn.Module) -> torch.Tensor | None:
    """A projection's weight (an nn.Linear's, or the base's of a LoRA-adapted one)."""
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _gate_weight(module: nn.Module) -> torch.Tensor | None:
    """The gate projection's weight where the module is a gated MLP with a SiLU, at bf16 on
    a CPU (where the loop runs); else None."""
    projections = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not isinstance(getattr(module, "act_fn", None), _silu_types()):
        return None
    weights = [_weight(p) if isinstance(p, nn.Module) else None for p in projections]
    gate, up = weights[0], weights[1]
    if gate is None or up is None or weights[2] is None or gate.shape != up.shape:
        return None
    if gate.dtype != torch.bfloat16 or gate.device.type != "cpu":
        return None
    return gate


def _agrees(module: Any, gate_weight: torch.Tensor) -> bool:
    """Whether the module's own forward and `down_proj(silu(gate_proj(x)) * up_proj(x))`
    give the same bits on a probe input."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn((1, 3, gate_weight.shape[1]), generator=generator)
    probe = probe.to(gate_weight.device, gate_weight.dtype)
    with torch.no_grad():
        try:
            own = module(probe)
            gate = module.gate_proj(probe)
            reference = module.down_proj(torch.nn.functional.silu(gate) * module.up_proj(probe))
        except Exception:  # a module that takes other inputs is no gated MLP of this kind
            return False
        return isinstance(own, torch.Tensor) and bool(torch.equal(own, reference))


def _candidates(model: nn.Module) -> list[Any]:
    mlps: list[Any] = []
    for module in model.modules():
        if "forward" in vars(module):
            continue  # already switched, or a forward set by someone else: left alone
        gate_weight = _gate_weight(module)
        if gate_weight is not None and _agrees(module, gate_weight):
            mlps.append(module)
    return mlps


def install(model: nn.Module) -> int:
    """Point the model's gated SiLU MLPs at the loop in sampling steps; returns how many were
    switched (0 where none qualifies or the loop cannot be built here)."""
    mlps = _candidates(model)
    kernel = native_kernel() if mlps else None
    if kernel is None:
        return 0
    kernel(None, 0, None, 0, 0, 0, None, 1)  # no rows: fills the loop's table now, not in a step
    for module in mlps:
        module.forward = types.MethodType(_mlp_forward, module)
    log.info("%d gated MLPs take the native SiLU product in sampling steps", len(mlps))
    return len(mlps)


# transformers' gated MLP classes whose own forward is down_proj(act_fn(gate_proj(x)) *
# up_proj(x)), as `_mlp_forward` computes it below the loop's floor
_EAGER_CLASSES = {
    ("transformers.models.llama.modeling_llama", "LlamaMLP"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2MLP"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3MLP"),
}


def eager_silu(module: nn.Module) -> bool:
    """Whether an MLP left to its own forward computes `silu(gate) * up` as eager's two
    operations between its projections: one of transformers' classes above with a SiLU, its
    forward not replaced (an fp32 model's MLPs, which `install` does not switch)."""
    if "forward" in vars(module) or not isinstance(getattr(module, "act_fn", None), _silu_types()):
        return False
    return (type(module).__module__, type(module).__name__) in _EAGER_CLASSES


def switched(module: nn.Module) -> bool:
    """Whether `install` pointed this MLP at the loop."""
    return getattr(vars(module).get("forward"), "__func__", None) is _mlp_forward


def uninstall(model: nn.Module) -> int:
    """Back to every module's own forward; returns how many were switched back."""
    count = 0
    for module in model.modules():
        forward = vars(module).get("forward")
        if getattr(forward, "__func__", None) is _mlp_forward:
            del module.forward
            count += 1
    return count
