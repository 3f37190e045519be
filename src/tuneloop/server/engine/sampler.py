"""The sampling step: each row's next token from its logits, with its own parameters and seed.

Every sample of a request decodes as its own row, with its own sampling parameters, random
stream (a seed hashed with the position, draw.py) and stop conditions (the paged decoder,
decoder.py, decides which rows run a step and feeds their logits here). `sample_rows` is the
step of all rows at once: one batched draw on the device, one copy to the host, then per row on
the host only what is the host's (recording, streaming, stop strings).

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

from tuneloop.server.engine.draw import DrawParams, StepDraw
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
    seed: int  # the row's own random stream (draw.py hashes it with the position)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[TopkRow] = field(default_factory=list)
    stop_reason: str | None = None
    index: int = 0  # which of the request's samples this row is
    seq: KVSequence | None = None  # set when the prompt's prefill is done (decoder.py)


def row_seed(seed: int | None, index: int) -> int:
    """Sample `index` of a request gets its own stream: same seed, same tokens, whatever else
    shares the batch (63 bits; an unseeded request gets fresh ones)."""
    base = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
    return (base * 1_000_003 + index) % (2**63 - 1)


def draw_params(rows: Sequence[Row], vocab: int, device: torch.device) -> DrawParams:
    """The rows' sampling parameters as device tensors (decoder.py keeps them while the rows of
    its decode batch stay the same)."""
    return DrawParams.build(
        [row.seed for row in rows],
        [row.work.temperature for row in rows],
        [row.work.top_k for row in rows],
        [row.work.top_p for row in rows],
        [row.work.stop_token_ids for row in rows],
        max((row.work.topk_sample_logprobs for row in rows), default=0),
        vocab,
        device,
    )


def _tell(row: Row) -> None:
    """Hand the row's newest token to its request's hook (streaming)."""
    assert row.work.on_token is not None
    topk = row.topk[-1] if row.work.topk_sample_logprobs else None
    try:
        row.work.on_token(row.index, row.tokens[-1], row.logprobs[-1], topk)
    except Exception:  # a listener's bug must not fail the batch: the result still arrives
        log.exception("a token hook failed")


def _finished(row: Row, stop_hit: bool, decode: Callable[[list[int]], str]) -> str | None:
    work = row.work
    if stop_hit:  # the token is one of the row's stop_token_ids (checked on the device)
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
    rows = [Row(work, row_seed(work.seed, j), index=j) for j in range(work.num_samples)]
    return RunningRequest(work, key, rows, scores)


def sample_rows(
    logits: torch.Tensor,
    rows: list[Row],
    decode: Callable[[list[int]], str],
    params: DrawParams | None = None,
) -> list[bool | EngineError | None]:
    """Draw the next token of every row from its logits row ([len(rows), V]: fp32, or bf16
    where the CPU's native draw reads them), record it with its logprob (and top-k), hand it
    to the row's stream, and set the row's stop reason.

    The draw, the logprobs, the stop-token checks and the finiteness of every row's logits are
    computed on the device in one batched pass and reach the host in one copy (draw.py).
    Returns, per row: whether it goes on; the error of its own work (a stop check that raises:
    that row's request fails alone); or None where a row of its request had logits that are not
    finite (its adapter's weights overflow): every row of that request draws nothing, and the
    caller fails the request. The other rows are unaffected (each row's draw reads its own
    logits and seed only)."""
    if not rows:
        return []
    if params is None:
        params = draw_params(rows, logits.shape[-1], logits.device)
    positions = torch.tensor([len(row.tokens) for row in rows], dtype=torch.long)
    step = StepDraw.fetch(logits, params, positions.to(logits.device, non_blocking=True))
    poisoned = {id(row.work) for row, ok in zip(rows, step.finite, strict=True) if not ok}
    going: list[bool | EngineError | None] = []
    for i, row in enumerate(rows):
        if id(row.work) in poisoned:
            going.append(None)
            continue
        row.tokens.append(step.tokens[i])
        row.logprobs.append(step.logprobs[i])
        try:
            if row.work.topk_sample_logprobs:
                assert step.topk is not None
                row.topk.append(step.topk[i][: row.work.topk_sample_logprobs])
            if row.work.on_token is not None:
                _tell(row)
            row.stop_reason = _finished(row, step.stop_hit[i], decode)
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
