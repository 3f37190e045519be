"""The decode rows' attention compiled by inductor into one loop nest that reads the pool.

The reference decode attention (paged_attention.py) gathers every row's slots into fresh
[rows, kv_heads, longest context, dim] keys and values and runs SDPA over them. On a CPU both
halves cost more than the arithmetic: the gather writes and reads the step's whole context
once more, and SDPA's CPU kernel works per (row, head) pair in blocks sized for long queries
while a decode row has one query per head. Written as sums over the keys (`attend`),
`torch.compile` turns the step into one C++ kernel that loads each key and value straight
from the pool through the slot indices (inductor's indirect loads), keeps the scores in fp32
and vectorizes over the head dimension; the query heads that share a key head read it once.

Measured on an AVX-512-BF16 EPYC (docs/benchmarks.md): one layer of SmolLM2-135M's 9 query
and 3 key heads, 128 rows of 30-70 slots, 1.75x faster than the gather + SDPA with the same
error against fp64 (bench/cpu_kernels.py); a whole decode step 1.1-1.25x
(bench/step_variants.py decode-attention). Grouped-query heads, sliding windows (in the
mask) and value heads narrower than the key heads (MLA) compute here; soft-capped scores and
attention sinks keep the reference.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable

import torch

__all__ = ["attend", "compiled", "warm_up"]

log = logging.getLogger(__name__)


def attend(
    q: torch.Tensor,  # [rows, heads, dim]
    k_pool: torch.Tensor,  # [slots, kv_heads, dim]
    v_pool: torch.Tensor,  # [slots, kv_heads, dim_v]
    slots: torch.Tensor,  # [rows, context] long: each row's slots, padded with a zero slot
    mask: torch.Tensor,  # [rows, context] bool: which of them the row attends to
    scale: float,
) -> torch.Tensor:
    """Each row's one query per head attends to its slots: [rows, heads, dim_v] in q's dtype.

    Query head h reads key head h // groups (as transformers' repeat_kv); scores, softmax and
    the weighted sum in fp32. Every row must attend to at least one slot.
    """
    rows, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    groups = heads // kv_heads
    keys = k_pool[slots]  # [rows, context, kv_heads, dim]: fused into the loads when compiled
    values = v_pool[slots]
    query = q.reshape(rows, 1, kv_heads, groups, dim).float()
    scores = (query * keys[:, :, :, None, :].float()).sum(-1) * scale  # [rows, ctx, kv, groups]
    scores = scores.masked_fill(~mask[:, :, None, None], float("-inf"))
    weights = (scores - scores.amax(1, keepdim=True)).exp()
    total = weights.sum(1)  # [rows, kv_heads, groups]
    out = (weights[..., None] * values[:, :, :, None, :].float()).sum(1) / total[..., None]
    return out.reshape(rows, heads, values.shape[-1]).to(q.dtype)


@functools.cache
def compiled() -> Callable[..., torch.Tensor]:
    """`attend` compiled for the sizes `warm_up` marks symbolic (rows, context, pool slots);
    heads and head size stay constants of the kernel, whose loops over them are then fixed."""
    with warnings.catch_warnings():
        # the first torch.compile imports parts of torch that warn about torch's own
        # deprecated APIs (torch.jit.script_method): nothing a caller can act on.
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.compile(attend)


# Warm-up sizes: rows, context and pool slots of the calls that compile the kernel, distinct
# from each other (dynamo would take two equal sizes for one symbol and guard on it). A size
# of 1 is specialised: one graph for many rows, one for a single row.
_WARM_UP = ((5, 6, 43), (1, 8, 71))


def warm_up(
    heads: int,
    kv_heads: int,
    dim: int,
    dim_v: int,
    scale: float,
    dtype: torch.dtype,
    device: torch.device,
) -> bool:
    """Compile the graphs a model's decode steps run, without autograd, for its attention's
    `scale` (a constant of the graph: another scale compiles again). False, with a warning,
    where compiling fails (no C++ compiler). A step whose context is longer than 4,096 slots
    compiles once more (inductor sums long reductions in a more exact way)."""
    try:
        with warnings.catch_warnings(), torch.no_grad():
            # inductor's first compile imports parts of torch that warn about torch's own
            # deprecated APIs: nothing a caller can act on.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            for rows, width, slots in _WARM_UP:
                k_pool = torch.randn((slots, kv_heads, dim), dtype=dtype, device=device)
                v_pool = torch.randn((slots, kv_heads, dim_v), dtype=dtype, device=device)
                q = torch.randn((rows, heads, dim), dtype=dtype, device=device)
                table = torch.arange(rows * width, device=device).reshape(rows, width) % slots
                mask = torch.ones((rows, width), dtype=torch.bool, device=device)
                for tensor, dims in ((q, [0]), (table, [0, 1]), (mask, [0, 1])):
                    torch._dynamo.mark_dynamic(tensor, [d for d in dims if tensor.shape[d] > 1])
                for pool in (k_pool, v_pool):
                    torch._dynamo.mark_dynamic(pool, 0)
                compiled()(q, k_pool, v_pool, table, mask, scale)
    except Exception as exc:  # any failure to compile leaves the reference attention
        log.warning("torch.compile of the decode attention failed, it runs eager: %s", exc)
        return False
    return True
