"""A CPU sampling step's decoder layers as one C++ call: decode_layers.py's lean loop without the
Python between its kernels.

The lean loop (decode_layers.run) makes each layer's ~15 kernel calls from Python: ctypes
converts every call's arguments, torch allocates each output and makes the views, and the
residual sums dispatch through torch, ~300 us a layer in which the kernels' second thread
spins idle (about a sixth of a 128-row step of SmolLM2-135M on an AMX Xeon). Where a step is
decode rows alone on one key's fused weights, every group in the native linear kernel's
layout (native_linear.py), `decode_layers.cpp` makes the same calls in the same order on the
same inputs, the kernels passed to it by their addresses: the same bits (tests/unit/engine/
test_decode_layers.py). The loop is written once over the element type (`decode_layers.h`):
bf16 on CPUs with AVX512-BF16 (`decode_layers.cpp`), fp32 on CPUs with AVX2 and FMA
(`decode_layers_fp32.cpp`: an fp32 model's steps, on a lone copy that merged its adapter, its
SiLU product by gated_mlp.fp32_kernel, which gives eager's bits). Other steps (prompt chunks,
several keys, oneDNN's packed weights) keep the Python loop; `TUNELOOP_NATIVE_LAYERS=0` keeps
it for every step.

`loop(plan, weights)` builds the call's tables of pointers once for a set of weights (the
fused groups live as long as the adapter's snapshot) and keeps them on the plan; `Loop.run`
makes one step's call.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tuneloop.server.engine import gated_mlp, native
from tuneloop.server.engine.lora.native_columns import DownPairs
from tuneloop.server.engine.native_linear import NativeWeight

if TYPE_CHECKING:
    from tuneloop.server.engine.decode_layers import LayerWeights, Plan
    from tuneloop.server.engine.kv.paged_attention import PagedStep
    from tuneloop.server.engine.lora.fused import FusedLinear

__all__ = ["Loop", "enabled", "loop"]

# each width's source, its entry points' names and the CPU features it needs
_SOURCES = {
    torch.bfloat16: (
        Path(__file__).with_name("decode_layers.cpp"),
        ("decode_layers_bf16", "decode_layers_bf16_scratch"),
        ("avx512f", "avx512_bf16"),
    ),
    torch.float32: (
        Path(__file__).with_name("decode_layers_fp32.cpp"),
        ("decode_layers_fp32", "decode_layers_fp32_scratch"),
        ("avx2", "fma"),
    ),
}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_KERNELS = ("norm", "columns", "linear", "rotate", "write", "attend", "silu")


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _P) for name in _KERNELS]


class _Group(ctypes.Structure):
    _fields_ = [
        *((name, _P) for name in ("blocks", "bias", "spans", "pairs")),
        *((name, _I) for name in ("out", "rank", "rp")),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("norm_in", _P),
        ("norm_post", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("qkv", _Group),
        ("o", _Group),
        ("gate_up", _Group),
        ("down", _Group),
        ("eps_in", ctypes.c_float),
        ("eps_post", ctypes.c_float),
        ("q_eps", ctypes.c_float),
        ("k_eps", ctypes.c_float),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        *((name, _I) for name in ("rows", "hidden", "heads", "kv_heads", "dim", "inter")),
        ("width", _I),
        ("pool_rows", _I),
        ("scale", ctypes.c_float),
        ("threads", ctypes.c_int),
    ]


_REFUSED = {
    1: "the LoRA columns kernel refused its shapes",
    2: "the native linear kernel refused its shapes",
    3: "a KV write refused its slots",
    4: "the decode attention refused its shapes",
    5: "the native layer loop refused its shapes",
    6: "the SiLU product's kernel refused its shapes",
}


# decode_layers: kernels, layers, layer count, shape, hidden, cos, sin, cos stride, the new
# keys' slots, the rows' slots, mask, key pools, value pools, scratch, its size
_RUN = (
    ctypes.POINTER(_Kernels), ctypes.POINTER(_Layer), _I, ctypes.POINTER(_Shape), _P, _P, _P, _I,
    _P, _P, _P, ctypes.POINTER(_P), ctypes.POINTER(_P), _P, _I,
)  # fmt: skip
_SCRATCH = (ctypes.POINTER(_Layer), _I, ctypes.POINTER(_Shape))  # layers, count, shape


def _run_kernel(dtype: torch.dtype = torch.bfloat16) -> Any:
    """The loop over `dtype` (`_RUN`), or None where it cannot be built (or no loop takes
    that dtype)."""
    if dtype not in _SOURCES:
        return None
    source, (name, _), needs = _SOURCES[dtype]
    return native.function(source, name, _RUN, ctypes.c_int, needs)


def _scratch_kernel(dtype: torch.dtype = torch.bfloat16) -> Any:
    """Its scratch size function (`_SCRATCH`): a step's scratch size in elements."""
    source, (_, name), needs = _SOURCES[dtype]
    return native.function(source, name, _SCRATCH, _I, needs)


