"""Training forward/backward passes: micro-batches under a token budget, several adapters each.

One forward/backward batch may hold rows of several adapters (sessions, tenants): each row is
routed through its own adapter (`lora.AdapterBank.routed`), the losses of every request are
summed, and one backward pass fills each adapter's gradients from its own rows only. Rows are
packed end to end with no padding (packing.py) on models whose attention allows it, padded
otherwise. A request too large for one micro-batch runs alone over several, and its adapter's
gradients are restored if it fails part-way.

One request's failure is its own: a micro-batch's gradients are accumulated only once they are
finite, and a micro-batch that raises or overflows is run again request by request, so that only
the request failing alone fails, with nothing accumulated (`_isolated_micro_batch`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from tuneloop.server.engine.custom_loss_graph import reduce_metrics
from tuneloop.server.engine.isolation import alone_error
from tuneloop.server.engine.logprobs import (
    pack_rows,
    pack_targets,
    pad_rows,
    pad_targets,
    target_logprobs,
)
from tuneloop.server.engine.losses import batch_losses
from tuneloop.server.engine.packing import bucketed, packed_positions, packed_segments
from tuneloop.server.engine.runtime import Runtime
from tuneloop.server.engine.types import EngineError, ForwardBackwardResult, ForwardBackwardWork

__all__ = ["TrainRow", "micro_batches", "train"]


@dataclass
class TrainRow:
    """One datum of a forward_backward request, with the index of its request."""

    work_index: int
    key: str
    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


def micro_batches(
    rows: list[TrainRow], packed: bool, token_budget: int
) -> list[tuple[list[TrainRow], int | None]]:
    """Split rows under the token budget (packed: total tokens; else rows x padded width).

    A request that fits the budget is never split across micro-batches; one that does not
    runs alone in consecutive micro-batches, named by the second value, so that its gradient
    can be taken back if it fails part-way.
    """
    by_work: dict[int, list[TrainRow]] = {}
    for row in rows:
        by_work.setdefault(row.work_index, []).append(row)
    batches: list[tuple[list[TrainRow], int | None]] = []
    current: list[TrainRow] = []

    def fits(candidate: list[TrainRow]) -> bool:
        return _tokens(candidate, packed) <= token_budget

    for work_index, work_rows in by_work.items():
        if fits(current + work_rows):
            current += work_rows
            continue
        if current:
            batches.append((current, None))
            current = []
        if fits(work_rows):
            current = list(work_rows)
            continue
        part: list[TrainRow] = []
        for row in work_rows:
            if part and not fits([*part, row]):
                batches.append((part, work_index))
                part = []
            part.append(row)
        batches.append((part, work_index))
    if current:
        batches.append((current, None))
    return batches


def _tokens(rows: list[TrainRow], packed: bool) -> int:
    if packed:
        return sum(len(r.tokens) for r in rows)
    return max((len(r.tokens) for r in rows), default=0) * len(rows)


def train(
    runtime: Runtime, works: Sequence[ForwardBackwardWork], token_budget: int
) -> list[ForwardBackwardResult | EngineError]:
    """Every request of `works` (all on `runtime`'s model), in micro-batches under the budget."""
    rows = [
        TrainRow(wi, work.adapter_id, ex.tokens, dict(ex.inputs))
        for wi, work in enumerate(works)
        for ex in work.examples
    ]
    losses = [0.0] * len(works)
    metric_sums: list[dict[str, float]] = [{} for _ in works]
    logprobs: list[list[np.ndarray]] = [[] for _ in works]
    failed: dict[int, EngineError] = {}
    # Gradients of the adapter of a request split over several micro-batches, as they were
    # before it: restored if the request fails after some of its micro-batches ran.
    saved: tuple[int, list[torch.Tensor | None]] | None = None
    for micro, alone in [*micro_batches(rows, runtime.packed, token_budget), ([], None)]:
        if saved is not None and saved[0] != alone:
            if saved[0] in failed:
                params = runtime.bank.parameters(works[saved[0]].adapter_id)
                for param, grad in zip(params, saved[1], strict=True):
                    param.grad = grad
            saved = None
        if not micro:
            break
        if alone is not None and saved is None and not works[alone].forward_only:
            params = runtime.bank.parameters(works[alone].adapter_id)
            saved = (alone, [None if p.grad is None else p.grad.clone() for p in params])
        try:
            _isolated_micro_batch(
                runtime, works, micro, losses, logprobs, failed, metric_sums, token_budget
            )
        except torch.OutOfMemoryError:
            for row in micro:
                failed.setdefault(
                    row.work_index,
                    EngineError(
                        "out of memory even for one micro-batch: send fewer or shorter datums",
                        "user",
                    ),
                )
    return [
        failed.get(i)
        or ForwardBackwardResult(
            logprobs[i],
            {"loss:sum": losses[i], **reduce_metrics(metric_sums[i], len(works[i].examples))},
        )
        for i in range(len(works))
    ]


def _isolated_micro_batch(
    runtime: Runtime,
    works: Sequence[ForwardBackwardWork],
    micro: list[TrainRow],
    losses: list[float],
    logprobs: list[list[np.ndarray]],
    failed: dict[int, EngineError],
    metric_sums: list[dict[str, float]],
    budget: int,
) -> None:
    """`_run_micro_batch`, its gradients accumulated only if they are finite.

    The micro-batch's gradients are computed apart from those accumulated before and added
    to them once checked. If they are not finite (rows of several requests share a packed
    attention, where one request's overflowing gradient reaches the others' through
    masked-out positions, 0 x inf), or the micro-batch raises, they are dropped and each
    request runs again alone: the one that fails alone fails, with nothing accumulated,
    and every other gets what it gets alone.
    """
    keys = list(dict.fromkeys(works[r.work_index].adapter_id for r in micro))
    params = {
        key: runtime.bank.parameters(key)
        for key in keys
        if any(not works[r.work_index].forward_only and r.key == key for r in micro)
    }
    held = {key: [p.grad for p in ps] for key, ps in params.items()}
    for ps in params.values():
        for param in ps:
            param.grad = None
    indices = list(dict.fromkeys(r.work_index for r in micro))
    before = (
        dict(failed),
        {i: losses[i] for i in indices},
        {i: len(logprobs[i]) for i in indices},
        {i: dict(metric_sums[i]) for i in indices},
    )
    try:
        _run_micro_batch(runtime, works, micro, losses, logprobs, failed, metric_sums, budget)
    except torch.OutOfMemoryError:
        _put_back(params, held, keep_new=False)
        raise
    except Exception as exc:
        _put_back(params, held, keep_new=False)
        error: EngineError = alone_error(exc, "forward_backward")
    else:
        if all(_finite_grads(ps) for ps in params.values()):
            _put_back(params, held, keep_new=True)
            return
        _put_back(params, held, keep_new=False)
        error = EngineError(
            "the gradients of this request are not finite (its loss inputs are too large "
            "for its model); nothing was accumulated",
            "user",
        )
    failed.clear()
    failed.update(before[0])
    for i in indices:
        losses[i] = before[1][i]
        del logprobs[i][before[2][i] :]
        metric_sums[i] = before[3][i]
    if len(indices) == 1:
        failed.setdefault(indices[0], error)
        return
    for i in indices:
        alone = [r for r in micro if r.work_index == i]
        _isolated_micro_batch(runtime, works, alone, losses, logprobs, failed, metric_sums, budget)


def _put_back(
    params: dict[str, list[nn.Parameter]],
    held: dict[str, list[torch.Tensor | None]],
    *,
    keep_new: bool,
) -> None:
    """Gradients back to those `held` before a micro-batch, its own added (`keep_new`)."""
    for key, ps in params.items():
        for param, old in zip(ps, held[key], strict=True):
            new = param.grad if keep_new else None
            if old is not None and new is not None:
                param.grad = old.add_(new)
            else:
                param.grad = old if old is not None else new


def _finite_grads(params: Sequence[nn.Parameter]) -> bool:
    """Whether the gradients' global norm is finite (what optim_step requires)."""
    grads = [p.grad for p in params if p.grad is not None]
    return not grads or bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))


