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

import concurrent.futures
import contextlib
import itertools
import os
import threading
from collections.abc import Iterator, Sequence
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
from tuneloop.server.engine.lora.routing import Routing
from tuneloop.server.engine.losses import batch_losses
from tuneloop.server.engine.packing import bucketed, packed_positions, packed_segments
from tuneloop.server.engine.runtime import Runtime
from tuneloop.server.engine.types import EngineError, ForwardBackwardResult, ForwardBackwardWork

__all__ = [
    "PARTS_VARIABLE",
    "SPLIT_MIN_TOKENS",
    "TrainRow",
    "micro_batches",
    "part_threads",
    "split",
    "train",
    "use_threads",
]


@dataclass
class TrainRow:
    """One datum of a forward_backward request, with the index of its request."""

    work_index: int
    key: str
    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class _Tally:
    """Per request of a forward_backward batch: its loss sum, logprobs and metric sums so far,
    and the requests that failed (index -> error)."""

    losses: list[float]
    logprobs: list[list[np.ndarray]]
    metric_sums: list[dict[str, float]]
    failed: dict[int, EngineError] = field(default_factory=dict)


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
    tally = _Tally([0.0] * len(works), [[] for _ in works], [{} for _ in works])
    failed = tally.failed
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
            _isolated_micro_batch(runtime, works, micro, tally, token_budget)
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
            tally.logprobs[i],
            {
                "loss:sum": tally.losses[i],
                **reduce_metrics(tally.metric_sums[i], len(works[i].examples)),
            },
        )
        for i in range(len(works))
    ]


