"""A CPU sampling step's decoder layers as one lean loop over the kernels the modules would call.

In a bf16 sampling step on a CPU every piece of a Llama-style decoder layer already runs one
native kernel: the norms (rms_norm.cpp), the LoRA columns (lora_columns_avx512.cpp), the fused
sibling matmuls (linear_avx512.cpp, or oneDNN on its packed weights), the rotary embedding
(rotary.cpp), the KV writes (kv_write.cpp), the decode attention (decode_attention_avx512.cpp)
and the SiLU product (silu_mul.cpp; eager's two operations below a few rows, as gated_mlp.py
does; the loop gives eager's bits, so the C++ loop calls it at any size). What is left
around them is Python: transformers' module calls, keyword plumbing and attention dispatch,
the LoRA layers' routing, the wrappers' checks and allocations, about 600 us a layer, 13 % of
a 128-row step of SmolLM2-135M on an AVX-512-BF16 EPYC. `run` makes the same calls, in the
same order, on the same inputs, with the checks made once per step: the same bits as the
modules' forward (tests/unit/engine/test_decode_layers.py).

`plan(model)` says whether a model's layers qualify, once per model: a bf16 or fp32 Llama, Qwen2 or
Qwen3 decoder (pre-norm residual blocks, a gated SiLU MLP, no sliding window; Qwen3's per-head
query and key norms) whose norms, MLPs (at bf16) and rotary function were switched to their native
forms, every projection a LoRA layer, no hooks, every kernel built. A step qualifies where
`Plan.weights` finds its one key's fused weights (fused.py) grouped as `run` computes them, or, for
a step of several keys, the shared base weights with every key's deltas (`Plan.segmented`: each
group's base output, then each key's delta added to its rows by the same calls as the modules make,
segments.py); a step without them runs the modules (model_runner.py). A step of decode rows alone
attends by the native kernel directly; a step with prompt chunks (or of one-slot rows) calls the
modules' attention function, `paged_attention_forward`, as they do.

An fp32 model (a CPU without bf16 units) gets a plan too, with the kernels' fp32 forms: the norms
(rms_norm_fp32), the rotary embedding (rotary_fp32), the KV writes, the fp32 decode attention
(decode_attention_avx2.cpp) and the fp32 linear kernel (linear_fp32.cpp) or oneDNN's packed fp32
weights (`TUNELOOP_NATIVE_LINEAR=0`); no LoRA columns (an fp32 lone copy merges its adapter) and
eager's SiLU product, as its MLPs (left to their own forward) compute it. There the modules' Python
was most of a few-row step: on a one-row step of SmolLM2-135M, ~20 of ~31 ms on an AVX-512-BF16
EPYC capped at AVX2 (docs/benchmarks.md).

A bf16 step of decode rows alone whose groups are all in the native linear kernel's layout
skips even this loop's Python: `native_layers.loop` gives its calls as one C++ call
(decode_layers.cpp), the same kernels in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from tuneloop.server.engine import (
    compiled,
    gated_mlp,
    native_layers,
    native_linear,
    packed,
    rotary,
)
from tuneloop.server.engine.kv import kv_write, native_decode
from tuneloop.server.engine.kv.paged_attention import PagedStep, paged_attention_forward
from tuneloop.server.engine.lora import native_columns
from tuneloop.server.engine.lora.fused import FusedLinear
from tuneloop.server.engine.lora.linear import LoRALinear
from tuneloop.server.engine.lora.native_columns import DownPairs
from tuneloop.server.engine.lora.routing import Routing
from tuneloop.server.engine.lora.segments import Segment, add
from tuneloop.server.engine.native_linear import NativeWeight

__all__ = ["LayerWeights", "Plan", "plan", "run"]

# The decoder layer classes whose forward `run` makes step for step: (module, class name).
_LAYERS = {
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3DecoderLayer"),
}
# Of those, the ones whose attention norms each head's queries and keys before the rotary
# embedding (and must: a Qwen3 attention without them is not the forward `run` makes).
_HEAD_NORMS = {"Qwen3DecoderLayer"}


@dataclass(frozen=True)
class _Layer:
    index: int  # the attention's layer_idx: its pools in the KV pool
    norm_in: torch.Tensor
    eps_in: float
    norm_post: torch.Tensor
    eps_post: float
    # Qwen3's per-head norms of the queries and keys (weight, eps each), or None
    head_norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None
    projections: tuple[LoRALinear, ...]  # q, k, v, o, gate, up, down
    attention: nn.Module  # (a step with prompt chunks calls its attention function with it)


@dataclass(frozen=True)
class LayerWeights:
    """A layer's fused groups for one key (q/k/v, o, gate/up, down) or, in a step of several
    keys, the shared base groups with each group's segments of keys' deltas (segments.py)."""

    qkv: FusedLinear
    o: FusedLinear
    gate_up: FusedLinear
    down: FusedLinear
    segments: tuple[list[Segment], list[Segment], list[Segment], list[Segment]] | None = None


@dataclass
class _Kernels:
    norm: Any
    columns: Any  # (None at fp32: no LoRA columns)
    rotate: Any
    write: Any
    silu: Any  # (None at fp32: eager's product)
    attend: Any
    linear: Any  # (None where the native linear kernel is not built: no NativeWeight then)


class Plan:
    """One model's decoder layers for `run`: their norms' weights, their projections (whose
    lone weights a step looks up), the attention's shape and the kernels."""

    def __init__(
        self,
        decoder: nn.Module,
        layers: list[_Layer],
        shape: tuple[int, int, int, int],
        scale: float,
        kernels: _Kernels,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.decoder, self.layers, self.kernels, self.dtype = decoder, layers, kernels, dtype
        self.heads, self.kv_heads, self.dim, self.intermediate = shape
        self.scale = scale
        self.native_loop: Any = None  # native_layers.Loop of the last weights it took

    def weights(self, lone: Mapping[int, tuple[FusedLinear, int]]) -> list[LayerWeights] | None:
        """The layers' groups in a lone table (`AdapterBank.lone_weights`; or the shared one,
        `shared_weights`, for `segmented`), or None where a layer's projections are not
        grouped as `run` computes them: q/k/v one group and gate/up another, in that order, o
        and down alone."""
        found: list[LayerWeights] = []
        inner = self.heads * self.dim, self.kv_heads * self.dim
        for layer in self.layers:
            entries = [lone.get(id(m)) for m in layer.projections]
            if any(e is None for e in entries):
                return None
            groups = [e[0] for e in entries if e is not None]
            indices = [e[1] for e in entries if e is not None]
            qkv, o, gate_up, down = groups[0], groups[3], groups[4], groups[6]
            if groups[1] is not qkv or groups[2] is not qkv or groups[5] is not gate_up:
                return None
            if indices != [0, 1, 2, 0, 0, 1, 0]:
                return None
            if qkv.sizes != [inner[0], inner[1], inner[1]] or len(o.sizes) != 1:
                return None
            if gate_up.sizes != [self.intermediate] * 2 or len(down.sizes) != 1:
                return None
            found.append(LayerWeights(qkv, o, gate_up, down))
        return found

    def segmented(self, shared: list[LayerWeights], routing: Routing) -> list[LayerWeights]:
        """The shared groups of `weights` with the segments of the routing's keys' deltas
        (`Routing.segments`): a step of several keys."""
        found = []
        for layer, w in zip(self.layers, shared, strict=True):
            p = layer.projections
            segments = (
                routing.segments(id(p[0])),
                routing.segments(id(p[3])),
                routing.segments(id(p[4])),
                routing.segments(id(p[6])),
            )
            found.append(replace(w, segments=segments))
        return found


def _direct(step: PagedStep, tokens: int) -> bool:
    """Whether a step's rows attend by the native kernel called here: decode rows alone, more
    than one slot wide (a step of one-slot rows keeps SDPA, paged_attention._reference);
    other steps call the modules' attention function."""
    if step.prefills or step.decoding != tokens or step.decode_slots.shape[1] < 2:
        return False
    return step.decode_kernel is native_decode.attend


def _hooked(module: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def plan(model: nn.Module) -> Plan | None:
    """The plan of `model`'s decoder layers, or None where they do not qualify (module
    docstring)."""
    get_decoder: Any = getattr(model, "get_decoder", None)
    decoder: Any = get_decoder() if callable(get_decoder) else None
    config: Any = getattr(model, "config", None)
    if decoder is None or config is None:
        return None
    parts = ("embed_tokens", "rotary_emb", "layers", "norm")
    if not all(hasattr(decoder, p) for p in parts) or _hooked(decoder):
        return None
    if len(decoder.layers) != config.num_hidden_layers or not len(decoder.layers):
        return None
    weight = next(model.parameters())
    dtype = weight.dtype
    if dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu":
        return None
    bf16 = dtype == torch.bfloat16
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or 0
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kernels = _Kernels(
        compiled.native_norm(dtype),
        native_columns.native_kernel() if bf16 else None,
        rotary.native_kernel(dtype),
        kv_write.native_kernel(),
        gated_mlp.native_kernel() if bf16 else None,
        native_decode.kernel_for(dtype),
        native_linear.kernel_for(dtype),
    )
    # (fp32: no LoRA columns, its lone copies merge their adapter; eager's SiLU product)
    optional = {"linear"} if bf16 else {"linear", "columns", "silu"}
    if any(k is None for name, k in vars(kernels).items() if name not in optional):
        return None
    if not native_decode.available(heads, kv_heads, dim, dim, weight.dtype, weight.device):
        return None
    layers: list[_Layer] = []
    scales: set[float] = set()
    intermediate = None
    for layer in decoder.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (type(layer).__module__, type(layer).__name__) not in _LAYERS:
            return None
        if attn is None or mlp is None or "forward" in vars(layer) or "forward" in vars(attn):
            return None
        if getattr(attn, "sliding_window", None):
            return None
        head_norms = None
        if type(layer).__name__ in _HEAD_NORMS:
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            if q_norm is None or k_norm is None:
                return None
            if not (compiled.switched(q_norm) and compiled.switched(k_norm)):
                return None
            head_norms = (
                (q_norm.weight, q_norm._tuneloop_eps),
                (k_norm.weight, k_norm._tuneloop_eps),
            )
        elif hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return None
        if type(attn).__module__ not in rotary.installed(dtype):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(compiled.switched(n) for n in norms):
            return None
        if not (gated_mlp.switched(mlp) if bf16 else gated_mlp.eager_silu(mlp)):
            return None
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        projections = (*(getattr(attn, n) for n in names),)
        projections += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if not all(isinstance(p, LoRALinear) for p in projections):
            return None
        if not isinstance(attn.scaling, float):
            return None
        scales.add(attn.scaling)
        intermediate = mlp.gate_proj.out_features
        layers.append(
            _Layer(
                int(attn.layer_idx),
                norms[0].weight,
                norms[0]._tuneloop_eps,
                norms[1].weight,
                norms[1]._tuneloop_eps,
                head_norms,
                projections,
                attn,
            )
        )
    if len(scales) != 1 or intermediate is None:
        return None
    shape = (heads, kv_heads, dim, intermediate)
    return Plan(decoder, layers, shape, scales.pop(), kernels, dtype)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _attend(
    plan: Plan,
    layer: int,
    q: torch.Tensor,  # [rows, heads, dim]
    k_new: torch.Tensor,  # [rows, kv_heads, dim]
    v_new: torch.Tensor,  # [rows, kv_heads, dim], rows strided
    step: PagedStep,
    slots: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """A decode step's new keys and values written to the layer's pools and its rows'
    attention, by the native kernels as paged_attention_forward calls them, [rows, heads,
    dim]."""
    k, threads, size = plan.kernels, torch.get_num_threads(), q.element_size()
    rows, heads, dim = q.shape
    row_bytes = k_new.shape[1] * dim * size
    k_pool, v_pool = step.pool.layer(layer, k_new, v_new)
    for pool, new in ((k_pool, k_new), (v_pool, v_new)):
        code = k.write(
            _ptr(pool), pool.shape[0], row_bytes, _ptr(new), new.stride(0) * size,
            _ptr(step.slot_mapping), rows, threads,
        )  # fmt: skip
        if code:
            raise ValueError("a KV write refused its slots")
    out = torch.empty((rows, heads, dim), dtype=q.dtype)
    code = k.attend(
        _ptr(q), _ptr(k_pool), _ptr(v_pool), _ptr(slots), _ptr(mask), rows, slots.shape[1],
        heads, k_new.shape[1], dim, dim, plan.scale, _ptr(out), threads,
    )  # fmt: skip
    if code:
        raise ValueError("the decode attention refused its shapes")
    return out


def run(
    plan: Plan,
    weights: list[LayerWeights],
    input_ids: torch.Tensor,  # [1, N]
    position_ids: torch.Tensor,  # [1, N]
    step: PagedStep,
) -> torch.Tensor:
    """The decoder's last hidden states [N, hidden] for a step whose layers' weights
    `plan.weights` found, inside the sampling step's blocks (the final norm's native form)."""
    k = plan.kernels
    threads = torch.get_num_threads()
    decoder: Any = plan.decoder
    hidden = decoder.embed_tokens(input_ids)
    cos, sin = decoder.rotary_emb(hidden, position_ids=position_ids)
    hidden = hidden[0]
    rows = hidden.shape[0]
    heads, kv_heads, dim, inter = plan.heads, plan.kv_heads, plan.dim, plan.intermediate
    q_width, kv_width = heads * dim, kv_heads * dim
    direct = _direct(step, rows)
    if direct:
        # the attention's inputs, checked once for the step as native_decode.attend checks
        # them for every layer
        slots = step.decode_slots.contiguous()
        mask = step.decode_mask.reshape(rows, -1).contiguous()
        low, high = torch.aminmax(slots)
        if int(low) < 0 or int(high) > step.pool.scratch_slot:  # (every layer's pools' size)
            raise ValueError("a decode row's slot lies outside the pool")  # never read past it
    if direct and (native := native_layers.loop(plan, weights)) is not None:
        hidden = hidden.contiguous()  # (the embedding's own rows: updated in place)
        native.run(hidden, cos, sin, step, slots, mask)
        return decoder.norm(hidden[None])[0]
    cos_stride = cos.stride(1)
    linear = torch.ops.mkldnn._linear_pointwise.default
    size = hidden.element_size()
    native_product = k.silu is not None and rows * inter >= gated_mlp.MIN_ELEMENTS

    def norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)  # (x [rows of the norm's width] contiguous)
        k.norm(_ptr(x), _ptr(w), x.shape[0], x.shape[1], eps, _ptr(out), threads)
        return out

    def project(
        x: torch.Tensor, group: FusedLinear, segments: list[Segment] | None
    ) -> torch.Tensor:
        plain, down = x, group.a
        if isinstance(down, torch.Tensor):  # (fused.py's packed down-projections: fp32 unmerged)
            x = torch.cat([x, packed.linear(x, down, None)], dim=1)
        elif isinstance(down, DownPairs):
            extended = torch.empty((rows, x.shape[1] + down.rank), dtype=x.dtype)
            code = k.columns(
                _ptr(x), x.stride(0), _ptr(down.pairs), rows, x.shape[1], down.rank,
                down.pairs.shape[1], _ptr(extended), threads,
            )  # fmt: skip
            if code:
                raise ValueError("the LoRA columns kernel refused its shapes")
            x = extended
        weight = group.weight
        if isinstance(weight, NativeWeight):  # (native_linear.linear's call, made here)
            y = torch.empty((rows, weight.out_features), dtype=x.dtype)
            bias = _ptr(weight.bias) if weight.bias is not None else None
            code = k.linear(
                _ptr(x), x.stride(0), rows, x.shape[1], _ptr(weight.blocks), bias,
                weight.out_features, _ptr(y), weight.out_features, threads,
                _ptr(weight.spans) if weight.spans is not None else None,
            )  # fmt: skip
            if code:
                raise ValueError("the native linear kernel refused its shapes")
        elif weight.is_mkldnn:
            y = linear(x, weight, group.bias, "none", [], "")
        else:
            y = functional.linear(x, weight, group.bias)
        return add(y, plain, segments) if segments else y  # (FusedLinear's sum, in its order)

    for layer, w in zip(plan.layers, weights, strict=True):
        segs = w.segments or (None, None, None, None)
        residual = hidden
        qkv = project(norm(hidden, layer.norm_in, layer.eps_in), w.qkv, segs[0])
        q_out = torch.empty((rows, heads, dim), dtype=hidden.dtype)
        k_out = torch.empty((rows, kv_heads, dim), dtype=hidden.dtype)
        if layer.head_norms is None:  # the rotary embedding reads q and k in qkv
            q_at, k_at = _ptr(qkv), _ptr(qkv) + q_width * size
            q_stride = k_stride = qkv.stride(0)
        else:  # each head's queries and keys normed first, as rows of the head size
            (q_w, q_eps), (k_w, k_eps) = layer.head_norms
            q_rows = qkv[:, :q_width].reshape(-1, dim).contiguous()
            k_rows = qkv[:, q_width : q_width + kv_width].reshape(-1, dim).contiguous()
            q_normed, k_normed = norm(q_rows, q_w, q_eps), norm(k_rows, k_w, k_eps)
            q_at, k_at, q_stride, k_stride = _ptr(q_normed), _ptr(k_normed), q_width, kv_width
        k.rotate(
            q_at, q_stride, dim, heads, k_at, k_stride, dim, kv_heads,
            _ptr(cos), _ptr(sin), cos_stride, rows, dim, _ptr(q_out), _ptr(k_out), threads,
        )  # fmt: skip
        v_new = qkv[:, q_width + kv_width :].view(rows, kv_heads, dim)
        if direct:
            attended = _attend(plan, layer.index, q_out, k_out, v_new, step, slots, mask)
        else:  # prompt chunks: the modules' attention function, its KV writes included
            query, key = q_out.transpose(0, 1)[None], k_out.transpose(0, 1)[None]
            value = v_new.transpose(0, 1)[None]
            out, _ = paged_attention_forward(
                layer.attention, query, key, value, None, scaling=plan.scale, paged_step=step
            )
            attended = out[0].reshape(rows, q_width).contiguous()
        hidden = residual + project(attended.view(rows, q_width), w.o, segs[1])
        residual = hidden
        gate_up = project(norm(hidden, layer.norm_post, layer.eps_post), w.gate_up, segs[2])
        if native_product:
            product = torch.empty((rows, inter), dtype=hidden.dtype)
            base = _ptr(gate_up)
            k.silu(
                base, gate_up.stride(0), base + inter * size, gate_up.stride(0), rows, inter,
                _ptr(product), threads,
            )  # fmt: skip
        else:  # the modules' eager product below the loop's floor (gated_mlp._mlp_forward)
            product = functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        hidden = residual + project(product, w.down, segs[3])
    return decoder.norm(hidden[None])[0]