def _run_micro_batch(
    runtime: Runtime,
    works: Sequence[ForwardBackwardWork],
    micro: list[TrainRow],
    losses: list[float],
    logprobs: list[list[np.ndarray]],
    failed: dict[int, EngineError],
    metric_sums: list[dict[str, float]],
    budget: int,
) -> None:
    """One forward (and backward) pass of `micro`; a packed row is padded to its bucket length
    (packing.bucketed) within the token `budget`."""
    device = runtime.device
    needs_grad = any(not works[r.work_index].forward_only for r in micro)
    lengths = [len(r.tokens) for r in micro]
    row_targets = [r.inputs["target_tokens"] for r in micro]
    keys: list[str | None] = [r.key for r in micro]
    if runtime.packed:
        rows = [r.tokens for r in micro]
        # row i's positions in the [1, total] output start after the rows before it
        offsets = [(0, start) for start in itertools.accumulate([0, *lengths[:-1]])]
        tokens = sum(lengths)
        # On a CPU only: what the buckets buy is oneDNN's kernels and the allocator's sizes
        # reused (packing.bucketed); an accelerator would only compute the padding.
        pad = min(bucketed(tokens), max(tokens, budget)) - tokens if device.type == "cpu" else 0
        if pad:  # a segment of its own, through the last row's adapter, scored by no loss
            rows.append(np.full(pad, runtime.pad_id, dtype=np.int64))
            row_targets = [*row_targets, np.zeros(pad, dtype=np.int64)]
            lengths = [*lengths, pad]
            keys.append(keys[-1])
        input_ids = pack_rows(rows, device)
        targets = pack_targets(row_targets, device)
        positions: torch.Tensor | None = packed_positions(lengths, device)
        segments: Any = packed_segments(lengths)
    else:
        input_ids = pad_rows([r.tokens for r in micro], runtime.pad_id, device)
        targets = pad_targets(row_targets, input_ids.shape[1], device)
        positions = None
        offsets = [(i, 0) for i in range(len(micro))]
        segments = contextlib.nullcontext()
    with (
        runtime.bank.routed(keys, lengths if runtime.packed else None),
        segments,
        torch.set_grad_enabled(needs_grad),
    ):
        all_lp = target_logprobs(runtime.model, input_ids, lengths, targets, positions)
        views: list[torch.Tensor] = []
        by_work: dict[int, list[int]] = {}
        for i, row in enumerate(micro):
            target = row.inputs["target_tokens"]
            batch_row, start = offsets[i]
            lp = all_lp[
                batch_row,
                start : start + len(row.tokens),
                : (1 if target.ndim == 1 else target.shape[1]),
            ]
            views.append(lp[:, 0] if target.ndim == 1 else lp)
            by_work.setdefault(row.work_index, []).append(i)
        # Every request's datums in one pass each (losses.batch_losses), then one copy to the
        # host for every loss value and logprob of the micro-batch, where a per-datum float()
        # and .cpu() waited on the device twice per datum.
        per_work: dict[int, tuple[torch.Tensor, list[dict[str, float]]]] = {}
        for wi, members in by_work.items():
            try:
                per_work[wi] = batch_losses(
                    works[wi],
                    [views[i] for i in members],
                    [micro[i].inputs for i in members],
                    device,
                )
            except EngineError as exc:  # e.g. an unknown loss: fails this request only
                failed.setdefault(wi, exc)
        host = (
            torch.cat(
                [vec.detach().to(torch.float32) for vec, _ in per_work.values()]
                + [lp.detach().to(torch.float32).reshape(-1) for lp in views]
            )
            .cpu()
            .numpy()
        )
        values: dict[int, np.ndarray] = {}
        at = 0
        for wi, (vec, _) in per_work.items():
            values[wi], at = host[at : at + vec.shape[0]], at + vec.shape[0]
        row_lp: list[np.ndarray] = []
        for lp in views:
            size = lp.numel()
            row_lp.append(host[at : at + size].reshape(tuple(lp.shape)))
            at += size
        total: list[torch.Tensor] = []
        for wi, (vec, metrics) in per_work.items():
            work = works[wi]
            if wi in failed:  # in an earlier micro-batch of this request
                continue
            if not np.isfinite(values[wi]).all():
                failed.setdefault(
                    wi,
                    EngineError(f"the {work.loss_fn} loss is not finite for this request", "user"),
                )
                continue
            losses[wi] += sum(float(v) for v in values[wi])
            sums = metric_sums[wi]
            for extra in metrics:
                for key, metric in extra.items():
                    sums[key] = sums.get(key, 0.0) + metric
            logprobs[wi].extend(row_lp[i] for i in by_work[wi])
            if not work.forward_only:
                total.append(vec.sum())
        if needs_grad and total:
            # Backward inside the routing block: checkpointed LM-head chunks recompute
            # through the same adapters.
            torch.stack(total).sum().backward()
