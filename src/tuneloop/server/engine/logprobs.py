"""Target logprobs from a causal LM without materialising the whole batch's logits.

The LM head over a 49k-150k vocabulary dominates memory for small models: a batch of 8 x 1024
tokens would need 8 x 1024 x 49152 fp32 logits (1.6 GB) at once, and autograd would keep them for
the backward pass. Here the head runs over chunks of positions, each under activation
checkpointing, so only one chunk's logits exist at a time, forward and backward. A batch whose
logits are small enough runs in one piece without the recompute: on SmolLM2 the head is ~40 % of
a training step, and recomputing it costs a third more of that.

The head runs in the engine dtype (bf16 on machines with bf16 matrix units) and only its
log-softmax is fp32 (`_TargetLogprobs`: fused, in row pieces, the logsumexp accumulated in fp32).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tuneloop.server.engine.fused_head import fused_target_logprobs, head_parts

# Logit elements per chunk (x4 bytes in fp32): 16M = 64 MB, a few x that with log_softmax.
LOGIT_ELEMENTS_PER_CHUNK = 1 << 24
# Up to this many logit elements (128 MB in bf16, 256 MB in fp32: the logits are all the fused
# log-softmax keeps for the backward pass) the head runs in one piece with no recompute:
# 8 x 128 tokens x 49k vocab is 50M.
LOGIT_ELEMENTS_UNCHUNKED = 1 << 26


def pad_rows(rows: Sequence[np.ndarray], pad_id: int, device: torch.device) -> torch.Tensor:
    """Right-pad 1-D token rows into [B, T]."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out.to(device)


def pad_targets(targets: Sequence[np.ndarray], width: int, device: torch.device) -> torch.Tensor:
    """Targets [N] or [N, K] per row into [B, T, K] (K = the widest row's), padded with 0."""
    k = max(1 if t.ndim == 1 else t.shape[1] for t in targets)
    out = torch.zeros((len(targets), width, k), dtype=torch.long)
    for i, t in enumerate(targets):
        t2 = t[:, None] if t.ndim == 1 else t
        out[i, : t2.shape[0], : t2.shape[1]] = torch.as_tensor(t2, dtype=torch.long)
    return out.to(device)


# Rows of logits upcast to fp32 at a time inside the fused log-softmax (x 4 bytes x vocab):
# 4M elements = 16 MB, so the fp32 copy of a chunk stays in cache-sized pieces and a
# [tokens, vocab] fp32 copy of the logits never exists.
_FP32_ELEMENTS_PER_PIECE = 1 << 22


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    x = logits.float()
    return torch.tanh(x / softcap) * softcap if softcap else x


class _TargetLogprobs(torch.autograd.Function):
    """log_softmax(logits)[targets] in fp32 from logits in the engine dtype, fused.

    Forward: row pieces of the logits upcast to fp32, log-softmax (the logsumexp accumulates
    in fp32) and gather, exactly `log_softmax(logits.float()).gather(...)` piece by piece.
    Backward: d logits = g_k at the targets - (sum_k g_k) x softmax, from the saved logits in
    their own dtype (half the bytes in bf16) instead of a kept fp32 log-softmax output and the
    full-size zero tensor a gather's backward scatters into.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        softcap: float | None,
    ) -> torch.Tensor:
        flat, flat_targets = (
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1, targets.shape[-1]),
        )
        out = torch.empty(flat_targets.shape, dtype=torch.float32, device=logits.device)
        step = max(1, _FP32_ELEMENTS_PER_PIECE // flat.shape[-1])
        for start in range(0, flat.shape[0], step):
            piece = torch.log_softmax(_capped(flat[start : start + step], softcap), dim=-1)
            out[start : start + step] = piece.gather(-1, flat_targets[start : start + step])
        ctx.save_for_backward(logits, targets)
        ctx.softcap = softcap  # type: ignore[attr-defined]
        return out.view(targets.shape)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        logits, targets = ctx.saved_tensors  # type: ignore[attr-defined]
        softcap = ctx.softcap  # type: ignore[attr-defined]
        flat, flat_targets = (
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1, targets.shape[-1]),
        )
        flat_grad = grad.reshape(flat_targets.shape).float()
        out = torch.empty_like(flat)
        step = max(1, _FP32_ELEMENTS_PER_PIECE // flat.shape[-1])
        for start in range(0, flat.shape[0], step):
            x = _capped(flat[start : start + step], softcap)
            g = flat_grad[start : start + step]
            d = torch.softmax(x, dim=-1).mul_(-g.sum(-1, keepdim=True))
            d.scatter_add_(-1, flat_targets[start : start + step], g)
            if softcap:
                d.mul_(1 - (x / softcap).square())  # d/dz of tanh(z / c) * c
            out[start : start + step] = d
        return out.view(logits.shape), None, None


def _head_logprobs(
    head: nn.Module, softcap: float | None, hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The head in the engine dtype, its log-softmax in fp32 ([B, c, K] float32)."""
    logits = head(hidden)  # [B, c, V]
    result: torch.Tensor = _TargetLogprobs.apply(logits, targets, softcap)
    return result


