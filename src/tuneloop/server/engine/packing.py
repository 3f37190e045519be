"""Training batches without per-sequence padding: variable-length sequences packed into one row.

A padded batch of 8 sequences of 64-256 tokens spends about a third of its matmuls on padding.
Packed, the sequences sit end to end in one row of their total length; positions restart at 0
for each sequence (rotary embeddings see what they would alone), and attention runs per sequence
so that it never crosses a boundary. Everything else in a transformer works token by token, so the
packed row gives each sequence exactly the hidden states it gets on its own.

Attention is a transformers attention function registered under `PACKED_ATTENTION`: inside
`packed_segments(lengths)` it runs causal attention on each sequence's piece of q/k/v, the
sequences of one length as one batch (sequence_batches.py; SDPA, in bf16/fp16 on a CPU
causal_cpu.py's kernels); outside it, it is plain SDPA
with the usual mask, so sampling (padded prompts, KV cache) is unchanged. Per-sequence
attention costs sum(len^2) instead of the (sum len)^2 a block-diagonal mask over the packed
row would; in bf16 on a CPU with AVX512-BF16 every sequence runs in one call each way
(native_attention.py). The packed row is padded at its end to a bucket length (`bucketed`),
by a segment of its own that no loss reads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tuneloop.server.engine import native_attention, sequence_batches
from tuneloop.server.engine.causal_cpu import packed_attention

PACKED_ATTENTION = "tuneloop_packed_sdpa"

# The engine runs a model from one thread at a time; thread-local keeps a stray caller on
# another thread from seeing a batch's segments.
_state = threading.local()


def _packed_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    lengths: list[int] | None = getattr(_state, "lengths", None)
    if lengths is None or query.shape[2] != sum(lengths) or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if _cpu_half(query, kwargs):
        scale = kwargs.get("scaling")
        scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
        if native_attention.takes(query, key, value, scale, lengths):
            # every sequence in one call each way in C++, no splits
            out = native_attention.PackedTileCausal.apply(query, key, value, tuple(lengths), scale)
            return out, None
        return packed_attention(query, key, value, lengths, scale), None

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        causal = {**kwargs, "is_causal": True}
        return sdpa_attention_forward(module, q, k, v, None, **causal)[0]  # [n, len, heads, d]

    how = sdpa_plan(lengths, query.device)
    return sequence_batches.attend(query, key, value, lengths, how, sdpa, sdpa), None


def sdpa_plan(lengths: Sequence[int], device: torch.device) -> sequence_batches.Plan:
    """How SDPA runs a packed row's sequences on `device`: on a CPU those of one length as one
    batch (sequence_batches.py; each sequence's bits are those it gets alone, tested); on
    other devices one by one, as a GPU's kernels may split a batch's work by its size (flash's
    split-KV heuristic), which no run on a device has checked yet."""
    if device.type == "cpu":
        return sequence_batches.plan(tuple(lengths))
    return sequence_batches.plan(tuple(lengths), limit=0)


def _cpu_half(query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """bf16/fp16 attention on a CPU without dropout: causal_cpu.py's kernels, with or without
    autograd, so that a forward and a forward_backward score a sequence with the same bits."""
    half = query.dtype in (torch.bfloat16, torch.float16)
    dropout = float(kwargs.get("dropout") or 0.0)
    return query.device.type == "cpu" and half and not dropout


AttentionInterface.register(PACKED_ATTENTION, _packed_sdpa)
# Masks as SDPA builds them: the padded paths (prompts, decoding) keep working unchanged.
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)


def enable_packing(model: nn.Module) -> bool:
    """Switch a model that uses SDPA to the packing-aware attention; False if it can't pack.

    Models with anything but plain SDPA (eager-only architectures, attention softcapping,
    sliding windows) keep their attention and train on padded batches.
    """
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "sliding_window", None):
        return False
    model.set_attn_implementation(PACKED_ATTENTION)  # type: ignore[operator]
    return True


@contextlib.contextmanager
def packed_segments(lengths: Sequence[int]) -> Iterator[None]:
    """Within the block, a [1, sum(lengths)] forward attends within each segment only.

    Backward passes that recompute attention (checkpointed chunks) must also run inside it.
    """
    previous = getattr(_state, "lengths", None)
    _state.lengths = [int(n) for n in lengths]
    try:
        yield
    finally:
        _state.lengths = previous


# A packed pass of `n` tokens runs at `bucketed(n)`: n rounded up to one of BUCKETS_PER_OCTAVE
# lengths per power of two (at least MIN_GRANULE apart). oneDNN builds (JITs) a kernel for
# every matmul shape it has not seen, 0.3-5 ms each, and a packed batch's token count is new at
# almost every step: ~20 matmul shapes depend on it (with the attention's, 40-100 ms a step of
# 1.6 s on SmolLM2-135M, an AMX Xeon), and jemalloc, which keeps freed pages (cli/preload.py),
# fragments on sizes that never recur. Bucketed, the shapes and sizes recur; the padding costs
# at most 1/BUCKETS_PER_OCTAVE. Training pads to buckets on a CPU only (training.py). Since the
# layers' products run on the native kernel (lora/native_summed.py), which builds nothing per
# shape, few oneDNN shapes depend on the count (the rank-32 products, the head's last row
# piece) and the padding's own cost came to the fore: at 16 a part of bench/engine.py's
# batches (500-900 tokens, granules of 32) padded ~2.5 % of its tokens; at 32 (granules of
# 16 there) a training step per real token ran 0.96-0.97x the time, about as without buckets,
# while the heap stays bounded (a Zen 4 EPYC, bench/train_long.py; docs/benchmarks.md).
BUCKETS_PER_OCTAVE = 32
MIN_GRANULE = 16


def bucketed(tokens: int) -> int:
    """The length a packed row of `tokens` tokens is padded to (`tokens` itself when 0 or
    BUCKETS_PER_OCTAVE is 0)."""
    if tokens <= 0 or BUCKETS_PER_OCTAVE <= 0:
        return tokens
    shift = tokens.bit_length() - 1 - (BUCKETS_PER_OCTAVE.bit_length() - 1)
    granule = max(MIN_GRANULE, 1 << max(shift, 0))
    return -(-tokens // granule) * granule


def packed_positions(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """Position ids [1, sum(lengths)] restarting at 0 for each segment."""
    return torch.cat([torch.arange(n) for n in lengths])[None].to(device)
