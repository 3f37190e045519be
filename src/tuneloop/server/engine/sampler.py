"""The sampling step: each row's next token from its logits, with its own parameters and seed.

Every sample of a request decodes as its own row, with its own sampling parameters, random
generator and stop conditions (the paged decoder, decoder.py, decides which rows run a step and
feeds their logits here). `sample_rows` is the per-row step: it draws every row's token, records
its logprob (and top-k), streams it, and says which rows stop.

The logprob reported for a sampled token is the model's own log-softmax at temperature 1, the
same number the training forward pass computes for that token, so RL losses that compare the two
(importance ratios) start at exactly 1 on-policy. Temperature, top-k and top-p shape only which
token is drawn.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from tuneloop.server.engine.isolation import NON_FINITE_LOGITS, alone_error
from tuneloop.server.engine.kv.sequence import Sequence as KVSequence
from tuneloop.server.engine.logprobs import pad_rows, prompt_scores
from tuneloop.server.engine.lora import AdapterBank
from tuneloop.server.engine.types import (
    EngineError,
    SampledTokens,
    SampleResult,
    SampleWork,
    TopkRow,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Row:
    """One sample of a request: what it drew so far and the sequence that holds its KV."""

    work: SampleWork
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[TopkRow] = field(default_factory=list)
    stop_reason: str | None = None
    index: int = 0  # which of the request's samples this row is
    seq: KVSequence | None = None  # set when the prompt's prefill is done (decoder.py)


def _generator(seed: int | None, index: int) -> torch.Generator:
    base = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
    # Sample `index` of a request gets its own stream: same seed, same tokens, whatever else
    # shares the batch.
    return torch.Generator().manual_seed((base * 1_000_003 + index) % (2**63 - 1))


def _filtered(probs: torch.Tensor, work: SampleWork) -> torch.Tensor:
    """One row's probabilities with top-k and top-p applied (unnormalised)."""
    if work.top_k > 0 and work.top_k < probs.shape[-1]:
        kth = torch.topk(probs, work.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if work.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1) / sorted_probs.sum()
        drop = cumulative - sorted_probs / sorted_probs.sum() >= work.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return probs


GREEDY_BELOW = 1e-5


def _choose(logits: torch.Tensor, rows: list[Row], temperature: torch.Tensor) -> list[int]:
    """Next token of every row at once: inverse-CDF draws with one uniform per row.

    Each row's uniform comes from its own generator, so a row's tokens depend on its seed and
    its logits only, never on what else shares the batch.
    """
    greedy = torch.argmax(logits, dim=-1)
    # Temperatures this close to 0 are greedy: dividing fp32 logits by them overflows to inf
    # (NaN probabilities). Greedy rows divide by 1: their draw is replaced by the argmax below.
    is_greedy = temperature < GREEDY_BELOW
    divisor = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / divisor[:, None], dim=-1)
    for i, row in enumerate(rows):
        if row.work.top_k > 0 or row.work.top_p < 1.0:
            probs[i] = _filtered(probs[i], row.work)
    # u in (0, 1]: the first index whose CDF reaches u * total always has probability > 0.
    u = torch.stack([1.0 - torch.rand((), generator=row.generator) for row in rows])
    cdf = probs.cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None]).squeeze(1)
    drawn = drawn.clamp(max=logits.shape[-1] - 1)
    chosen = torch.where(is_greedy, greedy, drawn)
    return [int(t) for t in chosen.tolist()]


def nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """The rows of `logits` [rows, V] holding a NaN or an infinity (one device sync)."""
    finite = torch.isfinite(logits).all(dim=-1)
    if bool(finite.all()):
        return []
    return [i for i, ok in enumerate(finite.tolist()) if not ok]


def _topk(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]


def _tell(row: Row) -> None:
    """Hand the row's newest token to its request's hook (streaming)."""
    assert row.work.on_token is not None
    topk = row.topk[-1] if row.work.topk_sample_logprobs else None
    try:
        row.work.on_token(row.index, row.tokens[-1], row.logprobs[-1], topk)
    except Exception:  # a listener's bug must not fail the batch: the result still arrives
        log.exception("a token hook failed")


def _finished(row: Row, token: int, decode: Callable[[list[int]], str]) -> str | None:
    work = row.work
    if token in work.stop_token_ids:
        return "stop"
    if work.stop_strings and any(s in decode(row.tokens) for s in work.stop_strings):
        return "stop"
    if len(row.tokens) >= work.max_tokens:
        return "length"
    return None


