"""Training step A/B: one engine in-process, two variants of one piece, alternated step by step.

Runs forward_backward + optim_step of SmolLM2-135M (rank-32 LoRA on every linear layer and the
LM head, batches of 8 sequences of 64-256 tokens, as bench/engine.py) on one `TorchBackend`,
switching a single piece between its previous and current implementation before every step, so
that machine noise hits both alike. Prints the median step time of each, their ratio, the CPU
model and the load. `--profile` prints the top ops of one step of the current variant instead.

    python bench/train_variants.py --variant attention [--steps 6] [--dtype bfloat16]
    python bench/train_variants.py --variant attention-kernel  # short sequences' matmul kernel
    python bench/train_variants.py --variant attention-bound --lengths 300,580 --warm
                                                    # the matmul kernel's length bound
    python bench/train_variants.py --variant adamw
    python bench/train_variants.py --variant head       # the LM head fused over vocabulary tiles
    python bench/train_variants.py --variant lora-add   # LoRA deltas added by addmm
    python bench/train_variants.py --variant head-exp   # the head's exponentials by exp2
    python bench/train_variants.py --variant score-products  # bf16 units for fp32 scores
    python bench/train_variants.py --variant lora-node  # one adapter's layer as one node
    python bench/train_variants.py --variant exact-delta  # bf16 deltas rounded with the base
    python bench/train_variants.py --variant buckets  # packed and attention lengths bucketed
    python bench/train_variants.py --variant siblings  # q/k/v and gate/up as one node a group
    python bench/train_variants.py --variant silu-product  # the MLP's SiLU product by C++ loops
    python bench/train_variants.py --variant mlp-product  # that and the siblings' outputs as views
    python bench/train_variants.py --variant head-tiles  # the head tiles' element-wise work in C++
    python bench/train_variants.py --variant rotary  # the rotary embedding's backward in C++
    python bench/train_variants.py --variant head-join  # the head's joined inputs once a chunk
    python bench/train_variants.py --variant attention-tiles  # attention in C++ (AVX512-BF16)
    python bench/train_variants.py --variant parts  # a micro-batch as two parts on two threads
    python bench/train_variants.py --variant fp32-onednn --dtype float32  # frozen weights'
                                                    # products by oneDNN, not MKL's sgemm
    python bench/train_variants.py --variant lora-grads  # the LoRA factors' gradients in C++
    python bench/train_variants.py --variant native-summed  # frozen-weight products natively
    python bench/train_variants.py --variant live-rows --prompt-share 0.5  # the head's backward
                                                    # without the rows of no gradient
    python bench/train_variants.py --variant norm   # RMSNorms by C++ loops, not compiled
    python bench/train_variants.py --profile
    python bench/train_variants.py --micro          # each piece alone, 422 AdamW tensors, the head,
                                                    # one layer's packed attention fwd+bwd and
                                                    # one layer's seven adapted linears fwd+bwd

`--variant head` compares the head module's output followed by the log-softmax over position
chunks (previous) with the head fused over vocabulary tiles (fused_head.py); `--variant
lora-add` the LoRA delta added as its own pass with addmm into the base output.
`--variant adamw` compares torch's single-tensor AdamW (previous) with foreach=True (current);
the engine keeps single-tensor, as the numbers in docs/benchmarks.md say why.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from engine import (
    BETAS,
    EPS,
    LR,
    RANK,
    SEED,
    adapted_backend,
    cpu_model,
    cross_entropy_pass,
    make_batches,
)


def _split_free_sdpa(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
    """The packed attention as it was: per-sequence slices of q/k/v (zero-filled gradients)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tuneloop.server.engine import packing

    lengths = getattr(packing._state, "lengths", None)
    if lengths is None or query.shape[2] != sum(lengths) or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, mask, **kw)
    pieces, start = [], 0
    for length in lengths:
        end = start + length
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            None,
            **{**kw, "is_causal": True},
        )
        pieces.append(out)
        start = end
    return torch.cat(pieces, dim=1), None


