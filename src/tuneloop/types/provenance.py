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


@dataclass(frozen=True, kw_only=True)
class SampledProvenanceSpan:
    """Positions `[offset, offset + length)` of the tokens sampled as `sequence_id`."""

    sequence_id: str
    length: int
    offset: int = 0


ProvenanceSpan = PromptProvenanceSpan | SampledProvenanceSpan
