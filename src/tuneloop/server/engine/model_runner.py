"""One forward pass of a sampling step over the paged KV cache (nano-vllm's ModelRunner).

The scheduled work of a step (each decoding row's one new token, and a chunk of each joining
prompt) is laid out end to end in one packed row with no padding; every token gets its slot in
the pool from its sequence's block table. The model runs once, under the paged attention
(kv/paged_attention.py) and the LoRA routing of the rows' adapters, and returns the logits of
the last token of each sequence that asked for them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from tuneloop.server.engine.kv.paged_attention import KVPool, PagedStep, Prefill, paged
from tuneloop.server.engine.kv.sequence import Sequence
from tuneloop.server.engine.lora import AdapterBank, Routing

__all__ = ["ModelRunner", "Scheduled"]


@dataclass
class Scheduled:
    """A sequence's part of a step: its next `length` uncomputed tokens."""

    seq: Sequence
    length: int
    wants_logits: bool  # the chunk ends at the sequence's last token


class ModelRunner:
    def __init__(self, model: nn.Module, bank: AdapterBank, pool: KVPool, kernel: bool) -> None:
        self.model, self.bank, self.pool, self.kernel = model, bank, pool, kernel
        self.device = pool.device
        self.forwards = 0  # forward passes run (tests count prefills with it)
        self.tokens = 0  # tokens run through the model
        # The routing of the last step, reused while the layout of adapters is the same: its
        # stacked factors (grouped LoRA) cost more to rebuild every step than they save.
        self._routing: tuple[tuple[tuple[str | None, int], ...], Routing] | None = None

    def _route(self, keys: list[str | None], lengths: list[int]) -> Routing:
        layout = tuple(zip(keys, lengths, strict=True))
        if self._routing is None or self._routing[0] != layout:
            self._routing = (layout, Routing.from_lengths(keys, lengths))
        return self._routing[1]

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        size = self.pool.block_size
        positions = np.arange(start, end)
        return np.asarray(seq.table, dtype=np.int64)[positions // size] * size + positions % size

    def _step(self, work: Seq[Scheduled]) -> tuple[PagedStep, list[int], list[int]]:
        """The step's attention metadata, its tokens and their positions."""
        size = self.pool.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slot_mapping: list[np.ndarray] = []
        prefills: list[Prefill] = []
        decoding = 0
        for item in work:
            seq, start = item.seq, item.seq.computed
            end = start + item.length
            tokens += seq.tokens[start:end]
            positions += range(start, end)
            slot_mapping.append(self._slots(seq, start, end))
            if item.length == 1 and not prefills:
                decoding += 1
            else:
                slots = torch.from_numpy(self._slots(seq, 0, end)).to(self.device)
                prefills.append(Prefill(len(tokens) - item.length, item.length, slots, end))
        # Decode rows: every row's slots, gathered to the longest context of the step.
        contexts = np.array([i.seq.computed + 1 for i in work[:decoding]], dtype=np.int64)
        width = int(contexts.max()) if decoding else 0
        blocks = -(-width // size)
        tables = np.zeros((decoding, blocks), dtype=np.int64)
        for row, item in enumerate(work[:decoding]):
            used = -(-int(contexts[row]) // size)
            tables[row, :used] = item.seq.table[:used]
        slots_of_rows = tables[:, :, None] * size + np.arange(size)  # [D, blocks, size]
        decode_slots = slots_of_rows.reshape(decoding, blocks * size)[:, :width]
        decode_mask = np.arange(width)[None, :] < contexts[:, None]
        flash = self._flash_metadata(work) if self.kernel else None
        step = PagedStep(
            self.pool,
            torch.from_numpy(np.concatenate(slot_mapping)).to(self.device),
            decoding,
            torch.from_numpy(np.ascontiguousarray(decode_slots)).to(self.device),
            torch.from_numpy(decode_mask[:, None, None, :]).to(self.device),
            prefills,
            flash,
        )
        return step, tokens, positions

    def _flash_metadata(self, work: Seq[Scheduled]) -> dict[str, Any]:
        """The varlen kernel's view of the step: sequence boundaries and block tables."""
        lengths = [i.length for i in work]
        contexts = [i.seq.computed + i.length for i in work]
        longest = max(len(i.seq.table) for i in work)
        table = torch.zeros((len(work), longest), dtype=torch.int32)
        for row, item in enumerate(work):
            table[row, : len(item.seq.table)] = torch.as_tensor(item.seq.table, dtype=torch.int32)

        def cumulative(values: list[int]) -> torch.Tensor:
            return torch.tensor([0, *itertools.accumulate(values)], dtype=torch.int32)

        return {
            "cu_seqlens_q": cumulative(lengths).to(self.device),
            "cu_seqlens_k": cumulative(contexts).to(self.device),
            "max_seqlen_q": max(lengths),
            "max_seqlen_k": max(contexts),
            "block_table": table.to(self.device),
        }

    @torch.no_grad()
    def run(self, work: Seq[Scheduled]) -> torch.Tensor:
        """Run the step; returns fp32 logits [len(wanting), V] of the items that want them, in
        order, and marks every item's tokens computed."""
        step, tokens, positions = self._step(work)
        ends = list(itertools.accumulate(i.length for i in work))
        keep = [end - 1 for end, item in zip(ends, work, strict=True) if item.wants_logits]
        routing = self._route([i.seq.key for i in work], [i.length for i in work])
        with self.bank.using(routing), paged(self.model):
            out = self.model(
                input_ids=torch.tensor([tokens], device=self.device),
                position_ids=torch.tensor([positions], device=self.device),
                use_cache=False,
                paged_step=step,
                logits_to_keep=torch.tensor(keep or [0], device=self.device),
            )
        self.forwards += 1
        self.tokens += len(tokens)
        for item in work:
            item.seq.computed += item.length
        logits: torch.Tensor = out.logits[0].float()
        return logits if keep else logits[:0]
