"""Attention over a paged KV pool, as a transformers attention function.

One sampling step runs every sequence's new tokens (decode tokens and prefill chunks alike) as
one packed row `[1, N]`. The model is the unmodified transformers model: inside `paged(model,
step)` its attention implementation is `PAGED_ATTENTION`, a function registered with
`AttentionInterface` that receives the step's `PagedStep` through the forward's keyword
arguments (transformers passes them down to every attention call). For each layer it writes the
new keys and values into the pool at the step's slots and attends each query token to its own
sequence's slots only, read through the sequence's block table. No mask is built by the model:
the name is not registered as a mask function, so transformers skips mask creation, as it does
for its own paged cache. Any decoder whose attention goes through `ALL_ATTENTION_FUNCTIONS`
(Llama, Qwen2/3, Mistral, SmolLM2, Gemma) works without per-architecture code.

Two implementations of the same step:
- the reference, plain torch (used on CPU and in tests): decode tokens attend in one batched
  SDPA over their slots gathered (per step, never stored) to the longest context of the step,
  or, where the step carries it, through the compiled CPU kernel that reads the pool by slot
  (decode_attention.py); each prefill chunk attends in its own SDPA with the causal offset of
  its cached past;
- on CUDA, when the optional `flash-attn` package is importable, its varlen kernel reads the
  pool through the block tables directly (`flash_attn_varlen_func(..., block_table=...)`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import AttentionInterface

from tuneloop.server.engine.kv import kv_write

__all__ = [
    "PAGED_ATTENTION",
    "KVPool",
    "PagedStep",
    "Prefill",
    "kernel_available",
    "paged",
]

log = logging.getLogger(__name__)

PAGED_ATTENTION = "tuneloop_paged"
# flash-attn's paged kernels need pages of a multiple of 256 tokens.
FLASH_BLOCK_SIZE = 256


class KVPool:
    """The keys and values of every block, per layer `[num_blocks * block_size, heads, dim]`.

    A layer's tensors are made at its first write, shaped like the keys it gets, so models
    whose layers differ in KV heads or head size need no description here. `torch.empty`: a
    block's slots are always written before they are read. One more slot, `pad_slot`, past the
    blocks, is zeros and never written: the padding of decode rows gathered to the step's
    longest context reads it, so that a masked position never reads stale memory (a NaN there
    would leak through the attention's 0 x NaN into another request's row). One more,
    `scratch_slot`, is written and never read: the pad rows of a decode step padded to a
    CUDA graph's bucket (decode_graphs.py) write their keys and values there.
    """

    def __init__(
        self, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device, self.dtype = device, dtype
        self.pad_slot = num_blocks * block_size
        self.scratch_slot = self.pad_slot + 1
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def layer(
        self, index: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s pools, shaped like its keys and its values (they may differ in head
        size: MLA's values are narrower than its keys)."""
        if index not in self.keys:
            for pools, like in ((self.keys, keys), (self.values, values)):
                pool = torch.empty(
                    (self.scratch_slot + 1, *like.shape[1:]), dtype=self.dtype, device=self.device
                )
                pool[self.pad_slot :] = 0  # the pad slot, and the scratch slot's first state
                pools[index] = pool
        return self.keys[index], self.values[index]

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each (source, target) block's slots, every layer, in one gather and one write
        per pool tensor: a step's copies-on-write (the samples of every prompt that joined
        with a partly filled last block) cost two operations per tensor instead of one per
        block and tensor. The targets must not be among the sources (copies-on-write go to
        fresh blocks), so the order of the pairs does not matter."""
        if not pairs:
            return
        sources, targets = (np.asarray(side, dtype=np.int64) for side in zip(*pairs, strict=True))
        if np.intersect1d(sources, targets).size:
            raise ValueError("a copied block's target is another copy's source")
        offsets = np.arange(self.block_size)

        def slots(blocks: np.ndarray) -> torch.Tensor:
            flat = (blocks[:, None] * self.block_size + offsets).reshape(-1)
            return torch.from_numpy(flat).to(self.device)

        src, dst = slots(sources), slots(targets)
        for tensors in (self.keys, self.values):
            for t in tensors.values():
                t.index_copy_(0, dst, t.index_select(0, src))

    def bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values()
        )


@dataclass
class Prefill:
    """A prefill chunk of the step: query tokens [start, start + length) of the packed row,
    attending to the first `context` slots of its sequence (its past plus the chunk)."""

    start: int
    length: int
    slots: torch.Tensor  # [context] long
    context: int


@dataclass
class PagedStep:
    """What every layer's attention needs to know about one step, built once per step.

    Token order in the packed row: the `decoding` one-token rows first, then the prefill chunks.
    """

    pool: KVPool
    slot_mapping: torch.Tensor  # [N] long: where each new token's key and value go
    decoding: int  # the first `decoding` tokens are decode rows, one token each
    decode_slots: torch.Tensor  # [decoding, longest context] long (padding: the pool's pad_slot)
    decode_mask: torch.Tensor  # [decoding, 1, 1, longest context] bool
    prefills: list[Prefill] = field(default_factory=list)
    # For the CUDA kernel: per sequence, in token order.
    flash: dict[str, Any] | None = None
    # The decode rows' attention compiled for the CPU (decode_attention.py), where installed.
    decode_kernel: Callable[..., torch.Tensor] | None = None


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    causal: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA, [B, heads, Tq, d] x [B, kv_heads, Tk, d] (grouped-query: SDPA's own GQA, no copy
    of the gathered keys per query head). `sinks` [heads]: a learned logit per head that joins
    every query's softmax with no value (gpt-oss's attention sinks)."""
    groups = q.shape[1] // k.shape[1]
    if softcap or sinks is not None:  # not expressible in SDPA: the eager form
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * scaling
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        scores = scores.float()
        if sinks is None:
            return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return torch.matmul(probs.to(q.dtype), v)
    if q.shape[2] == 1 and groups > 1 and not causal:
        # One query per row (decode): the query heads sharing a key head become that head's
        # `groups` queries, [B, kv_heads, groups, d]. The same sums over the same keys; the CPU
        # kernel's cost is per (row, head) pair, so a third of the pairs (SmolLM2) takes ~1.6x
        # less time than SDPA's own GQA (bench/cpu_kernels.py). Query head h reads key head
        # h // groups, as repeat_kv does.
        batch, heads, _, dim = q.shape
        folded = q.reshape(batch, k.shape[1], groups, dim)
        out = torch.nn.functional.scaled_dot_product_attention(
            folded, k, v, attn_mask=mask, scale=scaling
        )
        return out.reshape(batch, heads, 1, v.shape[-1])
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scaling, is_causal=causal, enable_gqa=groups > 1
    )