@contextmanager
def _attention(previous: bool) -> Iterator[None]:
    from transformers import AttentionInterface

    from tuneloop.server.engine import packing

    if previous:
        AttentionInterface.register(packing.PACKED_ATTENTION, _split_free_sdpa)
    try:
        yield
    finally:
        AttentionInterface.register(packing.PACKED_ATTENTION, packing._packed_sdpa)


@contextmanager
def _swapped(owner: Any, name: str, previous: Any | None) -> Iterator[None]:
    """`owner.name` replaced by `previous` (None: left as it is) until the block ends."""
    current = getattr(owner, name)
    if previous is not None:
        setattr(owner, name, previous)
    try:
        yield
    finally:
        setattr(owner, name, current)


def _attention_kernel(previous: bool) -> Any:
    """previous: torch's CPU flash kernel (fp32 backward) for every sequence; current: the
    matmul kernel for sequences up to MATMUL_MAX_TOKENS tokens (causal_cpu.py)."""
    from tuneloop.server.engine import causal_cpu

    return _swapped(causal_cpu, "MATMUL_MAX_TOKENS", 0 if previous else None)


# The matmul kernel's length bound before RL-length sequences were measured: 4 x SmolLM2's
# head size.
_PREVIOUS_BOUND = 256


def _attention_bound(previous: bool) -> Any:
    """previous: the matmul kernel for sequences up to 256 tokens (flash beyond); current: up
    to causal_cpu.MATMUL_MAX_TOKENS (or `--matmul-bound`)."""
    from tuneloop.server.engine import causal_cpu

    return _swapped(causal_cpu, "MATMUL_MAX_TOKENS", _PREVIOUS_BOUND if previous else None)


