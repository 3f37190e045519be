"""A step of several keys: each key's LoRA delta added to its rows of a group's shared output.

A decode step whose rows use two or more keys (tenants sampling at once) takes each sibling
group's base output from the base model's stacked, packed weights (`AdapterBank.
shared_weights`, fused.py). Each key then adds its delta to its own rows' part of that output,
as Punica's and S-LoRA's segmented products do: one product of the rows with the key's
stacked down-projections, `low = x @ A.T` (the native kernel's LoRA part on CPUs with
AVX512-BF16, native_columns.py), and one `addmm_` of `low` with the key's up-projections,
scaled and stacked as the lone key's extra columns are (block-diagonal over the siblings,
fused.py), into the rows' slice of the output. The sum is made in fp32 with the base output
and rounded once, per group rather than per layer: two calls a key and group where the
per-layer products (ops.add_lora) made two to five a key and layer. A key's `KeyDelta`s are
built once per version of its factors (`AdapterBank.deltas`), not per step or layout.

A row's values depend on its own input and its own key's factors alone: the base matmul's
rows are independent, and each key's products read and write only its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tuneloop.server.engine import packed
from tuneloop.server.engine.lora import native_columns
from tuneloop.server.engine.lora.native_columns import DownPairs, UpVectors

__all__ = ["KeyDelta", "KeyDeltas", "Segment", "add", "stacked_up"]


class KeyDelta:
    """One key's LoRA delta of one sibling group: the stacked down-projections A [R, in]
    (`DownPairs` for the native kernels, else packed for oneDNN where the weights pack) and
    the up-projections, scale * B of each member: in the native delta kernel's layout
    (`vectors`) where it takes them, else `up` [R, sum of outputs], each member's in its
    block (the two matmuls' form). One form is kept, not both: a key's deltas are about its
    factors' size in bf16."""

    def __init__(
        self,
        down: torch.Tensor | DownPairs,
        up: torch.Tensor | None,
        vectors: UpVectors | None = None,
    ) -> None:
        if (up is None) == (vectors is None):
            raise ValueError("a key's delta holds its up-projections in one form")
        self.down, self.up, self.vectors = down, up, vectors

    @classmethod
    def build(
        cls,
        sizes: Sequence[int],
        factors: Sequence[tuple[torch.Tensor, torch.Tensor, float] | None],
        dtype: torch.dtype,
        *,
        kernel: bool = True,
    ) -> KeyDelta | None:
        """The delta of a group whose members have `sizes` outputs and these factors (A [r,
        in], B [out, r], scale; None: the key does not adapt that member); None where no
        member is adapted. `kernel=False`: the two matmuls' form even where the native delta
        kernel would take it."""
        found = [(i, f) for i, f in enumerate(factors) if f is not None]
        if not found:
            return None
        device = found[0][1][0].device
        blocks: list[torch.Tensor | None] = [None] * len(sizes)
        with torch.no_grad():
            for index, (_, b, scale) in found:
                # (scale * B in fp32, rounded once: the lone key's columns, fused.py)
                blocks[index] = (b.detach().float() * scale).to(dtype)
            a_all = torch.cat([f[0].detach().to(dtype) for _, f in found])
        if native_columns.available(dtype, device):
            pairs = native_columns.pack(a_all)
            vectors = native_columns.pack_up(list(sizes), blocks, dtype) if kernel else None
            if vectors is not None:
                return cls(pairs, None, vectors)
            return cls(pairs, stacked_up(sizes, blocks, dtype, device))
        return cls(packed.pack(a_all), stacked_up(sizes, blocks, dtype, device))

    @property
    def nbytes(self) -> int:
        down = self.down.pairs if isinstance(self.down, DownPairs) else self.down
        tensors = [down] if self.up is None else [down, self.up]
        if self.vectors is not None:
            tensors += [self.vectors.vectors, self.vectors.col]
        return sum(t.numel() * t.element_size() for t in tensors)

    def add_to(self, y: torch.Tensor, x: torch.Tensor, start: int, end: int) -> None:
        """y[start:end] += this delta of x[start:end], in place (y: the group's output [N,
        outputs], x: its input [N, in])."""
        if self.vectors is not None and isinstance(self.down, DownPairs):
            native_columns.add_delta(y, x, self.down, self.vectors, start, end)
            return
        assert self.up is not None  # (one form or the other: __init__)
        rows = x[start:end]
        if isinstance(self.down, DownPairs):
            low = native_columns.low(rows, self.down)
        else:
            low = packed.linear(rows, self.down, None)
        y[start:end].addmm_(low, self.up)


def stacked_up(
    sizes: Sequence[int],
    blocks: Sequence[torch.Tensor | None],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """[R, sum of outputs] in `dtype`: each adapted member's scale * B [out, r] (any float
    dtype, rounded once here) transposed into its rows (its rank's) and columns (its
    outputs'), zeros elsewhere; transposed, a lone key's extra columns (fused.py)."""
    rank = sum(b.shape[1] for b in blocks if b is not None)
    up = torch.zeros((rank, sum(sizes)), dtype=dtype, device=device)
    row = column = 0
    for size, block in zip(sizes, blocks, strict=True):
        if block is not None:
            up[row : row + block.shape[1], column : column + size] = block.t()
            row += block.shape[1]
        column += size
    return up


# Layer id -> its group's delta for one key (every member of a group maps to the same one).
KeyDeltas = dict[int, KeyDelta]
# The rows [start, end) of a step's flattened input that use one key, with that key's delta
# of the group (None: the base model's rows, or a key that does not adapt the group).
Segment = tuple[int, int, KeyDelta | None]


def add(y: torch.Tensor, x: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
    """y [N, outputs] (the group's fresh base output, updated in place and returned) plus each
    segment's delta of x [N, in] on its rows."""
    for start, end, delta in segments:
        if delta is not None and end > start:
            delta.add_to(y, x, start, end)
    return y
