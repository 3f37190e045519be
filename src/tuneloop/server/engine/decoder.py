"""One base model's sampling state over a paged KV cache: schedule -> run -> postprocess.

Each `step()`:
1. draws the next token of every decoding row from the logits the last step left it
   (sampler.sample_rows); rows that stop leave at once and give their blocks back, and a request
   whose rows have all stopped is returned;
2. schedules one token per decoding row plus up to `prefill_chunk` prompt tokens of the joining
   requests, oldest first (chunked prefill: a long prompt costs the running rows a bounded extra
   per step instead of a stall; with no row decoding, prompts are prefilled whole);
3. runs them as one packed forward pass (model_runner.py) and keeps the logits.

A request's prompt is prefilled once, as one sequence, whatever its `num_samples`; when its last
token is computed the sequence forks into one row per sample, every row referencing the prompt's
blocks (kv/block_manager.py). A row writing into a block its siblings still reference (the
prompt's partly filled last block) copies it first. Full prompt blocks are findable afterwards by
the hash chain of their tokens, per adapter: a later prompt with the same prefix skips their
prefill.

Admission reserves a request's worst case in blocks (prompt, plus every sample's growth, plus
the copies of a shared last block); what a request can no longer use is given back as its rows
stop. A request that needs more blocks than are free waits, in order. One whose worst case is
larger than the whole pool (max_tokens defaults to the rest of the context) runs alone with
every block and fails only if its samples really outgrow the pool; one whose prompt alone does
not fit is refused.

`sampler.sample_rows` is the step of every decoding row at once (logits -> token, logprob,
stream, stop): one batched draw on the device and one copy to the host per step; the rows'
sampling parameters stay on the device while the decode batch keeps its rows.

One request's failure is its own: a row whose logits are not finite (its adapter's weights
overflow) fails its request alone, with a user error, and so does an exception in a request's own
work (scoring its prompt, its stop checks, its result); a step's forward pass that raises is run
again in halves, by request, until the request that fails alone is found (`_forward`). A failed
request's blocks go back to the pool at once (`_end`), and every other request gets what it gets
alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tuneloop.server.engine.draw import DrawParams
from tuneloop.server.engine.isolation import NON_FINITE_LOGITS, alone_error
from tuneloop.server.engine.kv.block_manager import (
    BlockManager,
    KVUsage,
    blocks_for,
    worst_case_blocks,
)
from tuneloop.server.engine.kv.paged_attention import KVPool
from tuneloop.server.engine.kv.sequence import Sequence
from tuneloop.server.engine.lora import AdapterBank
from tuneloop.server.engine.model_runner import ModelRunner, Scheduled
from tuneloop.server.engine.sampler import (
    Row,
    RunningRequest,
    draw_params,
    new_request,
    result,
    sample_rows,
    score_prompts,
)
from tuneloop.server.engine.types import EngineError, SampleResult, SampleWork

__all__ = ["DEFAULT_PREFILL_CHUNK", "MAX_STEP_TOKENS", "Decoder"]

log = logging.getLogger(__name__)

# Prompt tokens prefilled per step while other rows decode: a long joining prompt then costs each
# step about as much as this many extra tokens, instead of stalling every running row for its
# whole prefill (a 2,000-token prompt is ~3 s of matmuls on 2 CPU threads).
DEFAULT_PREFILL_CHUNK = 256
# Prompt tokens of one step when no row decodes (activations of one forward pass stay bounded).
MAX_STEP_TOKENS = 8192
# Decode rows kept grouped by adapter (`_grouped_by_key`; bench/mixed_decode.py switches it off
# to compare).
_GROUP_BY_KEY = True


def _out_of_blocks(blocks: int) -> EngineError:
    return EngineError(
        f"the samples outgrew the KV cache ({blocks} blocks) before reaching max_tokens: "
        "send fewer samples or a smaller max_tokens",
        "user",
    )


class _OutOfBlocksError(Exception):
    def __init__(self, live: _Live) -> None:
        super().__init__()
        self.live = live


@dataclass(eq=False)
class _Live:
    """A request in this decoder, with its prompt sequence while that is prefilled."""

    request: RunningRequest
    prompt: Sequence | None  # None once forked into its rows
    digests: list[bytes]
    pot: int  # blocks reserved for it and not yet taken
    rows_left: list[Row] = field(default_factory=list)


class Decoder:
    def __init__(
        self,
        model: nn.Module,
        bank: AdapterBank,
        *,
        num_blocks: int,
        block_size: int,
        pad_id: int,
        decode: Callable[[list[int]], str],
        kernel: bool = False,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        self.model, self.bank, self.pad_id, self.decode = model, bank, pad_id, decode
        self.prefill_chunk = max(1, prefill_chunk)
        # the token budget it was made for (None: sized from free memory; runtime.py)
        self.budget: int | None = num_blocks * block_size
        param = next(model.parameters())
        self.device = param.device
        self.blocks = BlockManager(num_blocks, block_size)
        self.pool = KVPool(num_blocks, block_size, param.device, param.dtype)
        self.runner = ModelRunner(model, bank, self.pool, kernel)
        self._copies: list[tuple[int, int]] = []  # (source, copy) blocks, made each step
        self.joining: list[_Live] = []  # prompts being prefilled, oldest first
        self.rows: list[tuple[_Live, Row]] = []  # decoding; self.logits[i] is row i's
        self.logits: torch.Tensor | None = None
        self._params: tuple[list[Row], DrawParams] | None = None  # of the rows last drawn

    # ---- views ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """Rows decoding plus rows still being prefilled."""
        return len(self.rows) + sum(live.request.work.num_samples for live in self.joining)

    def usage(self) -> KVUsage:
        return self.blocks.usage()

    def requests(self) -> list[RunningRequest]:
        seen: dict[int, RunningRequest] = {}
        for live, _ in self.rows:
            seen.setdefault(id(live.request), live.request)
        return list(seen.values()) + [live.request for live in self.joining]

    # ---- admission ----------------------------------------------------------------------------

    def admit(self, work: SampleWork, key: str | None, namespace: str) -> RunningRequest | None:
        """Start prefilling `work` if its worst case fits the free blocks (None: not now).

        Raises EngineError when it could never fit this pool.
        """
        size = self.blocks.block_size
        prompt = [int(t) for t in work.prompt]
        digests = BlockManager.chain(namespace, prompt, size)
        # At least the last prompt token is computed: its logits give the first sample.
        usable = digests[: (len(prompt) - 1) // size]
        found = self.blocks.cached_prefix(usable, prompt)
        need = worst_case_blocks(len(prompt), work.num_samples, work.max_tokens, size, len(found))
        from_free = self.blocks.cost(found)  # cached blocks nobody holds: they leave the free list
        need += from_free
        # The prompt (and a first block for each sample) must fit; the growth may not, when
        # max_tokens is large (by default, the rest of the context): such a request runs alone,
        # with every block there is, and fails only if its rows really outgrow the pool.
        least = blocks_for(len(prompt), size) + work.num_samples
        if least > self.blocks.num_blocks:
            raise EngineError(
                f"this request needs at least {least} KV-cache blocks of {size} tokens (its "
                f"prompt and a block per sample) and the cache holds {self.blocks.num_blocks}: "
                "send a shorter prompt or fewer samples",
                "user",
            )
        if need > self.blocks.num_blocks:
            if len(self):  # wait until it is alone
                return None
            need = self.blocks.available()
        if not self.blocks.reserve(need):
            return None
        self.blocks.take_cached(found, len(usable))
        seq = Sequence(prompt, key, list(found), len(found) * size, sealed=len(found))
        try:
            scores = score_prompts(self.model, self.bank, [work], [key], self.pad_id, self.device)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # this request's own work: it fails alone, holding nothing
            log.exception("scoring a prompt failed")
            self._release(seq)
            self.blocks.unreserve(need - from_free)
            raise alone_error(exc, "sample") from exc
        request = new_request(work, key, scores.get(0, (None, None)))
        self.joining.append(_Live(request, seq, digests, need - from_free))
        return request

    # ---- blocks ---------------------------------------------------------------------------

    def _room(self, live: _Live, seq: Sequence, end: int) -> None:
        """Blocks for writing positions [seq.computed, end): new ones, and private copies of
        shared ones about to be written."""
        size = self.blocks.block_size
        for index in range(seq.computed // size, blocks_for(end, size)):
            if index == len(seq.table):
                seq.table.append(self._alloc(live))
            elif self.blocks.shared(seq.table[index]):
                if live.pot <= 0:
                    if not self.blocks.reserve(1):
                        raise _OutOfBlocksError(live)
                    live.pot += 1
                source, copy = self.blocks.copy_on_write(seq.table, index)
                live.pot -= 1
                self._copies.append((source, copy))  # made before the step's forward

    def _alloc(self, live: _Live) -> int:
        if live.pot <= 0:  # only a request admitted beyond its worst case runs dry
            if not self.blocks.reserve(1):
                raise _OutOfBlocksError(live)
            live.pot += 1
        live.pot -= 1
        return self.blocks.allocate()

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.table)
        seq.table = []

    def _refund(self, live: _Live) -> None:
        """Give back what the request's rows still decoding can no longer take."""
        size = self.blocks.block_size
        work = live.request.work
        limit = blocks_for(len(work.prompt) + work.max_tokens - 1, size)
        need = 0
        for row in live.rows_left:
            assert row.seq is not None
            need += limit - len(row.seq.table)
            need += 1 if row.seq.table and self.blocks.shared(row.seq.table[-1]) else 0
        extra = live.pot - need
        if extra > 0:
            live.pot -= extra
            self.blocks.unreserve(extra)

    def _end(self, live: _Live) -> None:
        if live.prompt is not None:
            self._release(live.prompt)
        for row in live.rows_left:
            assert row.seq is not None
            self._release(row.seq)
        live.rows_left = []
        self.blocks.unreserve(live.pot)
        live.pot = 0

    # ---- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[tuple[RunningRequest, SampleResult | EngineError]]:
        finished = self._sample() if self.rows else []
        work = [Scheduled(row.seq, 1, True) for _, row in self.rows if row.seq is not None]
        assert len(work) == len(self.rows)
        owners = [live for live, _ in self.rows]  # the request of each scheduled item
        budget = self.prefill_chunk if self.rows else MAX_STEP_TOKENS
        completing: list[_Live] = []
        chunks: list[tuple[_Live, Sequence]] = []
        for live in list(self.joining):
            if budget <= 0:
                break
            seq = live.prompt
            assert seq is not None
            length = min(seq.uncomputed, budget)
            budget -= length
            done = length == seq.uncomputed
            try:
                self._room(live, seq, seq.computed + length)
            except _OutOfBlocksError:  # cannot happen: admission reserved every prompt block
                self.joining.remove(live)
                self._end(live)
                finished.append((live.request, _out_of_blocks(self.blocks.num_blocks)))
                continue
            work.append(Scheduled(seq, length, done))
            owners.append(live)
            chunks.append((live, seq))
            if done:
                completing.append(live)
        # The step's copies-on-write, at once, before its forward writes into the copies.
        self.pool.copy_blocks(self._copies)
        self._copies.clear()
        if not work:
            return finished
        logits, broken = self._forward(work, owners)
        if broken:  # those requests fail alone; the others' logits are in `logits`, in order
            for live, error in broken.values():
                if live in self.joining:
                    self.joining.remove(live)
                self._end(live)
                finished.append((live.request, error))
            self.rows = [(lv, row) for lv, row in self.rows if id(lv) not in broken]
            chunks = [(lv, seq) for lv, seq in chunks if id(lv) not in broken]
            completing = [lv for lv in completing if id(lv) not in broken]
        size = self.blocks.block_size
        for live, seq in chunks:  # full prompt blocks become findable
            full = min(len(live.digests), seq.computed // size)
            for index in range(seq.sealed, full):
                block = seq.tokens[index * size : (index + 1) * size]
                self.blocks.seal(seq.table[index], live.digests[index], block)
            seq.sealed = max(seq.sealed, full)
        # Logits rows: the decoding rows', then one per completed prompt, repeated per sample.
        # A completed prompt's rows join after the last row of their adapter: the decode rows
        # stay grouped by key, so each adapted layer runs one LoRA segment per key and not one
        # per request (`_grouped_by_key`).
        entries = [(lv, row, i) for i, (lv, row) in enumerate(self.rows)]
        for offset, live in enumerate(completing, start=len(self.rows)):
            self.joining.remove(live)
            self._fork(live)
            _grouped_by_key(entries, [(live, row, offset) for row in live.request.rows])
        self.rows = [(lv, row) for lv, row, _ in entries]
        picks = [i for _, _, i in entries]
        if picks and picks == list(range(len(logits))):  # decoding rows alone (most steps)
            self.logits = logits  # a copy of [rows, V] saved
        elif picks:
            self.logits = logits.index_select(0, torch.tensor(picks, device=logits.device))
        return finished

    def _forward(
        self, work: list[Scheduled], owners: list[_Live]
    ) -> tuple[torch.Tensor, dict[int, tuple[_Live, EngineError]]]:
        """The step's forward pass: logits of the items that want them, in order, and the
        requests that failed. A pass that raises is run again in halves (by request, each
        half keeping the items' order) until the request that fails alone is found; a failed
        attempt computed nothing (sequences advance only after a pass succeeds, and the next
        attempt writes the same KV slots)."""
        try:
            return self.runner.run(work), {}
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            lives = list({id(live): live for live in owners}.values())
            if len(lives) == 1:
                log.exception("a sampling forward pass failed for one request")
                return _no_logits(), {id(lives[0]): (lives[0], alone_error(exc, "sample"))}
            log.warning(
                "a sampling step of %d requests failed (%s: %s); running its halves apart",
                len(lives),
                type(exc).__name__,
                exc,
            )
            first = {id(live) for live in lives[: len(lives) // 2]}
            broken: dict[int, tuple[_Live, EngineError]] = {}
            rows: list[tuple[int, torch.Tensor]] = []
            for side in (True, False):
                items = [i for i, live in enumerate(owners) if (id(live) in first) == side]
                logits, failed = self._forward([work[i] for i in items], [owners[i] for i in items])
                broken.update(failed)
                wanting = [i for i in items if work[i].wants_logits and id(owners[i]) not in failed]
                rows += zip(wanting, logits, strict=True)
            rows.sort(key=lambda pair: pair[0])
            return (torch.stack([r for _, r in rows]) if rows else _no_logits()), broken

    def _fork(self, live: _Live) -> None:
        """The prompt sequence becomes one sequence per sample, sharing its blocks."""
        prompt = live.prompt
        assert prompt is not None
        for row in live.request.rows:
            row.seq = Sequence(
                list(prompt.tokens),
                prompt.key,
                self.blocks.fork(prompt.table),
                prompt.computed,
                sealed=prompt.sealed,
            )
        self._release(prompt)
        live.prompt = None
        live.rows_left = list(live.request.rows)

    def _draw_params(self, rows: list[Row], vocab: int, device: torch.device) -> DrawParams:
        """The rows' parameters on the device, kept while the decode batch's rows stay."""
        held = self._params
        if (
            held is None
            or len(held[0]) != len(rows)
            or any(a is not b for a, b in zip(held[0], rows, strict=True))
        ):
            held = self._params = (list(rows), draw_params(rows, vocab, device))
        return held[1]

    def _sample(self) -> list[tuple[RunningRequest, SampleResult | EngineError]]:
        assert self.logits is not None
        logits, self.logits = self.logits, None  # used up: the next forward gives the next ones
        rows = [row for _, row in self.rows]
        params = self._draw_params(rows, logits.shape[-1], logits.device)
        outcomes = sample_rows(logits, rows, self.decode, params)
        # A row with a NaN or an infinity in its logits (its adapter's weights overflow) fails
        # its request alone (its request's rows drew nothing); so does a request whose own work
        # (a stop check) raised.
        failed: dict[int, tuple[_Live, EngineError]] = {}
        for i, outcome in enumerate(outcomes):
            if outcome is None or isinstance(outcome, EngineError):
                live = self.rows[i][0]
                error = EngineError(NON_FINITE_LOGITS, "user") if outcome is None else outcome
                failed.setdefault(id(live), (live, error))
        going = dict(enumerate(outcomes))
        finished: list[tuple[RunningRequest, SampleResult | EngineError]] = []
        for live, error in failed.values():
            self._end(live)
            finished.append((live.request, error))
        keep: list[tuple[_Live, Row]] = []
        for i, (live, row) in enumerate(self.rows):
            assert row.seq is not None
            if id(live) in failed:
                continue
            if going[i]:
                keep.append((live, row))
                row.seq.tokens.append(row.tokens[-1])
                continue
            self._release(row.seq)
            live.rows_left.remove(row)
            live.request.done += 1
            if live.request.done == len(live.request.rows):
                self._end(live)
                finished.append((live.request, _answer(live.request)))
            else:
                self._refund(live)
        self.rows = keep
        dry: dict[int, _Live] = {}
        for live, row in self.rows:  # room for each row's new token
            assert row.seq is not None
            try:
                self._room(live, row.seq, row.seq.computed + 1)
            except _OutOfBlocksError:
                dry[id(live)] = live
        if dry:  # a request admitted beyond the pool outgrew it: it fails, alone
            self.rows = [(lv, row) for lv, row in self.rows if id(lv) not in dry]
            for live in dry.values():
                self._end(live)
                finished.append((live.request, _out_of_blocks(self.blocks.num_blocks)))
        return finished

    def drop(self, unwanted: Callable[[SampleWork], bool]) -> list[RunningRequest]:
        """Remove the requests `unwanted` picks (decoding or still prefilling), unanswered (the
        caller answers them); their blocks return to the pool now."""
        dropped: list[RunningRequest] = []
        for live in [live for live in self.joining if unwanted(live.request.work)]:
            self.joining.remove(live)
            self._end(live)
            dropped.append(live.request)
        keep = [i for i, (live, _) in enumerate(self.rows) if not unwanted(live.request.work)]
        if len(keep) < len(self.rows):
            for live in {id(lv): lv for lv, _ in self.rows if unwanted(lv.request.work)}.values():
                self._end(live)
                dropped.append(live.request)
            if self.logits is not None:
                self.logits = self.logits[torch.tensor(keep, dtype=torch.long)]
            self.rows = [self.rows[i] for i in keep]
        return dropped

    def abort(self) -> list[RunningRequest]:
        """Drop everything (after an error): every block back, every request returned."""
        return self.drop(lambda _work: True)


def _no_logits() -> torch.Tensor:
    return torch.zeros((0, 0), dtype=torch.float32)


def _grouped_by_key(
    entries: list[tuple[_Live, Row, int]], joining: list[tuple[_Live, Row, int]]
) -> None:
    """Insert `joining` (one request's rows) into `entries` after the last row routed through
    the same adapter, or at the end. Across requests of several adapters in one decode batch
    (tenants sampling at once, their requests interleaved) a step then has one LoRA segment
    per adapter: per-request segments of a few rows each ran the products as many small
    matmuls, 2x a lone adapter's step at 32 requests of two adapters (docs/benchmarks.md).
    A row's values do not depend on its place in the batch (draws are seeded per row)."""
    key = joining[0][1].seq.key if joining[0][1].seq is not None else None
    at = len(entries)
    if _GROUP_BY_KEY:
        for index in range(len(entries) - 1, -1, -1):
            seq = entries[index][1].seq
            if seq is not None and seq.key == key:
                at = index + 1
                break
    entries[at:at] = joining


def _answer(request: RunningRequest) -> SampleResult | EngineError:
    """The request's result, or its error when building it fails (its own work, alone)."""
    try:
        return result(request)
    except Exception as exc:
        if not isinstance(exc, EngineError):
            log.exception("building a sampling result failed")
        return alone_error(exc, "sample")
