"""Batched autoregressive sampling with a KV cache; rows of one batch may use different adapters.

Prompts are left-padded into one prefill (one row per request, whatever its `num_samples`),
then every sample decodes as its own row, each with its own sampling parameters, random
generator and stop conditions; rows leave the batch as they finish.

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
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from tuneloop.server.engine.isolation import NON_FINITE_LOGITS, alone_error
from tuneloop.server.engine.logprobs import pad_rows, prompt_scores
from tuneloop.server.engine.lora import AdapterBank, Routing
from tuneloop.server.engine.types import (
    EngineError,
    SampledTokens,
    SampleResult,
    SampleWork,
    TopkRow,
)

log = logging.getLogger(__name__)


@dataclass
class _Row:
    work: SampleWork
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[TopkRow] = field(default_factory=list)
    stop_reason: str | None = None
    index: int = 0  # which of the request's samples this row is


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


def _choose(logits: torch.Tensor, rows: list[_Row], temperature: torch.Tensor) -> list[int]:
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


def _nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """The rows of `logits` [rows, V] holding a NaN or an infinity (one device sync)."""
    finite = torch.isfinite(logits).all(dim=-1)
    if bool(finite.all()):
        return []
    return [i for i, ok in enumerate(finite.tolist()) if not ok]


def _topk(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]


def _tell(row: _Row) -> None:
    """Hand the row's newest token to its request's hook (streaming)."""
    assert row.work.on_token is not None
    topk = row.topk[-1] if row.work.topk_sample_logprobs else None
    try:
        row.work.on_token(row.index, row.tokens[-1], row.logprobs[-1], topk)
    except Exception:  # a listener's bug must not fail the batch: the result still arrives
        log.exception("a token hook failed")


def _finished(row: _Row, token: int, decode: Callable[[list[int]], str]) -> str | None:
    work = row.work
    if token in work.stop_token_ids:
        return "stop"
    if work.stop_strings and any(s in decode(row.tokens) for s in work.stop_strings):
        return "stop"
    if len(row.tokens) >= work.max_tokens:
        return "length"
    return None


def _select(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep (and repeat) the cache's batch rows named by `index`, in that order."""
    for layer in cache.layers:
        held: Any = layer  # a full-attention layer: keys/values [B, heads, T, dim]
        if isinstance(getattr(held, "keys", None), torch.Tensor) and held.keys.numel():
            held.keys = held.keys.index_select(0, index)
            held.values = held.values.index_select(0, index)