def _head_exp(previous: bool) -> Any:
    """previous: the head's softmax exponentials by torch.exp; current: by exp2 (fused_head.py)."""
    from tuneloop.server.engine import fused_head

    def exp_minus(z: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return torch.exp(z - row[:, None])

    return _swapped(fused_head, "_exp_minus", exp_minus if previous else None)


@contextmanager
def _head(previous: bool) -> Iterator[None]:
    """previous: the head module's output, then the fused log-softmax over position chunks
    (checkpointed past LOGIT_ELEMENTS_UNCHUNKED); current: fused over vocabulary tiles."""
    from tuneloop.server.engine import fused_head, logprobs  # (the training pass's head)

    logprobs.head_parts = (lambda head, hidden: None) if previous else fused_head.head_parts
    try:
        yield
    finally:
        logprobs.head_parts = fused_head.head_parts


def _lora_add(previous: bool) -> Any:
    """previous: out + the LoRA delta as its own pass; current: addmm into the base output."""
    from tuneloop.server.engine.lora import ops

    def plus_delta(out: Any, x: Any, factors: Any, in_place: bool = False) -> Any:
        return out + ops._delta(x, factors, out.dtype)

    return _swapped(ops, "_plus_delta", plus_delta if previous else None)


def _siblings(previous: bool) -> Any:
    """previous: each adapted linear its own node; current: q/k/v and gate/up one node a group
    (lora/siblings.py)."""
    from tuneloop.server.engine.lora import siblings

    return _swapped(siblings, "_GROUPED", False if previous else None)


def _lora_grads(previous: bool) -> Any:
    """previous: the LoRA factors' gradients dA = dlow^T @ x, dB = dy^T @ low by torch
    (oneDNN); current: by the C++ kernel on CPUs with AVX512-BF16 and no AMX
    (lora/native_grads.py)."""
    from tuneloop.server.engine.lora import native_grads

    return _swapped(native_grads, "_NATIVE", False if previous else None)


def _native_summed(previous: bool) -> Any:
    """previous: the adapted layers' products by frozen weights by torch (oneDNN): the
    exact-delta forward's joined [x | low] @ [W | B], the input gradient's chain of matmuls;
    current: by the native kernel's entry of several operands on CPUs with AVX512-BF16 (on AMX
    CPUs its tile form, where every operand is whole tile steps wide), W and W^T packed once
    (lora/native_summed.py)."""
    from tuneloop.server.engine.lora import native_summed

    return _swapped(native_summed, "_NATIVE", False if previous else None)


def _norm(previous: bool) -> Any:
    """previous: a training pass's RMSNorms by the compiled kernel (inductor's forward and
    backward, dynamo's guards around each call); current: by rms_norm.cpp's loops as one
    autograd node (compiled.py's `_NativeNorm`)."""
    from tuneloop.server.engine import compiled

    return _swapped(compiled, "_NATIVE_TRAINING", False if previous else None)


@contextmanager
def _fp32_onednn(previous: bool) -> Iterator[None]:
    """previous: fp32 products by frozen weights by torch's matmul (MKL's sgemm); current: by
    oneDNN, forced (cpu_fp32_matmul.py; the engine measures which to take)."""
    from tuneloop.server.engine import cpu_fp32_matmul

    cpu_fp32_matmul.choose(not previous)
    try:
        yield
    finally:
        cpu_fp32_matmul.choose(None)


def _silu_product(previous: bool) -> Any:
    """previous: the MLP's silu(gate) * up by eager torch in training; current: the loops'
    forward and backward (gated_mlp.py)."""
    from tuneloop.server.engine import gated_mlp

    def eager(gate: torch.Tensor, up: torch.Tensor) -> None:
        return None

    return _swapped(gated_mlp, "_trained_product", eager if previous else None)


@contextmanager
def _mlp_product(previous: bool) -> Iterator[None]:
    """previous: each sibling's output copied out of the group's (lora/siblings.py), then the
    MLP's silu(gate) * up by eager torch; current: the outputs as views, the product and its
    backward by the loops reading their strides (gated_mlp.py)."""
    from tuneloop.server.engine.lora import siblings

    with _swapped(siblings, "_COPIED_OUTPUTS", True if previous else None), _silu_product(previous):
        yield


def _head_tiles(previous: bool) -> Any:
    """previous: the head tiles' statistics and gradients by torch's fp32 passes; current: by
    the C++ loops at the tiles' width (native_head.py)."""
    from tuneloop.server.engine import native_head

    def never(raw: torch.Tensor, softcap: float | None) -> bool:
        return False

    return _swapped(native_head, "takes", never if previous else None)


def _rotary(previous: bool) -> Any:
    """previous: the family's own rotary embedding in training (eager's eight operations and
    their backward); current: one node of the C++ loops (rotary.py)."""
    from tuneloop.server.engine import rotary

    def own(q: Any, k: Any, cos: Any, sin: Any) -> None:
        return None

    return _swapped(rotary, "_trained", own if previous else None)


def _attention_tiles(previous: bool) -> Any:
    """previous: short sequences' attention by causal_cpu.py's torch matmul kernel; current:
    in C++ (native_attention.py), where the CPU has AVX512-BF16: the products on the AMX tile
    unit where it has one, else on the vector unit."""
    from tuneloop.server.engine import native_attention

    def never(*args: Any) -> bool:
        return False

    return _swapped(native_attention, "takes", never if previous else None)


def _parts(previous: bool) -> Any:
    """previous: a micro-batch one pass on all threads; current: on a CPU, two parts of its
    rows on two threads at once, half the threads each (training.split)."""
    from tuneloop.server.engine import training

    return _swapped(training, "_SPLIT", False if previous else None)


@contextmanager
def _head_join(previous: bool) -> Iterator[None]:
    """previous: the head's tiles row piece by row piece, each tile copying [x | low] and
    [W | B] for its one matmul; current: vocabulary chunk by chunk, [x | low] joined once a
    pass and [W | B] once a chunk (fused_head._Joined), the same bits."""
    from tuneloop.server.engine import fused_head

    def by_rows(rows: int, vocab: int, device: torch.device) -> Iterator[tuple[int, ...]]:
        for r0 in range(0, rows, fused_head.ROWS):
            for v0 in range(0, vocab, fused_head.COLUMNS):
                r1 = min(rows, r0 + fused_head.ROWS)
                yield r0, r1, v0, min(vocab, v0 + fused_head.COLUMNS)

    with (
        _swapped(fused_head, "_tiles", by_rows if previous else None),
        _swapped(fused_head, "_Joined", (lambda *a: None) if previous else None),
    ):
        yield


def _score_products(previous: bool) -> Any:
    """previous: the matmul kernel's fp32 scores by fp32 matmuls; current: the same fp32
    matmuls on oneDNN's bf16 units, exact for bf16 inputs (causal_cpu.py)."""
    from tuneloop.server.engine import causal_cpu

    @contextmanager
    def fp32_units(dtype: torch.dtype) -> Iterator[None]:
        yield

    return _swapped(causal_cpu, "_exact_bf16_products", fp32_units if previous else None)


def _lora_node(previous: bool) -> Any:
    """previous: the base layer, then add_lora's delta (four autograd nodes and a sum of two
    input gradients); current: one node for base and delta (lora/ops.py `one_adapter_linear`)."""
    from tuneloop.server.engine.lora.linear import LoRALinear

    def two_nodes(self: Any, x: Any, routing: Any) -> None:
        return None

    return _swapped(LoRALinear, "_one_adapter", two_nodes if previous else None)


@contextmanager
def _buckets(previous: bool) -> Iterator[None]:
    """previous: the packed row and each sequence's attention at their own lengths; current:
    padded to shape buckets (packing.bucketed, causal_cpu.LENGTH_GRANULE), so that oneDNN's
    kernels built for earlier steps' shapes serve later ones. Every step here is a new batch,
    as in training: the previous variant meets new matmul shapes at almost every step. In one
    process its new kernels and fragmented heap slow the current variant's steps as well (40
    pairs read 1.015x): bench/train_long.py runs each variant in a process of its own."""
    from tuneloop.server.engine import causal_cpu, packing

    with (
        _swapped(packing, "BUCKETS_PER_OCTAVE", 0 if previous else None),
        _swapped(causal_cpu, "LENGTH_GRANULE", 1 if previous else None),
    ):
        yield


class _HeadBackwardTime:
    """The CPU time of the fused head's backward passes (every part's thread), charged to the
    variant whose step runs: a piece's own time beside the whole steps' wall time, which a
    noisy machine moves by more than a piece of a few percent."""

    def __init__(self) -> None:
        from tuneloop.server.engine import fused_head

        self.seconds: dict[str, float] = collections.defaultdict(float)
        self._name: str | None = None
        real = fused_head._FusedHead.backward

        def timed(ctx: Any, grad: Any) -> Any:
            begin = time.thread_time()
            try:
                return real(ctx, grad)
            finally:
                if self._name is not None:
                    self.seconds[self._name] += time.thread_time() - begin

        fused_head._FusedHead.backward = staticmethod(timed)  # type: ignore[method-assign]

    @contextmanager
    def charged_to(self, name: str) -> Iterator[None]:
        self._name = name
        try:
            yield
        finally:
            self._name = None


@contextmanager
def _live_rows(previous: bool) -> Iterator[None]:
    """previous: the head's backward pass over every row; current: only the rows whose
    logprobs have a gradient (fused_head._live_runs: a masked prompt's and a bucket's padding
    rows left out)."""
    from tuneloop.server.engine import fused_head

    with _swapped(fused_head, "_live_runs", (lambda g, device: None) if previous else None):
        yield


@contextmanager
def _exact_delta(previous: bool) -> Iterator[None]:
    """previous: the one-adapter node and the head's tiles add the delta to their rounded bf16
    output (`addmm_`); current: the delta in extra columns of one matmul, rounded once with the
    base (lora/ops.py `_EXACT_DELTA`, fused_head.py `HeadParts.exact_delta`)."""
    from tuneloop.server.engine import fused_head, logprobs  # (the training pass's head)
    from tuneloop.server.engine.lora import ops

    made = fused_head.head_parts

    def rounded(*args: Any) -> Any:
        parts = made(*args)
        if parts is not None:
            parts.exact_delta = False
        return parts

    ops._EXACT_DELTA = not previous
    logprobs.head_parts = rounded if previous else made  # type: ignore[assignment]
    try:
        yield
    finally:
        ops._EXACT_DELTA = True
        logprobs.head_parts = made  # type: ignore[assignment]


@contextmanager
def _adamw(previous: bool, backend: Any) -> Iterator[None]:
    adamw = backend._adapters["a"].optimizer._adamw
    keep = [dict(g) for g in adamw.param_groups]
    for group in adamw.param_groups:
        group["foreach"] = not previous  # previous: single-tensor; current: the foreach candidate
    try:
        yield
    finally:
        for group, old in zip(adamw.param_groups, keep, strict=True):
            group["foreach"] = old["foreach"]


def _micro_attention(repeats: int) -> str:
    """One layer's packed attention (SmolLM2: 9 query heads, 3 KV heads, dim 64) fwd+bwd:
    per-slice SDPA, causal_cpu.py's torch kernel and the C++ kernel's (its products on the
    tile unit where the CPU has AMX, else on the vector unit)."""
    from types import SimpleNamespace

    from tuneloop.server.engine import packing

    lengths = [int(n) for n in np.random.default_rng(SEED).integers(64, 257, 8)]
    total = sum(lengths)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)

    def once(fn: Callable[..., Any]) -> float:
        q, k, v = (
            torch.randn(1, h, total, 64, dtype=torch.bfloat16, requires_grad=True)
            for h in (9, 3, 3)
        )
        begin = time.perf_counter()
        with packing.packed_segments(lengths):
            out, _ = fn(module, q, k, v, None, dropout=0.0, scaling=0.125)
            out.float().sum().backward()
        return time.perf_counter() - begin

    # slices: SDPA per slice; split: causal_cpu's torch kernel per sequence; tiles: the C++
    # kernel, all sequences in one call (where the CPU has AVX512-BF16; else the torch kernel)
    names = ("slices", "split", "tiles")
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            fn = _split_free_sdpa if name == "slices" else packing._packed_sdpa
            with _attention_tiles(name != "tiles"):
                times[name].append(once(fn))
    a, b, c = (statistics.median(times[k]) * 1e3 for k in names)
    return (
        f"attention fwd+bwd over {total} tokens: slices {a:.1f} ms, split {b:.1f} ms, {a / b:.2f}x;"
        f" tiles {c:.1f} ms, {b / c:.2f}x the split"
    )