def _address(function: Any) -> int:
    return int(ctypes.cast(function, _P).value or 0)


def _group(group: FusedLinear, width: int) -> _Group | None:
    """A group's pointers where the loop takes it: the native linear's layout (its bias
    inside), LoRA columns for the native kernel or none, `width` inputs before them."""
    weight, down = group.weight, group.a
    if not isinstance(weight, NativeWeight) or group.bias is not None:
        return None
    if down is None:
        rank, pairs, rp = 0, None, 0
    elif isinstance(down, DownPairs) and down.in_features == width:
        rank, pairs, rp = down.rank, down.pairs.data_ptr(), down.pairs.shape[1]
    else:
        return None
    if weight.in_features != width + rank:
        return None
    bias = weight.bias.data_ptr() if weight.bias is not None else None
    spans = weight.spans.data_ptr() if weight.spans is not None else None
    return _Group(weight.blocks.data_ptr(), bias, spans, pairs, weight.out_features, rank, rp)


class Loop:
    """One set of weights' tables for `decode_layers.cpp`: the kernels' addresses and each
    layer's pointers. It refers to the groups weakly (the plan keeps the last Loop, and a
    deleted sampler's copy must not stay alive through it); `run` is called only with
    weights that `matches` found to be the same live groups, so the pointers are valid."""

    def __init__(
        self,
        plan: Plan,
        groups: list[tuple[FusedLinear, ...]],
        layers: Any,
        kernels: _Kernels,
        hidden: int,
    ) -> None:
        self.plan, self.layers, self.kernels, self.hidden = plan, layers, kernels, hidden
        self._groups = [tuple(weakref.ref(g) for g in four) for four in groups]
        self._like = torch.empty((0, plan.kv_heads, plan.dim), dtype=plan.dtype)

    def matches(self, weights: Sequence[LayerWeights]) -> bool:
        """Whether `weights` are the groups this loop's tables point into."""
        if len(weights) != len(self._groups):
            return False
        for w, held in zip(weights, self._groups, strict=True):
            if w.segments is not None:
                return False
            if w.qkv is not held[0]() or w.o is not held[1]():
                return False
            if w.gate_up is not held[2]() or w.down is not held[3]():
                return False
        return True

    def run(
        self,
        hidden: torch.Tensor,  # [rows, hidden] at the plan's dtype, contiguous: updated in place
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: PagedStep,
        slots: torch.Tensor,  # [rows, width] (checked against the pools by the caller)
        mask: torch.Tensor,  # [rows, width]
    ) -> None:
        """One step of decode rows alone through every layer."""
        plan, rows = self.plan, hidden.shape[0]
        call, size = _run_kernel(plan.dtype), _scratch_kernel(plan.dtype)
        assert call is not None, "a Loop exists only where the library was built"
        pools = [step.pool.layer(layer.index, self._like, self._like) for layer in plan.layers]
        pool_rows = pools[0][0].shape[0]
        if any(k.shape[0] != pool_rows or v.shape[0] != pool_rows for k, v in pools):
            raise ValueError("the layers' KV pools differ in size")
        shape = _Shape(
            rows, self.hidden, plan.heads, plan.kv_heads, plan.dim, plan.intermediate,
            slots.shape[1], pool_rows, plan.scale, torch.get_num_threads(),
        )  # fmt: skip
        n = len(pools)
        k_pools = (_P * n)(*(k.data_ptr() for k, _ in pools))
        v_pools = (_P * n)(*(v.data_ptr() for _, v in pools))
        elements = size(self.layers, n, ctypes.byref(shape))
        scratch = torch.empty(elements, dtype=plan.dtype)
        code = call(
            ctypes.byref(self.kernels), self.layers, n, ctypes.byref(shape), hidden.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), cos.stride(1), step.slot_mapping.data_ptr(),
            slots.data_ptr(), mask.data_ptr(), k_pools, v_pools, scratch.data_ptr(), elements,
        )  # fmt: skip
        if code:
            raise ValueError(_REFUSED.get(code, f"the native layer loop failed ({code})"))


