"""Which adapter each row of a batch uses: segments of consecutive rows, and their index tensors.

The engine lays a batch out request by request, so one adapter's rows are consecutive: a
routing is a list of segments (key, start, end) over the rows of the flattened leading
dimensions (a batch row of a padded [B, T] batch, or a token of a packed [1, T] row). That is
the layout of the SGMV kernels (segment offsets plus one adapter index per segment); the
per-token index (`token_slots`) is what a BGMV kernel and the expert layers take.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import torch

if TYPE_CHECKING:
    from tuneloop.server.engine.lora.fused import FusedLinear
    from tuneloop.server.engine.lora.segments import KeyDeltas, Segment

__all__ = ["LoneWeights", "Routing", "RoutingContext"]

LoneWeights: TypeAlias = "dict[int, tuple[FusedLinear, int]]"


@dataclass
class Routing:
    """Segments of rows, one adapter key each (None: the base model alone)."""

    runs: list[tuple[str | None, int, int]] = field(default_factory=list)
    # Per layer, the stacked factors of the grouped path, built once per routed block (a whole
    # decode loop): re-stacking them every step cost more than the matmuls they replace.
    stacked: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )
    # (layer, slot) -> its factors in the compute dtype (bf16 activations: bf16 products), cast
    # once per routed block from the fp32 masters; autograd carries the gradients back to them.
    cast: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Layer id -> (its group of sibling layers, its index there) with the block's one key
    # (`AdapterBank.lone_weights`): set by a decode step whose rows all use one frozen adapter
    # or the base model; those layers then run one matmul a group and no separate products.
    lone: LoneWeights | None = None
    # The same for a decode step of several keys (`AdapterBank.shared_weights`): the layers'
    # base outputs from the base model's stacked, packed weights, each key's deltas (or the
    # layers' products) added.
    shared: LoneWeights | None = None
    # With `shared`, per run (start, end, its key's deltas: `AdapterBank.deltas`) where every
    # key has them: each sibling group then adds its keys' deltas to its shared output
    # (segments.py) instead of each layer's products. None: the products.
    deltas: list[tuple[int, int, KeyDeltas]] | None = None
    # Sibling groups' outputs computed by their first member for one input and not yet taken
    # by the others (siblings.py): group id -> (the input, the outputs left).
    siblings: dict[int, tuple[torch.Tensor, list[torch.Tensor | None]]] = field(
        default_factory=dict
    )
    # A sampling step's routing (model_runner.py): its layers run per step, where a copy of a
    # weight per call (the one-adapter node's at half precision) would cost more than a step.
    steps: bool = False
    # (tokens, device) -> per-token segment index, built once per routed block as well.
    _token_index: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # Layer id -> its group's segments of `deltas`, built once per routed block.
    _segments: dict[int, list[Segment]] = field(default_factory=dict)

    @classmethod
    def from_rows(cls, row_keys: Sequence[str | None]) -> Routing:
        runs: list[tuple[str | None, int, int]] = []
        for index, key in enumerate(row_keys):
            if runs and runs[-1][0] == key:
                runs[-1] = (key, runs[-1][1], index + 1)
            else:
                runs.append((key, index, index + 1))
        return cls(runs)

    @classmethod
    def from_lengths(cls, keys: Sequence[str | None], lengths: Sequence[int]) -> Routing:
        """Token runs of a packed row: segment i, of lengths[i] tokens, uses keys[i]."""
        runs: list[tuple[str | None, int, int]] = []
        start = 0
        for key, length in zip(keys, lengths, strict=True):
            if runs and runs[-1][0] == key:
                runs[-1] = (key, runs[-1][1], start + length)
            else:
                runs.append((key, start, start + length))
            start += length
        return cls(runs)

    @property
    def keys(self) -> list[str | None]:
        """The distinct keys, in order of first use."""
        return list(dict.fromkeys(key for key, _, _ in self.runs))

    def sizes(self, tokens: int) -> list[int]:
        """Each segment's size in tokens, for a flattened input of `tokens` tokens."""
        per_row = tokens // self.runs[-1][2]
        return [(end - start) * per_row for _, start, end in self.runs]

    def use_deltas(self, tables: Sequence[KeyDeltas] | None) -> None:
        """Set `deltas` from each run's key's table (None: the products), keeping the
        segments built while the tables are the same objects."""
        if tables is None:
            self.deltas = None
        else:
            same = self.deltas is not None and len(self.deltas) == len(tables)
            same = same and all(
                held[2] is table for held, table in zip(self.deltas or [], tables, strict=False)
            )
            if same:
                return
            self.deltas = [
                (start, end, table)
                for (_, start, end), table in zip(self.runs, tables, strict=True)
            ]
        self._segments.clear()

    def segments(self, layer: int) -> list[Segment]:
        """The runs of `deltas` as segments of the layer's group (id `layer`): (start, end,
        that key's delta of the group, None where it has none)."""
        found = self._segments.get(layer)
        if found is None:
            assert self.deltas is not None, "segments are asked where deltas are set"
            found = [(start, end, table.get(layer)) for start, end, table in self.deltas]
            self._segments[layer] = found
        return found

    def token_keys(self, tokens: int, device: torch.device) -> torch.Tensor:
        """Per token, the index of its key in `keys` ([tokens] int64, on `device`)."""
        cache_key = (tokens, str(device))
        index = self._token_index.get(cache_key)
        if index is None:
            order = {key: i for i, key in enumerate(self.keys)}
            ids = torch.tensor([order[key] for key, _, _ in self.runs], dtype=torch.long)
            index = ids.repeat_interleave(torch.tensor(self.sizes(tokens))).to(device)
            self._token_index[cache_key] = index
        return index


class RoutingContext:
    """The routing in force, shared by every adapted layer of one model (set once per block).

    Per thread: a CPU training pass may run parts of one batch on two threads at once
    (training.py), each part under its own routing."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def routing(self) -> Routing | None:
        routing: Routing | None = getattr(self._local, "routing", None)
        return routing

    @routing.setter
    def routing(self, routing: Routing | None) -> None:
        self._local.routing = routing
