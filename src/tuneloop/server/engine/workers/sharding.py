"""Which rank runs what: training data sharded by tokens, sampling requests by cost.

Pure functions over engine types, so the split and the merge back are tested without workers.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tuneloop.server.engine.types import (
    EngineError,
    ForwardBackwardResult,
    ForwardBackwardWork,
    SampleWork,
)


@dataclass(frozen=True)
class Part:
    """The examples of one request that one rank runs: request `work_index`, `examples` the
    indices of its examples in their original order."""

    work_index: int
    examples: tuple[int, ...]


def balance(costs: Sequence[int], ranks: int) -> list[list[int]]:
    """Item indices per rank, greedily largest first onto the least loaded rank (ties: the
    lowest rank), each rank's list in ascending order. Deterministic for the same costs, so
    a replayed batch lands on the same ranks and sums its gradients in the same order."""
    loads = [(0, rank) for rank in range(ranks)]
    heapq.heapify(loads)
    assigned: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        assigned[rank].append(index)
        heapq.heappush(loads, (load + costs[index], rank))
    return [sorted(items) for items in assigned]


def shard_batch(batch: Sequence[ForwardBackwardWork], ranks: int) -> list[list[Part]]:
    """Each rank's parts of a forward_backward batch, balanced by tokens across all requests."""
    flat = [(wi, ei) for wi, work in enumerate(batch) for ei in range(len(work.examples))]
    costs = [len(batch[wi].examples[ei].tokens) for wi, ei in flat]
    shards: list[list[Part]] = []
    for items in balance(costs, ranks):
        by_work: dict[int, list[int]] = {}
        for item in items:
            wi, ei = flat[item]
            by_work.setdefault(wi, []).append(ei)
        shards.append([Part(wi, tuple(eis)) for wi, eis in sorted(by_work.items())])
    return shards


def shard_works(
    batch: Sequence[ForwardBackwardWork], parts: list[Part]
) -> list[ForwardBackwardWork]:
    """The requests one rank runs: each original request cut to that rank's examples."""
    return [
        replace(
            batch[p.work_index], examples=tuple(batch[p.work_index].examples[i] for i in p.examples)
        )
        for p in parts
    ]


def _merge_metrics(
    parts: list[dict[str, float]], weights: list[int] | None = None
) -> dict[str, float]:
    """Metrics of one request from its ranks: by the suffix convention of the wire protocol
    (":sum" adds, ":max"/":min" take the extreme, anything else the mean, weighted by each
    rank's number of examples when `weights` gives them)."""
    keys = {k for metrics in parts for k in metrics}
    merged: dict[str, float] = {}
    for key in sorted(keys):
        values = [m[key] for m in parts if key in m]
        if weights is not None and not key.endswith((":sum", ":max", ":min")):
            counts = [w for m, w in zip(parts, weights, strict=True) if key in m]
            if sum(counts):
                merged[key] = float(np.average(values, weights=counts))
                continue
        if key.endswith(":sum"):
            merged[key] = float(sum(values))
        elif key.endswith(":max"):
            merged[key] = float(max(values))
        elif key.endswith(":min"):
            merged[key] = float(min(values))
        else:
            merged[key] = float(np.mean(values))
    return merged


def merge_results(
    batch: Sequence[ForwardBackwardWork],
    shards: list[list[Part]],
    replies: list[list[ForwardBackwardResult | EngineError]],
) -> tuple[list[ForwardBackwardResult | EngineError], set[int]]:
    """Each request's result in the original order, and the requests that failed on one rank
    after another rank had applied gradients for them (their gradients must be taken back)."""
    logprobs: list[dict[int, np.ndarray]] = [{} for _ in batch]
    metrics: list[list[dict[str, float]]] = [[] for _ in batch]
    counts: list[list[int]] = [[] for _ in batch]
    errors: dict[int, EngineError] = {}
    succeeded: set[int] = set()
    for parts, results in zip(shards, replies, strict=True):
        for part, result in zip(parts, results, strict=True):
            if isinstance(result, EngineError):
                errors.setdefault(part.work_index, result)
                continue
            succeeded.add(part.work_index)
            metrics[part.work_index].append(result.metrics)
            counts[part.work_index].append(len(part.examples))
            logprobs[part.work_index].update(zip(part.examples, result.logprobs, strict=True))
    merged: list[ForwardBackwardResult | EngineError] = []
    for wi, work in enumerate(batch):
        if wi in errors:
            merged.append(errors[wi])
        else:
            ordered = [logprobs[wi][ei] for ei in range(len(work.examples))]
            # a request with no examples ran nowhere: a zero loss, as in one process
            merged_metrics = (
                _merge_metrics(metrics[wi], counts[wi]) if metrics[wi] else {"loss:sum": 0.0}
            )
            merged.append(ForwardBackwardResult(ordered, merged_metrics))
    partial = {wi for wi in errors if wi in succeeded and not batch[wi].forward_only}
    return merged, partial


def split_samples(batch: Sequence[SampleWork], ranks: int) -> list[list[int]]:
    """Sampling request indices per rank, balanced by rows x cache width."""
    costs = [w.num_samples * (len(w.prompt) + w.max_tokens) for w in batch]
    return balance(costs, ranks)