@dataclass(eq=False)
class RunningRequest:
    work: SampleWork
    key: str | None
    rows: list[Row]
    scores: tuple[list[float | None] | None, list[TopkRow] | None]
    done: int = 0  # rows finished


def new_request(
    work: SampleWork,
    key: str | None,
    scores: tuple[list[float | None] | None, list[TopkRow] | None] = (None, None),
) -> RunningRequest:
    rows = [Row(work, _generator(work.seed, j), index=j) for j in range(work.num_samples)]
    return RunningRequest(work, key, rows, scores)


def sample_rows(
    logits: torch.Tensor, rows: list[Row], decode: Callable[[list[int]], str]
) -> list[bool | EngineError]:
    """Draw the next token of every row from its logits row ([len(rows), V], fp32), record it
    with its logprob (and top-k), hand it to the row's stream, and set the row's stop reason.
    Returns, per row, whether it goes on, or the error of its own work (a stop check that
    raises): that row's request fails alone, the other rows are unaffected."""
    if not rows:  # every row of the step failed (non-finite logits)
        return []
    temperature = torch.tensor([row.work.temperature for row in rows], device=logits.device)
    step_logprobs = torch.log_softmax(logits, dim=-1)
    chosen = _choose(logits, rows, temperature)
    chosen_lp = step_logprobs.gather(1, torch.tensor(chosen, device=logits.device)[:, None])
    chosen_lp_list = chosen_lp[:, 0].tolist()
    going: list[bool | EngineError] = []
    for i, row in enumerate(rows):
        token = chosen[i]
        row.tokens.append(token)
        row.logprobs.append(float(chosen_lp_list[i]))
        try:
            if row.work.topk_sample_logprobs:
                row.topk.append(_topk(step_logprobs[i], row.work.topk_sample_logprobs))
            if row.work.on_token is not None:
                _tell(row)
            row.stop_reason = _finished(row, token, decode)
        except Exception as exc:  # this request's own work: it fails alone
            log.exception("sampling failed for one request")
            going.append(alone_error(exc, "sample"))
            continue
        going.append(row.stop_reason is None)
    return going


_Scores = dict[int, tuple[list[float | None] | None, list[TopkRow] | None]]


def score_prompts(
    model: nn.Module,
    bank: AdapterBank,
    works: Sequence[SampleWork],
    keys: Sequence[str | None],
    pad_id: int,
    device: torch.device,
) -> _Scores:
    """Prompt logprobs (and top-k) of the works that ask, once per work, not per sample."""
    wanted = [i for i, w in enumerate(works) if w.prompt_logprobs or w.topk_prompt_logprobs]
    if not wanted:
        return {}
    prompts = [works[i].prompt for i in wanted]
    k = max(works[i].topk_prompt_logprobs for i in wanted)
    with bank.routed([keys[i] for i in wanted]):
        picked, top_values, top_ids = prompt_scores(
            model, pad_rows(prompts, pad_id, device), [len(p) for p in prompts], k
        )
    out: _Scores = {}
    for row, index in enumerate(wanted):
        work, n = works[index], len(works[index].prompt)
        logprobs = (
            [None, *(float(x) for x in picked[row, : n - 1])] if work.prompt_logprobs else None
        )
        topk: list[TopkRow] | None = None
        if work.topk_prompt_logprobs:
            kk = work.topk_prompt_logprobs
            topk = [None] + [
                [
                    (int(i), float(v))
                    for i, v in zip(top_ids[row, t, :kk], top_values[row, t, :kk], strict=True)
                ]
                for t in range(n - 1)
            ]
        out[index] = (logprobs, topk)
    return out


def result(request: RunningRequest) -> SampleResult:
    work = request.work
    prompt_lp, prompt_topk = request.scores
    if prompt_lp is not None and not all(x is None or math.isfinite(x) for x in prompt_lp):
        raise EngineError(NON_FINITE_LOGITS, "user")
    sequences = [
        SampledTokens(
            r.tokens,
            r.logprobs,
            "stop" if r.stop_reason == "stop" else "length",
            r.topk if work.topk_sample_logprobs else None,
        )
        for r in request.rows
    ]
    return SampleResult(sequences, prompt_lp, prompt_topk)