def _micro_lora_node(repeats: int) -> str:
    """One SmolLM2 decoder layer's seven rank-32 adapted linears (q, k, v from one input, o,
    gate, up, down; 1,408 tokens, bf16) forward + backward: the base layer followed by
    `_plus_delta`'s delta (autograd's four nodes) against `one_adapter_linear`'s one node, and
    q/k/v and gate/up each one node (`siblings.sibling_linears`)."""
    from tuneloop.server.engine.lora import ops, siblings

    functional = torch.nn.functional
    rows, bf16, scale = 1408, torch.bfloat16, 2.0
    sizes = {"q": (576, 576), "k": (576, 192), "v": (576, 192), "o": (576, 576)}
    sizes |= {"gate": (576, 1536), "up": (576, 1536), "down": (1536, 576)}
    gen = torch.Generator().manual_seed(SEED)
    weights = {n: (torch.randn(o, i, generator=gen) * 0.02).to(bf16) for n, (i, o) in sizes.items()}
    masters = {
        n: [(torch.randn(shape, generator=gen) * 0.02).requires_grad_() for shape in pair]
        for n, (i, o) in sizes.items()
        for pair in [((RANK, i), (o, RANK))]
    }
    x0 = torch.randn(rows, 576, generator=gen).to(bf16)

    def factors(name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        a, b = (m.to(bf16) for m in masters[name])
        return a, b, scale

    def two_nodes(names: list[str], x: torch.Tensor) -> list[torch.Tensor]:
        return [ops._plus_delta(functional.linear(x, weights[n]), x, factors(n)) for n in names]

    def one_node(names: list[str], x: torch.Tensor) -> list[torch.Tensor]:
        return [ops.one_adapter_linear(x, weights[n], None, factors(n)) for n in names]

    def grouped(names: list[str], x: torch.Tensor) -> list[torch.Tensor]:
        if len(names) == 1:
            return one_node(names, x)
        found = [factors(n) for n in names]
        return list(siblings.sibling_linears(x, [weights[n] for n in names], found))

    def layer(linears: Callable[[list[str], torch.Tensor], list[torch.Tensor]]) -> float:
        for pair in masters.values():
            for m in pair:
                m.grad = None
        x = x0.clone().requires_grad_()
        begin = time.perf_counter()
        q, k, v = linears(["q", "k", "v"], x)
        h = linears(["o"], q)[0] + x
        gate, up = linears(["gate", "up"], h)
        out = linears(["down"], functional.silu(gate) * up)[0] + h
        (out.float().sum() + k.float().sum() + v.float().sum()).backward()
        return time.perf_counter() - begin

    def one_node_rounded(names: list[str], x: torch.Tensor) -> list[torch.Tensor]:
        ops._EXACT_DELTA = False
        try:
            return one_node(names, x)
        finally:
            ops._EXACT_DELTA = True

    ways = {
        "four nodes": two_nodes,
        "one node": one_node,
        "one node, addmm_": one_node_rounded,
        "siblings": grouped,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(repeats):
        for name in list(ways) if i % 2 == 0 else list(reversed(ways)):
            times[name].append(layer(ways[name]))
    a, b, c, d = (statistics.median(times[k]) * 1e3 for k in ways)
    return (
        f"one layer's seven adapted linears fwd+bwd, {rows} tokens: base + delta {a:.1f} ms, "
        f"one node (delta in extra columns) {b:.1f} ms, {a / b:.2f}x; one node adding the "
        f"delta by addmm_ {c:.1f} ms, {a / c:.2f}x; q/k/v and gate/up one node a group "
        f"{d:.1f} ms, {b / d:.2f}x the one node"
    )


def _micro_head(repeats: int) -> str:
    """The fused LM head's forward and backward at a training step's shapes (1,233 tokens,
    SmolLM2's 49,152 x 576 bf16 head, one rank-32 adapter), its tiles by row pieces with
    per-tile copies (previous) against by vocabulary chunks with joined inputs (current)."""
    from tuneloop.server.engine import fused_head
    from tuneloop.server.engine.fused_head import HeadParts, Segment

    gen = torch.Generator().manual_seed(SEED)
    rows, width, vocab = 1233, 576, 49152
    weight = (torch.randn(vocab, width, generator=gen) * 0.05).bfloat16()
    hidden = torch.randn(rows, width, generator=gen).bfloat16().requires_grad_()
    low = torch.randn(rows, RANK, generator=gen).bfloat16().requires_grad_()
    b = (torch.randn(vocab, RANK, generator=gen) * 0.01).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (rows, 1), generator=gen)

    def once() -> tuple[float, float]:
        parts = HeadParts(weight, None, [Segment(0, rows, low, b)])
        begin = time.perf_counter()
        out = fused_head.fused_target_logprobs(parts, hidden, targets, None)
        middle = time.perf_counter()
        out.sum().backward()
        return middle - begin, time.perf_counter() - middle

    times: dict[str, list[tuple[float, float]]] = {"previous": [], "current": []}
    for i in range(repeats + 1):
        for name in ("previous", "current") if i % 2 == 0 else ("current", "previous"):
            with _head_join(name == "previous"):
                took = once()
            if i:  # the first pair builds oneDNN's kernels
                times[name].append(took)
    (pf, pb), (cf, cb) = (
        tuple(statistics.median(t[j] for t in times[k]) * 1e3 for j in (0, 1))
        for k in ("previous", "current")
    )
    return (
        f"head over {rows} tokens: forward {pf:.1f} -> {cf:.1f} ms, backward {pb:.1f} -> "
        f"{cb:.1f} ms, forward + backward {(pf + pb) / (cf + cb):.3f}x"
    )


def _micro_adamw(repeats: int) -> str:
    """AdapterOptimizer.step over SmolLM2's 422 rank-32 LoRA tensors, single vs foreach."""
    from tuneloop.server.engine.optim import AdapterOptimizer
    from tuneloop.server.engine.types import AdamStep

    hidden, inter, kv, vocab = 576, 1536, 192, 49152
    shapes: list[tuple[int, int]] = []
    for _ in range(30):
        for fan_in, fan_out in [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)]:
            shapes += [(RANK, fan_in), (fan_out, RANK)]
        for fan_in, fan_out in [(hidden, inter), (hidden, inter), (inter, hidden)]:
            shapes += [(RANK, fan_in), (fan_out, RANK)]
    shapes += [(RANK, hidden), (vocab, RANK)]
    step = AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.01, 1.0)
    params, optims = {}, {}
    for name in ("single", "foreach"):
        gen = torch.Generator().manual_seed(SEED)
        params[name] = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.01) for s in shapes]
        optims[name] = AdapterOptimizer(params[name])
        for group in optims[name]._adamw.param_groups:
            group["foreach"] = name == "foreach"
    times: dict[str, list[float]] = {"single": [], "foreach": []}
    for i in range(repeats):
        for name in ("single", "foreach") if i % 2 == 0 else ("foreach", "single"):
            gen = torch.Generator().manual_seed(SEED + 1 + i)
            for p in params[name]:
                p.grad = torch.randn(p.shape, generator=gen) * 1e-3
            begin = time.perf_counter()
            optims[name].step(step)
            times[name].append(time.perf_counter() - begin)
    same = all(torch.equal(a, b) for a, b in zip(params["single"], params["foreach"], strict=True))
    a, b = (statistics.median(times[k]) * 1e3 for k in ("single", "foreach"))
    return (
        f"AdamW step over {len(shapes)} tensors: single {a:.1f} ms, foreach {b:.1f} ms, "
        f"{a / b:.2f}x, bit-equal {same}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--variant",
        choices=[
            "attention",
            "attention-kernel",
            "attention-bound",
            "adamw",
            "head",
            "head-exp",
            "lora-add",
            "score-products",
            "lora-node",
            "exact-delta",
            "buckets",
            "siblings",
            "silu-product",
            "mlp-product",
            "head-tiles",
            "rotary",
            "head-join",
            "attention-tiles",
            "parts",
            "fp32-onednn",
            "lora-grads",
            "native-summed",
            "norm",
            "live-rows",
        ],
        default="attention",
    )
    parser.add_argument(
        "--prompt-share",
        type=float,
        default=0.0,
        help="the first share of each row's targets weighted 0 (a masked prompt)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--warm", action="store_true", help="run every timed batch once, untimed, before timing"
    )
    parser.add_argument(
        "--lengths", default="64,256", help="the batches' sequence lengths: min,max tokens"
    )
    parser.add_argument(
        "--matmul-bound",
        type=int,
        default=None,
        help="the matmul kernel's length bound in tokens for this run (causal_cpu.py)",
    )
    parser.add_argument("--micro", action="store_true")
    parser.add_argument("--micro-repeats", type=int, default=20, help="--micro: layer passes")
    parser.add_argument(
        "--shapes",
        default="aten::fill_,aten::bmm",
        help="with --profile: the ops whose calls are listed by input shape (comma-separated)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.micro:
        print(f"cpu: {cpu_model()}  threads {args.threads}  load {os.getloadavg()}")
        print(_micro_attention(30))
        print(_micro_adamw(12))
        print(_micro_head(12))
        print(_micro_lora_node(args.micro_repeats))
        print("load:", os.getloadavg())
        return 0

    from tuneloop.server.engine import causal_cpu
    from tuneloop.server.engine import types as t

    if args.matmul_bound is not None:
        causal_cpu.MATMUL_MAX_TOKENS = args.matmul_bound
    backend = adapted_backend(getattr(torch, args.dtype))
    step = t.AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.0, 0.0)
    stream = list(np.random.default_rng(SEED).integers(100, 40000, 200_000))
    low, high = (int(n) for n in args.lengths.split(","))
    batches = make_batches(stream, args.steps + 2, 8, low, high)

    def train_step(rows: list[list[int]]) -> None:
        cross_entropy_pass(backend, rows, prompt_share=args.prompt_share)
        backend.optim_step("a", step)

    train_step(batches[0])  # warm-up (AdamW state, first-call costs)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            train_step(batches[1])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        # where the listed ops come from (zero fills, batched matmuls...): their shapes name them
        events = prof.key_averages(group_by_input_shape=True)
        picked = [e for e in events if e.key in args.shapes.split(",")]
        for event in sorted(picked, key=lambda e: -e.self_cpu_time_total)[:20]:
            ms = event.self_cpu_time_total / 1e3
            print(f"{event.key} {event.input_shapes} x{event.count}: {ms:.0f} ms")
        return 0

    switches: dict[str, Callable[[bool], Any]] = {
        "attention": _attention,
        "attention-kernel": _attention_kernel,
        "attention-bound": _attention_bound,
        "adamw": lambda p: _adamw(p, backend),
        "head": _head,
        "head-exp": _head_exp,
        "lora-add": _lora_add,
        "score-products": _score_products,
        "lora-node": _lora_node,
        "exact-delta": _exact_delta,
        "buckets": _buckets,
        "siblings": _siblings,
        "silu-product": _silu_product,
        "mlp-product": _mlp_product,
        "head-tiles": _head_tiles,
        "rotary": _rotary,
        "head-join": _head_join,
        "attention-tiles": _attention_tiles,
        "parts": _parts,
        "fp32-onednn": _fp32_onednn,
        "lora-grads": _lora_grads,
        "native-summed": _native_summed,
        "norm": _norm,
        "live-rows": _live_rows,
    }
    switch = switches[args.variant]
    head_backward = _HeadBackwardTime()
    times: dict[str, list[float]] = {"previous": [], "current": []}
    for name in ("previous", "current"):  # each variant's first-call costs (e.g. norm's graphs)
        with switch(name == "previous"):
            train_step(batches[1])
    if args.warm:  # every timed batch once first: oneDNN builds its kernels for new shapes
        for rows in batches[2:]:
            train_step(rows)
    for i in range(args.steps):
        for name in ("previous", "current") if i % 2 == 0 else ("current", "previous"):
            rows = batches[2 + i]  # the same batch for both variants of a pair
            with switch(name == "previous"), head_backward.charged_to(name):
                begin = time.perf_counter()
                train_step(rows)
                times[name].append((time.perf_counter() - begin) / sum(len(r) for r in rows))
    prev, cur = (statistics.median(times[k]) * 1e3 for k in ("previous", "current"))
    print(
        f"cpu: {cpu_model()}  dtype {args.dtype}  threads {args.threads}  variant {args.variant}"
        f"  lengths {low}-{high}  matmul bound {causal_cpu.MATMUL_MAX_TOKENS} tokens"
    )
    print(f"ms/token: previous {prev:.3f}  current {cur:.3f}  speedup {prev / cur:.3f}x")
    spent = head_backward.seconds
    print(
        f"the head's backward pass, CPU seconds over the timed steps (both parts): previous"
        f" {spent['previous']:.2f}  current {spent['current']:.2f}"
    )
    for name, values in times.items():
        print(f"  {name} per step: " + " ".join(f"{v * 1e3:.2f}" for v in values))
    print("load:", os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