def _isolated_micro_batch(
    runtime: Runtime,
    works: Sequence[ForwardBackwardWork],
    micro: list[TrainRow],
    tally: _Tally,
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
    failed = tally.failed
    before = (
        dict(failed),
        {i: tally.losses[i] for i in indices},
        {i: len(tally.logprobs[i]) for i in indices},
        {i: dict(tally.metric_sums[i]) for i in indices},
    )
    try:
        _run_micro_batch(runtime, works, micro, tally, budget)
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
        tally.losses[i] = before[1][i]
        del tally.logprobs[i][before[2][i] :]
        tally.metric_sums[i] = before[3][i]
    if len(indices) == 1:
        failed.setdefault(indices[0], error)
        return
    for i in indices:
        alone = [r for r in micro if r.work_index == i]
        _isolated_micro_batch(runtime, works, alone, tally, budget)


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


@dataclass
class _Part:
    """The rows of a micro-batch that run as one forward (and backward) pass, and its results."""

    micro: list[TrainRow]
    index: list[int]  # of each row in the micro-batch
    routing: Routing
    lengths: list[int]
    input_ids: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None
    offsets: list[tuple[int, int]]  # row i's (batch row, start) in the pass's output
    needs_grad: bool
    views: list[torch.Tensor] = field(default_factory=list)
    per_work: dict[int, tuple[torch.Tensor, list[dict[str, float]]]] = field(default_factory=dict)
    errors: dict[int, EngineError] = field(default_factory=dict)
    values: dict[int, np.ndarray] = field(default_factory=dict)
    row_lp: list[np.ndarray] = field(default_factory=list)
    trained: set[int] = field(default_factory=set)  # requests its backward pass took


def _run_micro_batch(
    runtime: Runtime,
    works: Sequence[ForwardBackwardWork],
    micro: list[TrainRow],
    tally: _Tally,
    budget: int,
) -> None:
    """One forward (and backward) pass of `micro`; a packed row is padded to its bucket length
    (packing.bucketed) within the token `budget`. On a CPU a large enough micro-batch runs as
    two parts on two threads at once (`split`)."""
    parts = [_prepare(runtime, works, micro, index, budget) for index in split(runtime, micro)]
    if len(parts) == 1:
        (part,) = parts
        with _entered(runtime, part):  # backward inside the routing block (see _backward)
            _forward(runtime, works, part)
            (takes,) = _account(works, parts, tally)
            _backward(part, [part.per_work[wi][0].sum() for wi in takes])
        return
    _in_parts(runtime, works, parts, tally)


# On a CPU a training pass is its matmuls and, between them, the host's work of a pass (the
# Python of the model's modules and autograd nodes, torch's dispatch, small single-threaded
# operations): while one thread runs that, the other waits for the next parallel region. At 2
# threads on SmolLM2-135M (bf16, 1,408 tokens) the second thread waited in OpenMP ~19 % of a
# step (perf). A micro-batch of two parts on two threads of half the threads each, forward and
# backward, overlaps one part's host work with the other's arithmetic (bench/train_variants.py
# --variant parts, docs/benchmarks.md). Each part is at least this many tokens: below it, the
# host work a pass costs, paid once per part, outweighs what the overlap saves.
SPLIT_MIN_TOKENS = 256
PARTS_VARIABLE = "TUNELOOP_TRAIN_PARTS"  # "0": every micro-batch in one pass
_SPLIT = True  # (bench/train_variants.py switches it off to compare: --variant parts)
_helper: concurrent.futures.ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def split(runtime: Runtime, micro: list[TrainRow]) -> list[list[int]]:
    """The parts `micro` runs in, as lists of its row indices in order: on a CPU with two
    threads or more, two parts of token counts as even as the rows allow (`_halves`; the part
    with the longest row first), each of at least SPLIT_MIN_TOKENS tokens; else one part, all
    of it.

    A part's gradients are summed over its own rows, and the parts' are added once both are
    done (two terms: the same bits whichever finishes first); the split depends only on the
    rows' lengths, so a micro-batch's results do not depend on the threads' timing."""
    whole = [list(range(len(micro)))]
    if not _SPLIT or os.environ.get(PARTS_VARIABLE, "1") == "0":
        return whole
    if runtime.device.type != "cpu" or torch.get_num_threads() < 2:
        return whole
    lengths = [len(r.tokens) for r in micro]
    if len(micro) < 2 or sum(lengths) < 2 * SPLIT_MIN_TOKENS:
        return whole
    parts = _halves(lengths)
    if min(sum(lengths[i] for i in part) for part in parts) < SPLIT_MIN_TOKENS:
        return whole
    longest = max(range(len(lengths)), key=lambda i: (lengths[i], -i))
    return sorted(parts, key=lambda part: longest not in part)


def _halves(lengths: list[int]) -> list[list[int]]:
    """The rows in two sets whose token counts are as close as any split makes them (the
    first holding the largest sum up to half), each in row order. Longest row first to the
    part with fewer tokens (the earlier rule) left the parts of bench/engine.py's batches (8
    rows of 64-256 tokens) up to 64 tokens apart, and the part with more ran the longer; each
    part is also padded to its own bucket (packing.bucketed), so parts a few tokens apart
    could run a bucket apart: 0-13 % of a step's wall with one thread waiting on a Zen 4
    EPYC (bf16). The most even split also gives the smallest larger bucket (bucketed is
    monotone). Measured there over 38 steps: the waiting 2.7 -> 0.9 % of the two threads'
    time, twice the larger part's padded tokens 1.049 -> 1.030 of the real ones; steps 1.06x
    and 0.99x in two A/Bs of four rounds (bench/training_ab.py; docs/benchmarks.md), within
    that guest's noise. Found by the sums each prefix of the rows can reach (bits of one
    integer, shifted by each length), then the rows of one reaching the target, walked back:
    deterministic, a few microseconds."""
    reach = [1]  # reach[i]: bit t set where some subset of rows [0, i) sums to t
    for n in lengths:
        reach.append(reach[-1] | (reach[-1] << n))
    half = sum(lengths) // 2
    target = (reach[-1] & ((1 << (half + 1)) - 1)).bit_length() - 1
    first: list[int] = []
    for i in range(len(lengths) - 1, -1, -1):
        if not (reach[i] >> target) & 1:  # row i is needed to reach the target
            first.append(i)
            target -= lengths[i]
    first.reverse()
    taken = set(first)
    return [first, [i for i in range(len(lengths)) if i not in taken]]


def part_threads(threads: int) -> tuple[int, ...]:
    """The threads of a two-part pass's parts, of `threads` in all: the calling thread's part
    (with the odd one) and the helper's; none below two threads (no parts)."""
    return (threads - threads // 2, threads // 2) if threads >= 2 else ()


def _in_parts(
    runtime: Runtime,
    works: Sequence[ForwardBackwardWork],
    parts: list[_Part],
    tally: _Tally,
) -> None:
    """Two parts' passes at once, the second on the helper thread, each with half the threads
    (the calling thread keeps the odd one); then the accounts of every request over both.

    Each part runs its forward and backward without waiting for the other: its backward
    leaves out the requests whose loss failed or is not finite in its own rows. A request
    that fails in one part after the other trained its rows has its error raised here, so
    the caller drops the micro-batch's gradients and runs each request alone
    (`_isolated_micro_batch`): a failing request trains in no part."""
    threads = torch.get_num_threads()
    mine, its = part_threads(threads)
    failed = tally.failed
    earlier = frozenset(failed)  # failed in an earlier micro-batch: trained in no part
    first, second = parts
    try:
        _both(
            _helper_thread().submit(_part_on_thread, its, runtime, works, second, earlier),
            _part_on_thread,
            mine,
            runtime,
            works,
            first,
            earlier,
        )
    finally:
        torch.set_num_threads(threads)  # (the helper's count is set at each of its passes)
    _account(works, parts, tally)
    for part in parts:
        for wi in part.trained:
            if wi in failed:
                raise failed[wi]


def _part_pass(
    runtime: Runtime,
    works: Sequence[ForwardBackwardWork],
    part: _Part,
    earlier: frozenset[int],
) -> None:
    """A part's forward and backward, the latter over the requests that may train in it."""
    _forward(runtime, works, part)
    totals: list[torch.Tensor] = []
    for wi, (vec, _) in part.per_work.items():
        if wi in earlier or works[wi].forward_only or not np.isfinite(part.values[wi]).all():
            continue
        totals.append(vec.sum())
        part.trained.add(wi)
    _backward(part, totals)


def _part_on_thread(
    threads: int,
    runtime: Runtime,
    works: Sequence[ForwardBackwardWork],
    part: _Part,
    earlier: frozenset[int],
) -> None:
    """`_part_pass` on the calling thread with `threads` threads, under the part's routing."""
    use_threads(threads)
    with _entered(runtime, part):
        _part_pass(runtime, works, part, earlier)


def use_threads(threads: int) -> None:
    """torch.set_num_threads for the calling thread, one that may be new. torch sets a thread's
    count lazily, at its first get_num_threads, to the last count set by any thread: on a new
    thread (the helper's first pass) a count set before that was undone whenever the engine
    thread had set another since (at 3 threads the helper's part of 1 could run on the
    engine thread's 2). Reading the count first makes that happen before the count is set."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def _both(other: concurrent.futures.Future[Any], step: Any, *args: Any) -> None:
    """`step(*args)` here while `other` runs on the helper thread; returns once both are done,
    raising the first error (this thread's first)."""
    try:
        step(*args)
    finally:
        error = other.exception()  # waits: the helper never outlives the pass
    if error is not None:
        raise error


def _helper_thread() -> concurrent.futures.ThreadPoolExecutor:
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = concurrent.futures.ThreadPoolExecutor(1, "tuneloop-train-part")
        return _helper


def _prepare(
    runtime: Runtime,
    works: Sequence[ForwardBackwardWork],
    rows_of: list[TrainRow],
    index: list[int],
    budget: int,
) -> _Part:
    """The inputs on the device, routing and layout of the part of `rows_of` at `index`."""
    device = runtime.device
    micro = [rows_of[i] for i in index]
    needs_grad = any(not works[r.work_index].forward_only for r in micro)
    lengths = [len(r.tokens) for r in micro]
    row_targets = [r.inputs["target_tokens"] for r in micro]
    keys: list[str | None] = [r.key for r in micro]
    positions: torch.Tensor | None = None
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
        positions = packed_positions(lengths, device)
    else:
        input_ids = pad_rows([r.tokens for r in micro], runtime.pad_id, device)
        targets = pad_targets(row_targets, input_ids.shape[1], device)
        offsets = [(i, 0) for i in range(len(micro))]
    routing = runtime.bank.routing(keys, lengths if runtime.packed else None)
    return _Part(micro, index, routing, lengths, input_ids, targets, positions, offsets, needs_grad)


@contextlib.contextmanager
def _entered(runtime: Runtime, part: _Part) -> Iterator[None]:
    """The part's routing, packed segments and grad mode, on this thread."""
    segments: Any = packed_segments(part.lengths) if runtime.packed else contextlib.nullcontext()
    with runtime.bank.using(part.routing), segments, torch.set_grad_enabled(part.needs_grad):
        yield


def _forward(runtime: Runtime, works: Sequence[ForwardBackwardWork], part: _Part) -> None:
    """The part's logprobs and every request's losses, and one copy to the host for every loss
    value and logprob of the part (a per-datum float() and .cpu() waited on the device twice
    per datum). A request whose loss raises (e.g. an unknown loss) is in `part.errors`."""
    micro = part.micro
    all_lp = target_logprobs(
        runtime.model, part.input_ids, part.lengths, part.targets, part.positions
    )
    by_work: dict[int, list[int]] = {}
    for i, row in enumerate(micro):
        target = row.inputs["target_tokens"]
        batch_row, start = part.offsets[i]
        lp = all_lp[
            batch_row,
            start : start + len(row.tokens),
            : (1 if target.ndim == 1 else target.shape[1]),
        ]
        part.views.append(lp[:, 0] if target.ndim == 1 else lp)
        by_work.setdefault(row.work_index, []).append(i)
    # Every request's datums in one pass each (losses.batch_losses).
    for wi, members in by_work.items():
        try:
            part.per_work[wi] = batch_losses(
                works[wi],
                [part.views[i] for i in members],
                [micro[i].inputs for i in members],
                runtime.device,
            )
        except EngineError as exc:
            part.errors[wi] = exc
    host = (
        torch.cat(
            [vec.detach().to(torch.float32) for vec, _ in part.per_work.values()]
            + [lp.detach().to(torch.float32).reshape(-1) for lp in part.views]
        )
        .cpu()
        .numpy()
    )
    at = 0
    for wi, (vec, _) in part.per_work.items():
        part.values[wi], at = host[at : at + vec.shape[0]], at + vec.shape[0]
    for lp in part.views:
        size = lp.numel()
        part.row_lp.append(host[at : at + size].reshape(tuple(lp.shape)))
        at += size


def _account(
    works: Sequence[ForwardBackwardWork],
    parts: list[_Part],
    tally: _Tally,
) -> list[list[int]]:
    """Every request's losses, metrics and logprobs over the parts, in the micro-batch's row
    order; per part, the requests its backward pass takes (none that failed in any part)."""
    failed = tally.failed
    for part in parts:
        for wi, exc in part.errors.items():
            failed.setdefault(wi, exc)
    # per request, its datums in row order: (row, part number, the datum's place in that
    # part's values of the request, its row in the part)
    datums: dict[int, list[tuple[int, int, int, int]]] = {}
    for n, part in enumerate(parts):
        seen: dict[int, int] = {}
        for i, (row, train_row) in enumerate(zip(part.index, part.micro, strict=True)):
            wi = train_row.work_index
            if wi in part.per_work:
                datums.setdefault(wi, []).append((row, n, seen.get(wi, 0), i))
                seen[wi] = seen.get(wi, 0) + 1
    takes: list[list[int]] = [[] for _ in parts]
    for wi, places in sorted(datums.items(), key=lambda item: min(item[1])):
        work = works[wi]
        if wi in failed:  # in an earlier micro-batch of this request, or its loss raised
            continue
        places.sort()
        values = [parts[n].values[wi][k] for _, n, k, _ in places]
        if not np.isfinite(values).all():
            failed.setdefault(
                wi, EngineError(f"the {work.loss_fn} loss is not finite for this request", "user")
            )
            continue
        tally.losses[wi] += sum(float(v) for v in values)
        sums = tally.metric_sums[wi]
        for _, n, k, i in places:
            for key, metric in parts[n].per_work[wi][1][k].items():
                sums[key] = sums.get(key, 0.0) + metric
            tally.logprobs[wi].append(parts[n].row_lp[i])
        if not work.forward_only:
            for n in sorted({n for _, n, _, _ in places}):
                takes[n].append(wi)
    return takes


def _backward(part: _Part, totals: list[torch.Tensor]) -> None:
    """The part's backward pass, inside its routing block: checkpointed LM-head chunks
    recompute through the same adapters."""
    if part.needs_grad and totals:
        torch.stack(totals).sum().backward()