def enabled(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether steps at `dtype` may take the loop: TUNELOOP_NATIVE_LAYERS is not 0 and it is
    built (at fp32 with the SiLU product's kernel that gives eager's bits)."""
    if os.environ.get("TUNELOOP_NATIVE_LAYERS", "1") == "0":
        return False
    if dtype == torch.float32 and gated_mlp.fp32_kernel() is None:
        return False
    return _run_kernel(dtype) is not None


def loop(plan: Plan, weights: Sequence[LayerWeights]) -> Loop | None:
    """The loop over `weights` (the plan's last one where they are the same groups), or None
    where a step on them keeps the Python loop: a group not in the native linear's layout
    (or, at fp32, with LoRA columns), several keys' segments, an fp32 model's intermediate
    width not a multiple of 16 (eager's SiLU computes a row's last few by another exp), the
    library or the linear kernel not built, or turned off."""
    if not enabled(plan.dtype) or plan.kernels.linear is None:
        return None
    if plan.dtype == torch.float32 and plan.intermediate % 16:
        return None
    held = plan.native_loop
    if isinstance(held, Loop) and held.matches(weights):
        return held
    if any(w.segments is not None for w in weights):
        return None
    hidden = plan.layers[0].norm_in.shape[0]
    q_width = plan.heads * plan.dim
    table = (_Layer * len(weights))()
    for slot, (layer, w) in zip(table, zip(plan.layers, weights, strict=True), strict=True):
        made = (
            _group(w.qkv, hidden),
            _group(w.o, q_width),
            _group(w.gate_up, hidden),
            _group(w.down, plan.intermediate),
        )
        if any(g is None for g in made):
            return None
        slot.qkv, slot.o, slot.gate_up, slot.down = made
        slot.norm_in, slot.norm_post = layer.norm_in.data_ptr(), layer.norm_post.data_ptr()
        slot.eps_in, slot.eps_post = layer.eps_in, layer.eps_post
        if layer.head_norms is not None:
            (q_w, q_eps), (k_w, k_eps) = layer.head_norms
            slot.q_norm, slot.k_norm = q_w.data_ptr(), k_w.data_ptr()
            slot.q_eps, slot.k_eps = q_eps, k_eps
    k = plan.kernels
    kernels = _Kernels(*(_address(getattr(k, name)) for name in _KERNELS))
    if plan.dtype == torch.float32:  # (eager's SiLU product in the Python loop: these bits)
        kernels.silu = _address(gated_mlp.fp32_kernel())
    groups: list[tuple[FusedLinear, ...]] = [(w.qkv, w.o, w.gate_up, w.down) for w in weights]
    found = Loop(plan, groups, table, kernels, hidden)
    plan.native_loop = found
    return found