def _pad_left(t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """Zero-pad `t` on the left along `dim` to `width`."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@dataclass
class RunningRequest:
    work: SampleWork
    key: str | None
    rows: list[_Row]
    scores: tuple[list[float | None] | None, list[TopkRow] | None]
    done: int = 0  # rows finished


# Prompt tokens prefilled per decode step while other rows decode: a long joining prompt then
# costs each step about as much as this many extra tokens, instead of stalling every running row
# for its whole prefill (a 2,000-token prompt is ~3 s of matmuls on 2 CPU threads).
DEFAULT_PREFILL_CHUNK = 256


@dataclass
class _Prefill:
    """Joining requests (one left-padded prompt row each) whose prefill is under way."""

    requests: list[RunningRequest]
    keys: list[str | None]
    input_ids: torch.Tensor  # [R, W]
    mask: torch.Tensor  # [R, W], 0 on the left padding
    positions: torch.Tensor  # [R, W]
    cache: DynamicCache = field(default_factory=DynamicCache)
    done: int = 0  # columns prefilled
    logits: torch.Tensor | None = None  # [R, V] after the last column

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])


class DecodeBatch:
    """A running decode batch that requests join at step boundaries and leave when done.

    Each request's prompt is prefilled once, whatever its `num_samples`; its KV cache rows and
    last logits are then repeated for the samples. Joining requests are prefilled on their own
    and merged into the running cache, left-padded (masked) to a common length. While rows are
    decoding, a joining prefill advances `prefill_chunk` prompt tokens per step (chunked prefill),
    so a long prompt slows the running rows' steps a little instead of stopping them. A row that
    stops leaves the batch at once, and a request whose rows have all stopped is handed back by
    `step()` at once, not when the longest request of the batch ends.

    One request's failure is its own: a row whose logits are not finite (its adapter's weights
    overflow), or an exception in a request's own work (scoring its prompt, stop checks, its
    result), fails that request alone, handed back by `step()` with its `EngineError`; a joining
    prefill that raises is run again request by request, so only the one failing alone fails.
    """

    def __init__(
        self,
        model: nn.Module,
        bank: AdapterBank,
        *,
        pad_id: int,
        decode: Callable[[list[int]], str],
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        self.model, self.bank, self.pad_id, self.decode = model, bank, pad_id, decode
        self.prefill_chunk = max(1, prefill_chunk)
        self.device = next(model.parameters()).device
        self.rows: list[tuple[RunningRequest, _Row]] = []  # decode-batch row i
        self.pending: list[_Prefill] = []  # joining, in arrival order
        self.failed: list[tuple[RunningRequest, EngineError]] = []  # handed back by step()
        self.cache = DynamicCache()
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.next_pos = torch.zeros((0, 1), dtype=torch.long, device=self.device)
        self.temperature = torch.zeros((0,), device=self.device)
        self.logits: torch.Tensor | None = None  # [rows, V]: the next token's, pending
        # The routing (and its stacked factors for grouped LoRA) lives until the rows change;
        # it is applied around each of this batch's forward passes only, so that several
        # batches (length buckets of one decode run) can take turns on the same model.
        self._routing = Routing()

    def __len__(self) -> int:
        """Rows decoding plus rows still being prefilled."""
        return len(self.rows) + sum(r.work.num_samples for p in self.pending for r in p.requests)

    def kv_tokens(self) -> int:
        """KV-cache tokens held now (rows x cache length, prefills included)."""
        held = len(self.rows) * self.mask.shape[1]
        return held + sum(len(p.requests) * p.done for p in self.pending)

    def requests(self) -> list[RunningRequest]:
        """Every request decoding or prefilling here."""
        seen: dict[int, RunningRequest] = {}
        for request, _ in self.rows:
            seen.setdefault(id(request), request)
        return list(seen.values()) + [r for p in self.pending for r in p.requests]

    @torch.no_grad()
    def add(
        self,
        works: Sequence[SampleWork],
        keys: Sequence[str | None],
        *,
        others_decoding: bool = False,
    ) -> list[RunningRequest]:
        """Start prefilling `works` (one row each); their samples join the batch once done.

        With no rows decoding, here or in another batch taking turns with this one
        (`others_decoding`), there is no one to stall: the prefill then runs whole, now.
        """
        device = self.device
        try:
            scored = _score_prompts(self.model, self.bank, works, keys, self.pad_id, device)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if len(works) == 1:
                log.exception("scoring a prompt failed")
                self.failed.append(
                    (
                        RunningRequest(works[0], keys[0], [], (None, None)),
                        alone_error(exc, "sample"),
                    )
                )
                return []
            # Run again request by request: only one that fails alone fails.
            return [
                request
                for work, key in zip(works, keys, strict=True)
                for request in self.add([work], [key], others_decoding=others_decoding)
            ]
        requests = []
        for index, (work, key) in enumerate(zip(works, keys, strict=True)):
            rows = [_Row(work, _generator(work.seed, j), index=j) for j in range(work.num_samples)]
            requests.append(RunningRequest(work, key, rows, scored.get(index, (None, None))))
        self.pending.append(self._prefill_of(requests, list(keys)))
        if not self.rows and not others_decoding:
            self._prefill_some(chunked=False)
        return requests

    def _prefill_of(self, requests: list[RunningRequest], keys: list[str | None]) -> _Prefill:
        """The prefill of `requests`' prompts, left-padded to the longest."""
        device = self.device
        works = [request.work for request in requests]
        width = max(len(w.prompt) for w in works)
        input_ids = torch.full((len(works), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(works), width), dtype=torch.long)
        for i, work in enumerate(works):
            n = len(work.prompt)
            input_ids[i, width - n :] = torch.as_tensor(work.prompt, dtype=torch.long)
            mask[i, width - n :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # A growing cache: a static one (written in place, no re-copy per step) was measured
        # 10 % slower on CPU at 128 rows x 64 steps, its attention spanning the full length.
        return _Prefill(requests, keys, input_ids, mask, positions)

    def _advance(self, prefill: _Prefill, tokens: float) -> None:
        """Prefill the next columns of `prefill`, about `tokens` prompt tokens (all rows)."""
        rows = len(prefill.requests)
        columns = max(1, int(tokens // rows)) if tokens != float("inf") else prefill.width
        start, end = prefill.done, min(prefill.width, prefill.done + columns)
        with self.bank.routed(prefill.keys):
            out = self.model(
                input_ids=prefill.input_ids[:, start:end],
                attention_mask=prefill.mask[:, :end],
                position_ids=prefill.positions[:, start:end],
                cache=prefill.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        prefill.done = end
        if end == prefill.width:
            prefill.logits = out.logits[:, -1].float()

    def _prefill_some(self, chunked: bool) -> None:
        """Advance the oldest joining prefill by one chunk (all of it unless `chunked`) and
        let its samples join once it is complete."""
        if not self.pending:
            return
        prefill = self.pending[0]
        try:
            self._advance(prefill, self.prefill_chunk if chunked else float("inf"))
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            self.pending.pop(0)
            if len(prefill.requests) == 1:
                log.exception("a prefill failed")
                self.failed.append((prefill.requests[0], alone_error(exc, "sample")))
                return
            # Run again request by request, each alone (unpadded): only one failing alone fails.
            for request, key in reversed(list(zip(prefill.requests, prefill.keys, strict=True))):
                self.pending.insert(0, self._prefill_of([request], [key]))
            return
        if prefill.logits is None:
            return
        self.pending.pop(0)
        works = [request.work for request in prefill.requests]
        device = self.device
        # One prompt row per request -> one row per sample.
        repeat = torch.tensor([w.num_samples for w in works], device=device)
        expand = torch.repeat_interleave(torch.arange(len(works), device=device), repeat)
        _select(prefill.cache, expand)
        logits = prefill.logits.index_select(0, expand)
        mask = prefill.mask.index_select(0, expand)
        next_pos = prefill.positions[:, -1:].index_select(0, expand) + 1
        temperature = torch.tensor(
            [w.temperature for w in works for _ in range(w.num_samples)], device=device
        )
        self._merge(prefill.cache, mask, next_pos, temperature, logits)
        self.rows += [(request, row) for request in prefill.requests for row in request.rows]
        self._reroute()

    def _merge(
        self,
        cache: DynamicCache,
        mask: torch.Tensor,
        next_pos: torch.Tensor,
        temperature: torch.Tensor,
        logits: torch.Tensor,
    ) -> None:
        if not self.rows:
            self.cache, self.mask, self.next_pos = cache, mask, next_pos
            self.temperature, self.logits = temperature, logits
            return
        assert self.logits is not None
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            a: Any = mine
            b: Any = theirs
            a.keys = torch.cat([_pad_left(a.keys, 2, width), _pad_left(b.keys, 2, width)])
            a.values = torch.cat([_pad_left(a.values, 2, width), _pad_left(b.values, 2, width)])
        self.mask = torch.cat([_pad_left(self.mask, 1, width), _pad_left(mask, 1, width)])
        self.next_pos = torch.cat([self.next_pos, next_pos])
        self.temperature = torch.cat([self.temperature, temperature])
        self.logits = torch.cat([self.logits, logits])

    def _reroute(self) -> None:
        self._routing = Routing.from_rows([req.key for req, _ in self.rows])

    def _keep(self, keep: list[int]) -> None:
        """Keep only decode-batch rows `keep` (in order)."""
        if len(keep) == len(self.rows):
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        _select(self.cache, index)
        self.mask = self.mask.index_select(0, index)
        self.next_pos = self.next_pos.index_select(0, index)
        self.temperature = self.temperature.index_select(0, index)
        if self.logits is not None:
            self.logits = self.logits.index_select(0, index)
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.logits = None
        else:
            self._trim()
        self._reroute()

    def _trim(self) -> None:
        """Drop leading cache columns that are padding for every row left (a long row that
        left took its width with it); positions are explicit, so nothing else changes."""
        first = int(self.mask.any(0).to(torch.int8).argmax())
        if first == 0:
            return
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            held: Any = layer
            if isinstance(getattr(held, "keys", None), torch.Tensor) and held.keys.numel():
                held.keys = held.keys[:, :, first:]
                held.values = held.values[:, :, first:]

    def drop(self, unwanted: Callable[[SampleWork], bool]) -> list[RunningRequest]:
        """Remove the requests `unwanted` picks (decoding or still prefilling), unanswered; the
        caller answers them. Their rows stop costing compute from the next step on."""
        dropped: list[RunningRequest] = []
        for prefill in list(self.pending):
            if any(unwanted(r.work) for r in prefill.requests):
                # A prefill's rows share one cache: the whole group is restarted without them.
                self.pending.remove(prefill)
                dropped += [r for r in prefill.requests if unwanted(r.work)]
                kept = [r for r in prefill.requests if not unwanted(r.work)]
                if kept:
                    self._requeue(kept, prefill)
        gone = {id(req) for req, _ in self.rows if unwanted(req.work)}
        if gone:
            seen: set[int] = set()
            for req, _ in self.rows:
                if id(req) in gone and id(req) not in seen:
                    seen.add(id(req))
                    dropped.append(req)
            self._keep([i for i, (req, _) in enumerate(self.rows) if id(req) not in gone])
        return dropped

    def _requeue(self, kept: list[RunningRequest], old: _Prefill) -> None:
        """Restart a joining prefill from its first column with only `kept` of its requests."""
        ids = {id(r) for r in kept}
        picked = [i for i, r in enumerate(old.requests) if id(r) in ids]
        index = torch.tensor(picked, dtype=torch.long, device=self.device)
        self.pending.insert(
            0,
            _Prefill(
                kept,
                [old.keys[i] for i in picked],
                old.input_ids.index_select(0, index),
                old.mask.index_select(0, index),
                old.positions.index_select(0, index),
            ),
        )

    @torch.no_grad()
    def step(
        self, *, others_decoding: bool = False
    ) -> list[tuple[RunningRequest, SampleResult | EngineError]]:
        """Draw one token for every row, retire the rows that stop, run the model once for the
        rest, and advance a joining prefill by one chunk (all of it when no row decodes here
        or in `others_decoding` batches). Returns the requests that finished, with results,
        and those that failed, with their errors."""
        finished: list[tuple[RunningRequest, SampleResult | EngineError]] = []
        finished += self._decode() if self.rows else []
        self._prefill_some(chunked=bool(self.rows) or others_decoding)
        finished += self.failed
        self.failed = []
        return finished

    def _decode(self) -> list[tuple[RunningRequest, SampleResult | EngineError]]:
        assert self.logits is not None
        device = self.device
        logits = self.logits
        # A row with a NaN or an infinity in its logits (its adapter's weights overflow) fails
        # its request alone; its draw below is made from zeros and thrown away.
        failed: dict[int, tuple[RunningRequest, EngineError]] = {}
        bad = _nonfinite_rows(logits)
        if bad:
            for i in bad:
                request = self.rows[i][0]
                failed.setdefault(id(request), (request, EngineError(NON_FINITE_LOGITS, "user")))
            logits = logits.clone()
            logits[bad] = 0.0
        step_logprobs = torch.log_softmax(logits, dim=-1)
        live = [row for _, row in self.rows]
        chosen = _choose(logits, live, self.temperature)
        chosen_lp = step_logprobs.gather(1, torch.tensor(chosen, device=device)[:, None])
        chosen_lp_list = chosen_lp[:, 0].tolist()
        keep: list[int] = []
        finished: list[tuple[RunningRequest, SampleResult | EngineError]] = []
        for i, (request, row) in enumerate(self.rows):
            if id(request) in failed:
                continue
            try:
                if self._advance_row(request, row, chosen[i], chosen_lp_list[i], step_logprobs[i]):
                    keep.append(i)
                elif request.done == len(request.rows):
                    finished.append((request, _result(request)))
            except Exception as exc:  # this request's own work: it fails alone
                log.exception("sampling failed for one request")
                failed[id(request)] = (request, alone_error(exc, "sample"))
        keep = [i for i in keep if id(self.rows[i][0]) not in failed]
        finished += failed.values()
        next_tokens = torch.tensor([[chosen[i]] for i in keep], dtype=torch.long, device=device)
        self.logits = None  # used up: the forward below gives the next ones
        self._keep(keep)  # finished rows leave the batch
        if not self.rows:
            return finished
        ones = torch.ones((len(self.rows), 1), dtype=self.mask.dtype, device=device)
        self.mask = torch.cat([self.mask, ones], 1)
        with self.bank.using(self._routing):
            out = self.model(
                input_ids=next_tokens,
                attention_mask=self.mask,
                position_ids=self.next_pos,
                cache=self.cache,
                use_cache=True,
            )
        self.logits = out.logits[:, -1].float()
        self.next_pos = self.next_pos + 1
        return finished

    def _advance_row(
        self, request: RunningRequest, row: _Row, token: int, logprob: float, lps: torch.Tensor
    ) -> bool:
        """Record a row's drawn token; whether it goes on (False: it stopped)."""
        row.tokens.append(token)
        row.logprobs.append(float(logprob))
        if row.work.topk_sample_logprobs:
            row.topk.append(_topk(lps, row.work.topk_sample_logprobs))
        if row.work.on_token is not None:
            _tell(row)
        row.stop_reason = _finished(row, token, self.decode)
        if row.stop_reason is None:
            return True
        request.done += 1
        return False

    def close(self) -> None:
        """Drop the cached routing (its stacked factors) and the KV cache."""
        self._routing = Routing()
        self.cache = DynamicCache()


_Scores = dict[int, tuple[list[float | None] | None, list[TopkRow] | None]]


def _score_prompts(
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


def _result(request: RunningRequest) -> SampleResult:
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
