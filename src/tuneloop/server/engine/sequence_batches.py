"""A packed row's sequences gathered into batches of one length for the attention kernels.

A training batch packs its sequences end to end in one row (packing.py), and each sequence
attends within itself: one attention call per sequence per layer, each way. An RL batch of
many short sequences (128 of 9-13 tokens: a group of sampled answers) then spends a layer's
attention on the calls' fixed costs, not their arithmetic. Here the sequences of one length
(rounded up to a `granule` of tokens, with zero rows past their ends where the kernel masks
them) run as one batch of the kernel, their tokens gathered into it by one index and its
outputs put back in the packed order by another. A batch's items are separate products of one
shape, so a sequence gets the bits it gets alone (tests/unit/engine/test_sequence_batches.py
compares).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["MIN_BATCH", "Plan", "attend", "plan", "rounded_up"]

# The fewest sequences a batch gathers: gathering and putting back costs a few operations a
# layer each way, about what a sequence's own call costs in fp32 SDPA on a CPU (8 sequences
# of 8-16 tokens through a 36-layer model: batches of 2-3 ran 0.96x the calls one by one).
MIN_BATCH = 4

# (q, k, v) of a batch [count, heads, length, d] -> its outputs [count, length, heads, d]
BatchKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (q, k, v) of one sequence [1, heads, length, d] -> its outputs [1, length, heads, d]
OneKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Plan:
    """Where `attend` reads and writes the tokens of one packing of sequences."""

    # (length, sequences, [sequences x length] indices into the packed tokens, where a padded
    # row reads the zero row at the end), a batch per length that several sequences share
    batches: tuple[tuple[int, int, torch.Tensor], ...]
    alone: tuple[int, ...]  # the sequences run one by one (a length few share), in order
    # [total]: each packed token's row in the parts' outputs, in turn; None: the same row
    order: torch.Tensor | None
    _on: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = field(
        default_factory=dict, compare=False
    )

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batches' indices one after another and `order`, on `device` (copied there
        once); for a plan with batches."""
        found = self._on.get(device)
        if found is None:
            found = self._on[device] = (
                torch.cat([index for _, _, index in self.batches]).to(device),
                None if self.order is None else self.order.to(device),
            )
        return found


def rounded_up(length: int, granule: int) -> int:
    """`length` rounded up to a multiple of `granule`."""
    return -(-length // granule) * granule


@functools.lru_cache(maxsize=16)
def plan(lengths: tuple[int, ...], granule: int = 1, limit: int | None = None) -> Plan:
    """How `attend` runs sequences of `lengths` tokens packed end to end: those of one length
    rounded up to `granule` tokens in one batch (MIN_BATCH of them at least), those longer
    than `limit` (None: no limit) or of a length too few others have one by one; sequences of
    no tokens have no output."""
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    total = int(starts[-1])
    grouped: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        if not length:
            continue
        batchable = limit is None or length <= limit
        grouped.setdefault(rounded_up(length, granule) if batchable else -i - 1, []).append(i)
    alone = sorted(i for members in grouped.values() if len(members) < MIN_BATCH for i in members)
    order = np.empty(total, dtype=np.int64)
    batches = []
    row = 0
    for padded, members in grouped.items():
        if len(members) < MIN_BATCH:
            continue
        index = np.full((len(members), padded), total, dtype=np.int64)
        for j, i in enumerate(members):
            span = np.arange(starts[i], starts[i + 1])
            index[j, : len(span)] = span
            order[span] = row + j * padded + np.arange(len(span))
        batches.append((padded, len(members), torch.from_numpy(index.reshape(-1))))
        row += len(members) * padded
    for i in alone:
        order[starts[i] : starts[i + 1]] = row + np.arange(lengths[i])
        row += lengths[i]
    same = bool((order == np.arange(total)).all())
    return Plan(tuple(batches), tuple(alone), None if same else torch.from_numpy(order))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: Sequence[int],
    how: Plan,
    batch: BatchKernel,
    one: OneKernel,
) -> torch.Tensor:
    """The attention of each sequence packed in q [1, heads, total, d] and k, v [1, key heads,
    total, d] as `how` says: `batch` for a batch of one length, `one` for a sequence alone;
    [1, total, heads, d]."""
    dim = q.shape[3]
    rows: list[torch.Tensor] = []  # each part's outputs, [tokens, heads, d]
    order = None  # (a plan without batches keeps the packed order)
    if how.batches:
        indices, order = how.indices(q.device)
        # One gather per tensor for every batch, then a split: each gather's backward adds
        # into a zero-filled tensor of the full packed size, a split's concatenates. The
        # padded rows read one zero row past the end.
        sizes = [count * padded for padded, count, _ in how.batches]
        gathered = [
            torch.nn.functional.pad(t, (0, 0, 0, 1)).index_select(2, indices).split(sizes, 2)
            for t in (q, k, v)
        ]
        for b, (padded, count, _) in enumerate(how.batches):
            parts = [g[b].view(g[b].shape[1], count, padded, dim).transpose(0, 1) for g in gathered]
            rows.append(batch(*parts).reshape(count * padded, -1, dim))
    if how.alone:
        # One split per tensor, not a slice per sequence: a slice's backward writes its
        # gradient into a zero-filled tensor of the full packed size, a split's concatenates.
        splits = [t.split(list(lengths), 2) for t in (q, k, v)]
        for i in how.alone:
            # (a view, not `[0]`: a select's backward writes into a zero-filled tensor)
            rows.append(one(splits[0][i], splits[1][i], splits[2][i]).squeeze(0))
    if not rows:  # no tokens
        return q.transpose(1, 2)
    flat = rows[0] if len(rows) == 1 else torch.cat(rows)
    return (flat if order is None else flat.index_select(0, order))[None]