def _dense(t: torch.Tensor) -> torch.Tensor:
    """`t` with row-major strides, a size of 1 included: the compiled decode kernel guards on
    its inputs' strides, so any other layout (the queries head-major, as some models' rotary
    code leaves them; a single row's arbitrary outer stride) would compile it again."""
    if t.stride() == torch.empty(t.shape, device="meta").stride():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _window(mask: torch.Tensor, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Narrow a [.., Tq, Tk] mask to keys within `window` of each query position."""
    if not window:
        return mask
    keys = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (query_pos[..., :, None] - keys < window)


def _reference(
    query: torch.Tensor,
    step: PagedStep,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    scaling: float,
    softcap: float | None,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[1, heads, N, d] -> [N, heads, d]."""
    q = query[0]  # [heads, N, d]
    pieces = []
    d = step.decoding
    if d:
        mask = step.decode_mask
        if window:
            last = mask.sum(-1, keepdim=True).squeeze(-1) - 1  # [D, 1, 1] position of the query
            mask = _window(mask, last, window)
        rows_q = q[:, :d].transpose(0, 1)  # [D, heads, d]
        # A step of one-token prompts without a past (width 1) keeps the reference: the
        # kernel is compiled for contexts of two slots or more.
        compiled = step.decode_kernel is not None and step.decode_slots.shape[1] > 1
        if compiled and not softcap and sinks is None:
            assert step.decode_kernel is not None
            flat_mask = mask.reshape(d, mask.shape[-1])
            out = step.decode_kernel(
                _dense(rows_q), k_pool, v_pool, step.decode_slots, flat_mask, scaling
            )
            pieces.append(out)  # [D, heads, d]
        else:
            # index_select of the flat slots: ~5x faster on CPU than indexing with the 2-D one
            flat, rows = step.decode_slots.reshape(-1), step.decode_slots.shape
            keys = k_pool.index_select(0, flat).view(*rows, *k_pool.shape[1:]).permute(0, 2, 1, 3)
            values = v_pool.index_select(0, flat).view(*rows, *v_pool.shape[1:])
            values = values.permute(0, 2, 1, 3)
            out = _attend(rows_q[:, :, None], keys, values, mask, scaling, softcap, sinks=sinks)
            pieces.append(out[:, :, 0])  # [D, heads, d]
    for chunk in step.prefills:
        keys = k_pool.index_select(0, chunk.slots).transpose(0, 1)[None]  # [1, kv_heads, ctx, d]
        values = v_pool.index_select(0, chunk.slots).transpose(0, 1)[None]
        cq = q[None, :, chunk.start : chunk.start + chunk.length]  # [1, heads, len, d]
        past = chunk.context - chunk.length
        if past == 0 and not window:
            out = _attend(cq, keys, values, None, scaling, softcap, causal=True, sinks=sinks)
        else:
            positions = torch.arange(past, chunk.context, device=q.device)
            keys_at = torch.arange(chunk.context, device=q.device)
            mask = _window(keys_at[None, :] <= positions[:, None], positions, window)
            out = _attend(cq, keys, values, mask, scaling, softcap, sinks=sinks)
        pieces.append(out[0].transpose(0, 1))  # [len, heads, d]
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _flash_kernel() -> Callable[..., torch.Tensor] | None:
    try:
        module = importlib.import_module("flash_attn")
    except ImportError:
        return None
    fn: Callable[..., torch.Tensor] | None = getattr(module, "flash_attn_varlen_func", None)
    return fn


def kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether steps on `device` may use the paged-attention kernel: CUDA, half-precision
    weights (the kernel has no fp32 path) and the optional flash-attn package."""
    half = dtype in (torch.float16, torch.bfloat16)
    return device.type == "cuda" and half and _flash_kernel() is not None


def _flash(
    query: torch.Tensor,
    step: PagedStep,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    scaling: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    kernel = _flash_kernel()
    assert kernel is not None
    assert step.flash is not None
    shape = (step.pool.num_blocks, step.pool.block_size, *k_pool.shape[1:])
    blocks = slice(0, step.pool.pad_slot)  # the kernel reads through the block tables only
    return kernel(
        query[0].transpose(0, 1),  # [N, heads, d]
        k_pool[blocks].view(shape),
        v_pool[blocks].view(shape),
        softmax_scale=scaling,
        causal=True,
        window_size=(window - 1, 0) if window else (-1, -1),
        softcap=softcap or 0.0,
        **step.flash,
    )


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [1, heads, N, d]
    key: torch.Tensor,  # [1, kv_heads, N, d]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    step: PagedStep | None = kwargs.get("paged_step")
    if step is None:
        raise RuntimeError(f"{PAGED_ATTENTION} attention runs inside paged() only")
    layer = int(getattr(module, "layer_idx", 0))
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [N, kv_heads, d]
    k_pool, v_pool = step.pool.layer(layer, k_new, v_new)
    for pool, new in ((k_pool, k_new.to(k_pool.dtype)), (v_pool, v_new.to(v_pool.dtype))):
        if not kv_write.write(pool, step.slot_mapping, new):  # (on a CPU, one C++ call)
            pool.index_copy_(0, step.slot_mapping, new)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    window = kwargs.get("sliding_window")
    # flash-attn's kernel has no attention sinks (gpt-oss) and wants keys and values of one
    # head size (MLA's differ): those run on the reference.
    sinks = kwargs.get("s_aux")
    same_size = k_pool.shape[-1] == v_pool.shape[-1]
    if step.flash is not None and sinks is None and same_size:
        out = _flash(query, step, k_pool, v_pool, scale, softcap, window)
    else:
        out = _reference(query, step, k_pool, v_pool, scale, softcap, window, sinks)
    return out[None], None  # [1, N, heads, d], as transformers' attention functions return


AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)


@contextlib.contextmanager
def paged(model: nn.Module) -> Iterator[None]:
    """Inside the block, `model`'s attention is the paged one (pass `paged_step=` to forward).

    The engine runs a model from one thread at a time; the previous implementation (SDPA, the
    packed-training one, eager) holds again after the block.
    """
    config: Any = model.config
    previous = config._attn_implementation
    config._attn_implementation = PAGED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