def _hidden_and_head(
    model: nn.Module,
    input_ids: torch.Tensor,
    lengths: Sequence[int],
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, nn.Module, float | None, int]:
    """Final hidden states [B, T, d], the LM head, its softcap, vocab.

    Rows are right-padded to `lengths`; with `position_ids` given, the input is one packed row
    instead (no mask: the packed attention keeps sequences apart).
    """
    decoder: nn.Module = model.get_decoder()  # type: ignore[operator]
    # No KV cache: an evaluated model's decoder would otherwise build one (a copy of every
    # layer's keys and values, held until the pass returns) that nothing reads.
    if position_ids is not None:
        hidden = decoder(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state
    else:
        width = input_ids.shape[1]
        positions = torch.arange(width, device=input_ids.device)
        lens = torch.as_tensor(lengths, device=input_ids.device)
        mask = (positions[None, :] < lens[:, None]).long()
        hidden = decoder(
            input_ids=input_ids, attention_mask=mask, use_cache=False
        ).last_hidden_state
    head: nn.Module = model.get_output_embeddings()  # type: ignore[operator]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    vocab = int(head.weight.shape[0])  # type: ignore[index]
    return hidden, head, softcap, vocab


def _chunk(rows: int, vocab: int) -> int:
    """Positions per chunk so that one chunk holds about LOGIT_ELEMENTS_PER_CHUNK logits."""
    return max(1, LOGIT_ELEMENTS_PER_CHUNK // (vocab * rows))


def target_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    lengths: Sequence[int],
    targets: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(targets[b, t, k] | input_ids[b, :t+1]) for every row, as [B, T, K] float32.

    Differentiable when grad is enabled. Positions past a row's length are padding (garbage).
    With `position_ids`, `input_ids` is one packed row [1, sum(lengths)] (see packing.py; call
    inside `packed_segments(lengths)`).
    """
    hidden, head, softcap, vocab = _hidden_and_head(model, input_ids, lengths, position_ids)
    flat = hidden.reshape(-1, hidden.shape[-1])
    parts = head_parts(head, flat)
    if parts is not None:  # a plain head: fused over vocabulary chunks (fused_head.py)
        flat_targets = targets.reshape(-1, targets.shape[-1])
        return fused_target_logprobs(parts, flat, flat_targets, softcap).view(targets.shape)
    width = input_ids.shape[1]
    if input_ids.shape[0] * width * vocab <= LOGIT_ELEMENTS_UNCHUNKED:
        return _head_logprobs(head, softcap, hidden, targets)
    chunk = _chunk(input_ids.shape[0], vocab)
    pieces = []
    for start in range(0, width, chunk):
        # contiguous: a strided 3-D input sends the head matmul to a slow batched kernel
        h, t = hidden[:, start : start + chunk].contiguous(), targets[:, start : start + chunk]
        if torch.is_grad_enabled():
            # Recompute this chunk's logits in the backward pass instead of keeping them.
            pieces.append(checkpoint(_head_logprobs, head, softcap, h, t, use_reentrant=False))
        else:
            pieces.append(_head_logprobs(head, softcap, h, t))
    return torch.cat(pieces, dim=1)


def pack_rows(rows: Sequence[np.ndarray], device: torch.device) -> torch.Tensor:
    """1-D token rows end to end as one row [1, sum(len)]."""
    return torch.as_tensor(np.concatenate(rows), dtype=torch.long)[None].to(device)


def pack_targets(targets: Sequence[np.ndarray], device: torch.device) -> torch.Tensor:
    """Targets [N] or [N, K] per row, end to end, as [1, sum(N), K] (K = the widest's, 0-padded)."""
    k = max(1 if t.ndim == 1 else t.shape[1] for t in targets)
    out = torch.zeros((1, sum(t.shape[0] for t in targets), k), dtype=torch.long)
    start = 0
    for t in targets:
        t2 = t[:, None] if t.ndim == 1 else t
        out[0, start : start + t2.shape[0], : t2.shape[1]] = torch.as_tensor(t2, dtype=torch.long)
        start += t2.shape[0]
    return out.to(device)


@torch.no_grad()
def prompt_scores(
    model: nn.Module, input_ids: torch.Tensor, lengths: Sequence[int], k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each position t < T-1: log p(input_ids[b, t+1]) and the top-k (logprob, id) pairs.

    Returns ([B, T-1], [B, T-1, k], [B, T-1, k]); the same chunked head as training, so a prompt
    scored here gets exactly the logprobs a forward pass reports.
    """
    hidden, head, softcap, vocab = _hidden_and_head(model, input_ids, lengths)
    chunk = _chunk(input_ids.shape[0], vocab)
    hidden, nexts = hidden[:, :-1], input_ids[:, 1:]
    picked, top_values, top_ids = [], [], []
    for start in range(0, nexts.shape[1], chunk):
        logits = head(hidden[:, start : start + chunk].contiguous()).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        logprobs = torch.log_softmax(logits, dim=-1)
        picked.append(logprobs.gather(-1, nexts[:, start : start + chunk, None])[..., 0])
        values, ids = torch.topk(logprobs, max(k, 1), dim=-1)
        top_values.append(values[..., :k])
        top_ids.append(ids[..., :k])
    return torch.cat(picked, 1), torch.cat(top_values, 1), torch.cat(top_ids, 1)
