"""One forward pass of a sampling step over the paged KV cache (nano-vllm's ModelRunner).

The scheduled work of a step (each decoding row's one new token, and a chunk of each joining
prompt) is laid out end to end in one packed row with no padding; every token gets its slot in
the pool from its sequence's block table. The model runs once, under the paged attention
(kv/paged_attention.py) and the LoRA routing of the rows' adapters, and returns the logits of
the last token of each sequence that asked for them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from tuneloop.server.engine import decode_layers, native, native_draw
from tuneloop.server.engine.decode_graphs import DecodeGraphs, StaticStep
from tuneloop.server.engine.fused_head import chunked_logits, head_parts
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
        # How a step whose rows all use one key (a frozen adapter or the base model) runs its
        # linear layers (`AdapterBank.lone_weights`): "fused", sibling layers stacked into one
        # matmul with the adapter's delta in extra columns (exact products); "merged", the
        # delta merged into the weights (rounded to their dtype); None, the base layers and
        # the LoRA products. Set by the runtime.
        self.lone_weights: str | None = None
        # The decode rows' attention kernel (kv/decode_attention.py), or None for the
        # reference's gather + SDPA. Set by the runtime.
        self.decode_kernel: Callable[..., torch.Tensor] | None = None
        # The decoder layers as one lean loop of their kernels for the steps it takes
        # (decode_layers.py), or None. Set by the runtime.
        self.layers: decode_layers.Plan | None = None
        # Steps of decode rows alone replayed as CUDA graphs (decode_graphs.py) while
        # `graphs_on`; None until first asked for. Set by the runtime (`use_graphs`).
        self.graphs: DecodeGraphs | None = None
        self.graphs_on = False
        self.forwards = 0  # forward passes run (tests count prefills with it)
        self.tokens = 0  # tokens run through the model
        # The routings of the last step, reused while the layout of adapters is the same: its
        # stacked factors (grouped LoRA) cost more to rebuild every step than they save.
        # One for the transformer body (all tokens), one for the head (one row per sequence).
        self._body: dict[str, Any] = {}
        self._head: dict[str, Any] = {}

    def _route(self, held: dict[str, Any], keys: list[str | None], lengths: list[int]) -> Routing:
        layout = tuple(zip(keys, lengths, strict=True))
        if held.get("layout") != layout:
            routing = Routing.from_lengths(keys, lengths)
            routing.steps = True
            held["layout"], held["routing"] = layout, routing
        routing = held["routing"]
        lone = routing.keys
        if self.lone_weights is not None and len(lone) == 1:
            # Asked every step, not once per layout: a sampler made again under the same id
            # (new factors), or a base weight changed in place, makes the bank build anew.
            routing.lone = self.bank.lone_weights(lone[0], merge=self.lone_weights == "merged")
        elif self.lone_weights is not None:
            routing.shared = self.bank.shared_weights()  # (None: the layers' own weights)
            # each key's deltas added per group (segments.py) where every key has them; asked
            # every step too (a key's factors may be set anew)
            # (once per key, not per run)
            found = {} if routing.shared is None else {k: self.bank.deltas(k) for k in lone}
            ready = {key: table for key, table in found.items() if table is not None}
            if routing.shared is None or len(ready) < len(lone):
                routing.use_deltas(None)
            else:
                routing.use_deltas([ready[key] for key, _, _ in routing.runs])
        return routing

    def forget_routings(self) -> None:
        """Drop the routings held for the next steps (and the lone key's weights they hold):
        the next step routes anew. Decode graphs hold routings of their own."""
        self._body.clear()
        self._head.clear()

    def use_graphs(self, on: bool, *, capture: bool = True) -> None:
        """Decode steps as CUDA graphs (`capture=False`: the same padded static steps run
        eagerly, which the tests compare with the plain step) or not. Graphs made before are
        kept while off (a call with them off, then on again, captures nothing anew)."""
        self.graphs_on = on
        if on and (self.graphs is None or self.graphs.capture != capture):
            self.graphs = DecodeGraphs(self, capture=capture)

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        size = self.pool.block_size
        positions = np.arange(start, end)
        return np.asarray(seq.table, dtype=np.int64)[positions // size] * size + positions % size

    def _step(self, work: Seq[Scheduled]) -> tuple[PagedStep, list[int], list[int]]:
        """The step's attention metadata, its tokens and their positions."""
        tokens: list[int] = []
        positions: list[int] = []
        slot_mapping: list[np.ndarray] = []
        # one-token items' slots, a Python int each (a decode step's 128 rows through _slots'
        # arrays took ~0.4 ms a step of ~50 on a Zen 5 EPYC), joined before each longer item's
        singles: list[int] = []
        size = self.pool.block_size
        prefills: list[Prefill] = []
        decoding = 0
        for item in work:
            seq, start = item.seq, item.seq.computed
            end = start + item.length
            tokens += seq.tokens[start:end]
            positions += range(start, end)
            if item.length == 1:
                singles.append(int(seq.table[start // size]) * size + start % size)
            else:
                if singles:
                    slot_mapping.append(np.array(singles, dtype=np.int64))
                    singles = []
                slot_mapping.append(self._slots(seq, start, end))
            if item.length == 1 and not prefills:
                decoding += 1
            else:
                slots = torch.from_numpy(self._slots(seq, 0, end)).to(self.device)
                prefills.append(Prefill(len(tokens) - item.length, item.length, slots, end))
        # Decode rows: every row's slots, gathered to the longest context of the step.
        contexts = np.array([i.seq.computed + 1 for i in work[:decoding]], dtype=np.int64)
        width = int(contexts.max()) if decoding else 0
        decode_slots, decode_mask = self.decode_layout(
            [i.seq for i in work[:decoding]], contexts, width
        )
        flash = self._flash_metadata(work) if self.kernel else None
        mapping = np.concatenate([*slot_mapping, np.array(singles, dtype=np.int64)])
        step = PagedStep(
            self.pool,
            torch.from_numpy(mapping).to(self.device),
            decoding,
            torch.from_numpy(np.ascontiguousarray(decode_slots)).to(self.device),
            torch.from_numpy(decode_mask[:, None, None, :]).to(self.device),
            prefills,
            flash,
            self.decode_kernel,
        )
        return step, tokens, positions

    def decode_layout(
        self, seqs: Seq[Sequence], contexts: np.ndarray, width: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Decode rows' slots [rows, width] and mask: row i reads the first contexts[i] slots
        of its block table, and past its context the zero pad slot, never a block's stale
        (maybe NaN) slots."""
        size = self.pool.block_size
        blocks = -(-width // size)
        tables = np.zeros((len(seqs), blocks), dtype=np.int64)
        for row, seq in enumerate(seqs):
            used = -(-int(contexts[row]) // size)
            tables[row, :used] = seq.table[:used]
        slots_of_rows = tables[:, :, None] * size + np.arange(size)  # [rows, blocks, size]
        slots = slots_of_rows.reshape(len(seqs), blocks * size)[:, :width]
        mask = np.arange(width)[None, :] < contexts[:, None]
        return np.where(mask, slots, self.pool.pad_slot), mask

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
        """Run the step; returns the logits [len(wanting), V] of the items that want them, in
        order (fp32, or bf16 for the native draw: `_logits`), and marks every item's tokens
        computed."""
        if self.graphs is not None and self.graphs_on:
            logits = self.graphs.run(work)
            if logits is not None:
                return logits
        step, tokens, positions = self._step(work)
        ends = list(itertools.accumulate(i.length for i in work))
        keep = [end - 1 for end, item in zip(ends, work, strict=True) if item.wants_logits]
        keys = [i.seq.key for i in work]
        body_routing = self._route(self._body, keys, [i.length for i in work])
        decoder: nn.Module = self.model.get_decoder()  # type: ignore[operator]
        lean = self._lean_weights(body_routing)
        input_ids = torch.tensor([tokens], device=self.device)
        position_ids = torch.tensor([positions], device=self.device)
        with self.bank.using(body_routing), paged(self.model), native.sampling_step():
            if lean is not None:
                hidden = decode_layers.run(lean[0], lean[1], input_ids, position_ids, step)
            else:
                hidden = decoder(
                    input_ids=input_ids, position_ids=position_ids, use_cache=False, paged_step=step
                ).last_hidden_state[0]
        self.forwards += 1
        self.tokens += len(tokens)
        for item in work:
            item.seq.computed += item.length
        if not keep:
            return hidden.new_zeros((0, 0), dtype=torch.float32)
        # The LM head runs on the last token of each sequence that wants logits, routed by those
        # rows' adapters (an adapter may train the head too).
        wanting = [k for k, item in zip(keys, work, strict=True) if item.wants_logits]
        head_routing = self._route(self._head, wanting, [1] * len(wanting))
        if len(keep) < hidden.shape[0]:  # (a decode step's rows all want theirs: no copy)
            hidden = hidden[torch.tensor(keep, device=self.device)]
        return self._logits(hidden, head_routing)

    def _lean_weights(
        self, routing: Routing
    ) -> tuple[decode_layers.Plan, list[decode_layers.LayerWeights]] | None:
        """The plan and the layers' weights where the lean loop takes the step: one key's
        fused weights in `routing.lone`, or the shared base weights with each key's deltas
        (`routing.deltas`), grouped as it computes them (`Plan.weights`). They are held with
        the routing, while the table (and the deltas) are the same."""
        plan = self.layers
        table = routing.lone
        if table is None and routing.deltas is not None:
            table = routing.shared
        if plan is None or table is None:
            return None
        held = self._body.get("layers")
        if held is None or held[0] is not table:
            held = self._body["layers"] = (table, plan.weights(table))
        if held[1] is None:
            return None
        if routing.lone is not None:
            return plan, held[1]
        segmented = self._body.get("segmented")
        if segmented is None or segmented[0] is not held[1] or segmented[1] is not routing.deltas:
            segmented = (held[1], routing.deltas, plan.segmented(held[1], routing))
            self._body["segmented"] = segmented
        return plan, segmented[2]

    def _logits(self, last: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Logits of the rows' last hidden states [rows, hidden], the head routed by
        `routing` (one row per sequence): fp32, or the head's own bf16 output where the CPU's
        native draw reads it as it is (native_draw.py: an fp32 copy of 128 x 49,152 logits
        cost 2.5 ms a step)."""
        head: nn.Module = self.model.get_output_embeddings()  # type: ignore[operator]
        softcap = getattr(self.model.config, "final_logit_softcapping", None)
        with self.bank.using(routing):
            parts = head_parts(head, last)
            if parts:
                logits = chunked_logits(parts, last)
            else:
                logits = head(last[None])[0]
                if softcap or not native_draw.takes(logits):
                    logits = logits.float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    @torch.no_grad()
    def forward_static(self, static: StaticStep) -> torch.Tensor:
        """A decode step on a graph's static inputs (decode_graphs.py): the forward pass and the
        head, every padded row's logits [rows, V] (as `_logits` gives them). Captured on CUDA;
        run as it is on the CPU (`use_graphs(capture=False)`)."""
        step = PagedStep(
            self.pool, static.slot_mapping, static.rows, static.decode_slots, static.decode_mask
        )
        decoder: nn.Module = self.model.get_decoder()  # type: ignore[operator]
        with self.bank.using(static.body), paged(self.model):
            hidden = decoder(
                input_ids=static.ids,
                position_ids=static.positions,
                use_cache=False,
                paged_step=step,
            ).last_hidden_state[0]
        return self._logits(hidden, static.head)
