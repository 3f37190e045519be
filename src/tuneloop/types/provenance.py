"""Provenance spans: where each position of a datum came from (a sampling request's prompt, or
a sampled sequence's tokens), named by the `sequence_id` sampling returned.

They tile, in order, a datum's input tokens (`model_input_spans`) and the rows of its
`target_tokens` (`loss_fn_input_spans`). The `stable_reinforce` loss needs them to find what the
server recorded when it sampled those sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PromptProvenanceSpan", "ProvenanceSpan", "SampledProvenanceSpan"]


@dataclass(frozen=True, kw_only=True)
class PromptProvenanceSpan:
    """Positions `[offset, offset + length)` of the prompt of the request that sampled
    `sequence_id`."""

    sequence_id: str
    length: int
    offset: int = 0

    def __post_init__(self) -> None:
        _check(self, "PromptProvenanceSpan")


@dataclass(frozen=True, kw_only=True)
class SampledProvenanceSpan:
    """Positions `[offset, offset + length)` of the tokens sampled as `sequence_id`."""

    sequence_id: str
    length: int
    offset: int = 0

    def __post_init__(self) -> None:
        _check(self, "SampledProvenanceSpan")


def _check(span: PromptProvenanceSpan | SampledProvenanceSpan, kind: str) -> None:
    # As the official SDK does: a malformed span fails where it is built, not as a 400 later.
    if not span.sequence_id:
        raise ValueError(f"{kind}.sequence_id must be non-empty")
    if span.length < 0:
        raise ValueError(f"{kind}.length must be >= 0, got {span.length}")
    if span.offset < 0:
        raise ValueError(f"{kind}.offset must be >= 0, got {span.offset}")


ProvenanceSpan = PromptProvenanceSpan | SampledProvenanceSpan
