"""Sampling parameters and results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from tuneloop.types._base import StrictBase
from tuneloop.types.fields import Int64

StopReason = Literal["stop", "length"]
# Top-k matrices are dense N x K; empty cells hold this sentinel pair.
TOPK_SENTINEL = (0, -99999.0)


class SamplingParams(StrictBase):
    max_tokens: Int64 | None = None
    seed: Int64 | None = None
    # None: stop at EOS. []: never stop early, not even at EOS. Strings or token ids.
    stop: str | list[str] | list[Int64] | None = None
    temperature: float = 1.0
    top_k: Int64 = -1
    top_p: float = 1.0


TopkRow = list[tuple[int, float]] | None


@dataclass
class SampledSequence:
    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float] | None = None
    topk_logprobs: list[TopkRow] | None = None
    sequence_id: str | None = None


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]
    # Entry 0 is None (nothing predicts the first token), as are unscored positions.
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[TopkRow] | None = None
    prompt_cache_hit_tokens: int = 0
    type: str = field(default="sample", repr=False)

    @property
    def prompt_logprobs_np(self) -> np.ndarray | None:
        if self.prompt_logprobs is None:
            return None
        return np.array(
            [np.nan if v is None else v for v in self.prompt_logprobs], dtype=np.float32
        )
