"""A sequence in the paged cache: its tokens, its block table, what of it is computed.

A request's prompt is one `Sequence` while it is prefilled; once its last prompt token is
computed it forks into one sequence per sample, sharing the prompt's blocks (`Decoder`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Sequence"]


@dataclass(eq=False)
class Sequence:
    tokens: list[int]  # prompt, then the sampled tokens fed back
    key: str | None  # the adapter its tokens are routed through (None: the base model)
    table: list[int] = field(default_factory=list)  # block ids, in token order
    computed: int = 0  # leading tokens whose keys and values are in the pool
    reserved: int = 0  # blocks still reserved for it in the block manager
    sealed: int = 0  # leading full blocks made findable by the prefix cache

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def uncomputed(self) -> int:
        return len(self.tokens) - self.computed
