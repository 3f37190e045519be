"""Stability records for `stable_reinforce`: what the sampler did, kept per `sequence_id`.

Sampling with `record_stability_info=true` records, for every returned sequence, the request's
prompt, the sampled tokens and the logprob the sampler gave each of them (float32, as it drew
them). A `stable_reinforce` datum names its sequences through its provenance spans; the server
checks the datum's tokens against the record (they must be the tokens that were sampled, in the
context they were sampled in) and hands the loss the recorded logprobs, so the importance
weights are taken against what the sampler really computed, not against numbers the client
carried (and may have rounded, or taken from another sampler).

Lifetime (as hosted Tinker's): a record can be trained on for `ttl_s` (a day) after it was
made or last used; each use restarts the day. Memory is bounded by `max_tokens` (prompt +
sampled tokens over all records; the least recently used go first when it is reached). Records
are kept in memory, per tenant, and do not survive a restart of the server: neither do the
sampling sessions that made them (a sampler must be created again after a restart), so a run
resamples anyway. A datum naming a sequence that is unknown, expired, evicted or another
tenant's is refused with a 400 naming the span.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from tuneloop.server.api.errors import bad_request
from tuneloop.server.engine.types import Example, ForwardBackwardWork, SampledTokens
from tuneloop.types import Datum, PromptProvenanceSpan
from tuneloop.types.provenance import ProvenanceSpan

__all__ = ["DAY_S", "StabilityRecord", "StabilityRecords", "attach_stability"]

DAY_S = 86_400.0
# 16M tokens: ~130 MB at 8 bytes a token (id + logprob), plus the shared prompts.
MAX_TOKENS = 16_000_000


@dataclass(frozen=True)
class StabilityRecord:
    tenant: str
    prompt: np.ndarray  # int64 [P], shared by the request's sequences
    tokens: np.ndarray  # int64 [S]
    logprobs: np.ndarray  # float32 [S]

    @property
    def size(self) -> int:
        return int(self.prompt.size + self.tokens.size)


class StabilityRecords:
    """Thread-safe (sampling results arrive on the engine's side of the loop): LRU + TTL."""

    def __init__(
        self,
        ttl_s: float = DAY_S,
        max_tokens: int = MAX_TOKENS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self._clock = clock
        self._lock = threading.Lock()
        self._records: OrderedDict[str, tuple[StabilityRecord, float]] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def tokens(self) -> int:
        return self._tokens

    def record(
        self,
        tenant: str,
        sequence_ids: Sequence[str],
        prompt: np.ndarray,
        sequences: Sequence[SampledTokens],
    ) -> None:
        prompt = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            now = self._clock()
            # (one sequence per id; never raise here: this runs as the sample's answer is built)
            for sequence_id, seq in zip(sequence_ids, sequences, strict=False):
                rec = StabilityRecord(
                    tenant,
                    prompt,
                    np.asarray(seq.tokens, dtype=np.int64),
                    np.asarray(seq.logprobs, dtype=np.float32),
                )
                self._drop(sequence_id)
                self._records[sequence_id] = (rec, now + self.ttl_s)
                self._tokens += rec.size
            self._evict(now)

    def lookup(self, tenant: str, sequence_id: str) -> StabilityRecord | None:
        """The tenant's live record, its day restarted; None if unknown, expired or not theirs."""
        with self._lock:
            now = self._clock()
            entry = self._records.get(sequence_id)
            if entry is None or entry[0].tenant != tenant:
                return None
            if entry[1] <= now:
                self._drop(sequence_id)
                return None
            self._records[sequence_id] = (entry[0], now + self.ttl_s)
            self._records.move_to_end(sequence_id)
            return entry[0]

    def _drop(self, sequence_id: str) -> None:
        entry = self._records.pop(sequence_id, None)
        if entry is not None:
            self._tokens -= entry[0].size

    def _evict(self, now: float) -> None:
        # Least recently used first: with every use restarting the day, that is also the
        # soonest to expire, so expired records go before any live one.
        while self._records and (
            self._tokens > self.max_tokens or next(iter(self._records.values()))[1] <= now
        ):
            self._drop(next(iter(self._records)))


def _spans(datum: Datum, i: int) -> tuple[Sequence[ProvenanceSpan], Sequence[ProvenanceSpan]]:
    if datum.model_input_spans is None or datum.loss_fn_input_spans is None:
        field = f"data[{i}].loss_fn_input_spans"
        raise bad_request(
            f"{field}: stable_reinforce needs provenance on every datum: sample with "
            "record_stability_info=True and attach the sequence ids with "
            "Datum.with_provenance(model_input=..., loss_fn_inputs=...)",
            field,
        )
    return datum.model_input_spans, datum.loss_fn_input_spans


def _resolve(
    spans: Sequence[ProvenanceSpan],
    tokens: np.ndarray,
    field: str,
    records: StabilityRecords,
    tenant: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Check `tokens` against the records the spans name; the recorded logprob of each
    position (0 where not sampled) and 1.0 where the position is a sampled token."""
    total = sum(s.length for s in spans)
    if total != tokens.size:
        raise bad_request(
            f"{field}: the spans cover {total} positions, the field has {tokens.size}", field
        )
    recorded = np.zeros(tokens.size, dtype=np.float32)
    sampled = np.zeros(tokens.size, dtype=np.float32)
    start = 0
    for k, span in enumerate(spans):
        where = f"{field}[{k}]"
        sequence_id, offset, length = span.sequence_id, span.offset, span.length
        rec = records.lookup(tenant, sequence_id)
        if rec is None:
            raise bad_request(
                f"{where}.sequence_id: no stability record for {sequence_id!r} (unknown, "
                f"expired after {records.ttl_s / 3600:g} h unused, evicted, or sampled without "
                "record_stability_info=True); sample it again",
                f"{where}.sequence_id",
            )
        is_prompt = isinstance(span, PromptProvenanceSpan)
        source = rec.prompt if is_prompt else rec.tokens
        if offset + length > source.size:
            kind = "prompt" if is_prompt else "sampled sequence"
            raise bad_request(
                f"{where}: positions [{offset}, {offset + length}) are outside the {kind} "
                f"of {sequence_id!r} ({source.size} tokens)",
                where,
            )
        if not np.array_equal(tokens[start : start + length], source[offset : offset + length]):
            raise bad_request(
                f"{where}: the datum's tokens differ from what {sequence_id!r} recorded there",
                where,
            )
        if not is_prompt:
            recorded[start : start + length] = rec.logprobs[offset : offset + length]
            sampled[start : start + length] = 1.0
        start += length
    return recorded, sampled


def attach_stability(
    work: ForwardBackwardWork, data: Sequence[Datum], records: StabilityRecords, tenant: str
) -> ForwardBackwardWork:
    """`work` (validated) with each example's `recorded_logprobs` and `sampled_mask`."""
    examples: list[Example] = []
    for i, (datum, example) in enumerate(zip(data, work.examples, strict=True)):
        input_spans, target_spans = _spans(datum, i)
        targets = example.inputs["target_tokens"]
        if targets.ndim != 1:
            field = f"data[{i}].loss_fn_inputs.target_tokens"
            raise bad_request(f"{field}: stable_reinforce takes 1-D target_tokens", field)
        _resolve(input_spans, example.tokens, f"data[{i}].model_input_spans", records, tenant)
        recorded, sampled = _resolve(
            target_spans, targets, f"data[{i}].loss_fn_input_spans", records, tenant
        )
        inputs = {**example.inputs, "recorded_logprobs": recorded, "sampled_mask": sampled}
        examples.append(Example(example.tokens, inputs))
    return replace(work, examples=tuple(examples))
