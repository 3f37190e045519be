"""TorchBackend: frozen base models resident in memory, many LoRA adapters on each.

One forward/backward batch may hold rows of several adapters (sessions, tenants): each row is
routed through its own adapter (`lora.AdapterBank.routed`), the losses of every request are
summed, and one backward pass fills each adapter's gradients from its own rows only. Gradients
accumulate across forward_backward calls until that adapter's optim_step. Rows are packed end to
end with no padding (packing.py) on models whose attention allows it, padded otherwise.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tuneloop.server.engine import checkpoints, sampler
from tuneloop.server.engine.backend import KVCacheUse
from tuneloop.server.engine.custom_loss_graph import reduce_metrics
from tuneloop.server.engine.isolation import alone_error, bisect_failures
from tuneloop.server.engine.logprobs import (
    pack_rows,
    pack_targets,
    pad_rows,
    pad_targets,
    target_logprobs,
)
from tuneloop.server.engine.lora import AdapterBank
from tuneloop.server.engine.losses import datum_loss
from tuneloop.server.engine.memory import kv_bytes_per_token, training_token_budget
from tuneloop.server.engine.models import LoadedModel, default_dtype, load_model, with_adapters
from tuneloop.server.engine.optim import AdapterOptimizer
from tuneloop.server.engine.packing import enable_packing, packed_positions, packed_segments
from tuneloop.server.engine.types import (
    CANCELLED,
    AdamStep,
    AdapterSpec,
    EngineError,
    ForwardBackwardResult,
    ForwardBackwardWork,
    ModelSpec,
    SampleResult,
    SampleWork,
)

# KV-cache tokens (rows x (prompt + max_tokens)) per decode batch: SmolLM2-135M keeps ~46 KB per
# token in fp32, so 32k tokens is ~1.5 GB.
DEFAULT_SAMPLE_TOKEN_BUDGET = 32768
# Rows of one decode batch share a cache length (shorter prompts are left-padded), so a request
# joins a running batch only while the padded width stays within this factor of every request's
# own; one far longer or shorter starts a batch of its own (a length bucket), up to MAX_BUCKETS
# taking turns step by step. Without buckets a 1,536-token prompt joining 64 rows of ~160 tokens
# left-padded all 65 rows to ~1,600: 10x their KV memory (4.7 GB) and attention.
PAD_FACTOR = 2.0
MAX_BUCKETS = 4


@dataclass
class _Runtime:
    """One resident base model with its adapter bank."""

    loaded: LoadedModel
    bank: AdapterBank
    pad_id: int
    packed: bool = False  # training batches packed end to end (see packing.py)
    tokenizer: Any = None

    @property
    def model(self) -> nn.Module:
        return self.loaded.model

    @property
    def device(self) -> torch.device:
        return next(self.loaded.model.parameters()).device

    def decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(
                str(self.loaded.spec.tokenizer_dir / "tokenizer.json")
            )
        return str(self.tokenizer.decode(tokens, skip_special_tokens=False))


@dataclass
class _Adapter:
    runtime: _Runtime
    spec: AdapterSpec
    optimizer: AdapterOptimizer


@dataclass
class _Row:
    work_index: int
    key: str
    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


def _device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TorchBackend:
    def __init__(
        self,
        models: Sequence[str],
        *,
        cache_dir: Path,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        token_budget: int | None = None,
        sample_token_budget: int = DEFAULT_SAMPLE_TOKEN_BUDGET,
        prefill_chunk: int = sampler.DEFAULT_PREFILL_CHUNK,
        max_buckets: int = MAX_BUCKETS,
    ) -> None:
        self.device = _device(device)
        self.dtype = dtype  # None: per model, the measured fastest (dtypes.py)
        # Tokens per training micro-batch (packed: real tokens; padded: rows x padded width):
        # a large request is split so that activations fit. None: sized from free memory.
        self.token_budget = token_budget or 0
        self.sample_token_budget = sample_token_budget
        # Prompt tokens a joining request prefills per decode step (sampler.DecodeBatch).
        self.prefill_chunk = prefill_chunk
        # Length buckets of a decode run (1: every request left-padded into one batch).
        self.max_buckets = max(1, max_buckets)
        self.pad_factor = PAD_FACTOR
        self._runtimes: dict[str, _Runtime] = {}
        for name in models:
            loaded = load_model(
                name,
                cache_dir=cache_dir,
                device=self.device,
                dtype=dtype or default_dtype(name, self.device),
            )
            pad = getattr(loaded.model.config, "pad_token_id", None)
            loaded, bank = with_adapters(loaded)  # or refused: layers LoRA cannot adapt
            self._runtimes[loaded.spec.name] = _Runtime(
                loaded,
                bank,
                pad if isinstance(pad, int) else loaded.spec.eos_token_id,
                packed=enable_packing(loaded.model),
            )
            if token_budget is None:  # the tightest model's budget, measured after it loaded
                budget = training_token_budget(
                    loaded.model.config, next(loaded.model.parameters()).dtype, self.device
                )
                self.token_budget = min(self.token_budget or budget, budget)
        self._adapters: dict[str, _Adapter] = {}
        self._samplers: dict[str, _Runtime] = {}
        # (tokens, bytes) the running decode run's KV cache holds: replaced whole once per decode
        # step on the engine thread, so a reader on another thread sees a consistent pair.
        self._kv_held = (0, 0)

    # ---- models and adapters ----------------------------------------------------------------

    def models(self) -> Sequence[ModelSpec]:
        return [rt.loaded.spec for rt in self._runtimes.values()]

    def _runtime(self, base_model: str) -> _Runtime:
        runtime = self._runtimes.get(base_model)
        if runtime is None:
            raise EngineError(f"model {base_model!r} is not loaded on this server", "user")
        return runtime

    def _adapter(self, adapter_id: str) -> _Adapter:
        adapter = self._adapters.get(adapter_id)
        if adapter is None:
            raise EngineError(f"no adapter {adapter_id!r}", "user")
        return adapter

    def create_adapter(self, spec: AdapterSpec) -> None:
        runtime = self._runtime(spec.base_model)
        params = runtime.bank.create(spec, runtime.device)
        self._adapters[spec.adapter_id] = _Adapter(runtime, spec, AdapterOptimizer(params))

    def delete_adapter(self, adapter_id: str) -> None:
        adapter = self._adapters.pop(adapter_id, None)
        if adapter is not None:
            adapter.runtime.bank.delete(adapter_id)

    # ---- training ---------------------------------------------------------------------------

    def forward_backward(
        self, batch: Sequence[ForwardBackwardWork]
    ) -> list[ForwardBackwardResult | EngineError]:
        results: list[ForwardBackwardResult | EngineError | None] = [None] * len(batch)
        by_runtime: dict[int, list[int]] = {}
        for index, work in enumerate(batch):
            try:
                runtime = self._adapter(work.adapter_id).runtime
            except EngineError as exc:
                results[index] = exc
                continue
            by_runtime.setdefault(id(runtime), []).append(index)
        for indices in by_runtime.values():
            runtime = self._adapters[batch[indices[0]].adapter_id].runtime

            def train(works: Sequence[ForwardBackwardWork], rt: _Runtime = runtime) -> list[Any]:
                return list(self._train(rt, works))

            # Micro-batches fail request by request (_isolated_micro_batch); anything else that
            # raises runs the requests again apart, before any of them accumulated.
            trained = bisect_failures(train, [batch[i] for i in indices], "forward_backward")
            for index, result in zip(indices, trained, strict=True):
                results[index] = result
        return [r if r is not None else EngineError("not run") for r in results]

    def _micro_batches(self, rows: list[_Row], packed: bool) -> list[tuple[list[_Row], int | None]]:
        """Split rows under the token budget (packed: total tokens; else rows x padded width).

        A request that fits the budget is never split across micro-batches; one that does not
        runs alone in consecutive micro-batches, named by the second value, so that its gradient
        can be taken back if it fails part-way.
        """
        by_work: dict[int, list[_Row]] = {}
        for row in rows:
            by_work.setdefault(row.work_index, []).append(row)
        batches: list[tuple[list[_Row], int | None]] = []
        current: list[_Row] = []

        def fits(candidate: list[_Row]) -> bool:
            return self._tokens(candidate, packed) <= self.token_budget

        for work_index, work_rows in by_work.items():
            if fits(current + work_rows):
                current += work_rows
                continue
            if current:
                batches.append((current, None))
                current = []
            if fits(work_rows):
                current = list(work_rows)
                continue
            part: list[_Row] = []
            for row in work_rows:
                if part and not fits([*part, row]):
                    batches.append((part, work_index))
                    part = []
                part.append(row)
            batches.append((part, work_index))
        if current:
            batches.append((current, None))
        return batches

    @staticmethod
    def _tokens(rows: list[_Row], packed: bool) -> int:
        if packed:
            return sum(len(r.tokens) for r in rows)
        return max((len(r.tokens) for r in rows), default=0) * len(rows)

    def _train(
        self, runtime: _Runtime, works: Sequence[ForwardBackwardWork]
    ) -> list[ForwardBackwardResult | EngineError]:
        rows = [
            _Row(wi, work.adapter_id, ex.tokens, dict(ex.inputs))
            for wi, work in enumerate(works)
            for ex in work.examples
        ]
        losses = [0.0] * len(works)
        metric_sums: list[dict[str, float]] = [{} for _ in works]
        logprobs: list[list[np.ndarray]] = [[] for _ in works]
        failed: dict[int, EngineError] = {}
        # Gradients of the adapter of a request split over several micro-batches, as they were
        # before it: restored if the request fails after some of its micro-batches ran.
        saved: tuple[int, list[torch.Tensor | None]] | None = None
        for micro, alone in [*self._micro_batches(rows, runtime.packed), ([], None)]:
            if saved is not None and saved[0] != alone:
                if saved[0] in failed:
                    params = runtime.bank.parameters(works[saved[0]].adapter_id)
                    for param, grad in zip(params, saved[1], strict=True):
                        param.grad = grad
                saved = None
            if not micro:
                break
            if alone is not None and saved is None and not works[alone].forward_only:
                params = runtime.bank.parameters(works[alone].adapter_id)
                saved = (alone, [None if p.grad is None else p.grad.clone() for p in params])
            try:
                self._isolated_micro_batch(
                    runtime, works, micro, losses, logprobs, failed, metric_sums
                )
            except torch.OutOfMemoryError:
                for row in micro:
                    failed.setdefault(
                        row.work_index,
                        EngineError(
                            "out of memory even for one micro-batch: send fewer or shorter datums",
                            "user",
                        ),
                    )
        return [
            failed.get(i)
            or ForwardBackwardResult(
                logprobs[i],
                {"loss:sum": losses[i], **reduce_metrics(metric_sums[i], len(works[i].examples))},
            )
            for i in range(len(works))
        ]

    def _isolated_micro_batch(
        self,
        runtime: _Runtime,
        works: Sequence[ForwardBackwardWork],
        micro: list[_Row],
        losses: list[float],
        logprobs: list[list[np.ndarray]],
        failed: dict[int, EngineError],
        metric_sums: list[dict[str, float]],
    ) -> None:
        """`_run_micro_batch`, its gradients accumulated only if they are finite.

        The micro-batch's gradients are computed apart from those accumulated before and added
        to them once checked. If they are not finite (rows of several requests share a packed
        attention, where one request's overflowing gradient reaches the others' through
        masked-out positions, 0 x inf), or the micro-batch raises, they are dropped and each
        request runs again alone: the one that fails alone fails, with nothing accumulated,
        and every other gets what it gets alone.
        """
        keys = list(dict.fromkeys(works[r.work_index].adapter_id for r in micro))
        params = {
            key: runtime.bank.parameters(key)
            for key in keys
            if any(not works[r.work_index].forward_only and r.key == key for r in micro)
        }
        held = {key: [p.grad for p in ps] for key, ps in params.items()}
        for ps in params.values():
            for param in ps:
                param.grad = None
        indices = list(dict.fromkeys(r.work_index for r in micro))
        before = (
            dict(failed),
            {i: losses[i] for i in indices},
            {i: len(logprobs[i]) for i in indices},
            {i: dict(metric_sums[i]) for i in indices},
        )
        try:
            self._run_micro_batch(runtime, works, micro, losses, logprobs, failed, metric_sums)
        except torch.OutOfMemoryError:
            _put_back(params, held, keep_new=False)
            raise
        except Exception as exc:
            _put_back(params, held, keep_new=False)
            error: EngineError = alone_error(exc, "forward_backward")
        else:
            if all(_finite_grads(ps) for ps in params.values()):
                _put_back(params, held, keep_new=True)
                return
            _put_back(params, held, keep_new=False)
            error = EngineError(
                "the gradients of this request are not finite (its loss inputs are too large "
                "for its model); nothing was accumulated",
                "user",
            )
        failed.clear()
        failed.update(before[0])
        for i in indices:
            losses[i] = before[1][i]
            del logprobs[i][before[2][i] :]
            metric_sums[i] = before[3][i]
        if len(indices) == 1:
            failed.setdefault(indices[0], error)
            return
        for i in indices:
            alone = [r for r in micro if r.work_index == i]
            self._isolated_micro_batch(runtime, works, alone, losses, logprobs, failed, metric_sums)

    def _run_micro_batch(
        self,
        runtime: _Runtime,
        works: Sequence[ForwardBackwardWork],
        micro: list[_Row],
        losses: list[float],
        logprobs: list[list[np.ndarray]],
        failed: dict[int, EngineError],
        metric_sums: list[dict[str, float]],
    ) -> None:
        device = runtime.device
        needs_grad = any(not works[r.work_index].forward_only for r in micro)
        lengths = [len(r.tokens) for r in micro]
        row_targets = [r.inputs["target_tokens"] for r in micro]
        if runtime.packed:
            input_ids = pack_rows([r.tokens for r in micro], device)
            targets = pack_targets(row_targets, device)
            positions: torch.Tensor | None = packed_positions(lengths, device)
            # row i's positions in the [1, total] output start after the rows before it
            offsets = [(0, start) for start in itertools.accumulate([0, *lengths[:-1]])]
            segments: Any = packed_segments(lengths)
        else:
            input_ids = pad_rows([r.tokens for r in micro], runtime.pad_id, device)
            targets = pad_targets(row_targets, input_ids.shape[1], device)
            positions = None
            offsets = [(i, 0) for i in range(len(micro))]
            segments = contextlib.nullcontext()
        with (
            runtime.bank.routed([r.key for r in micro], lengths if runtime.packed else None),
            segments,
            torch.set_grad_enabled(needs_grad),
        ):
            all_lp = target_logprobs(runtime.model, input_ids, lengths, targets, positions)
            row_losses: list[tuple[int, torch.Tensor]] = []
            for i, row in enumerate(micro):
                target = row.inputs["target_tokens"]
                batch_row, start = offsets[i]
                lp = all_lp[
                    batch_row,
                    start : start + len(row.tokens),
                    : (1 if target.ndim == 1 else target.shape[1]),
                ]
                lp = lp[:, 0] if target.ndim == 1 else lp
                work = works[row.work_index]
                try:
                    loss, extra = datum_loss(work, lp, row.inputs, device)
                except EngineError as exc:  # e.g. an unknown loss: fails this request only
                    failed.setdefault(row.work_index, exc)
                    continue
                value = float(loss.detach())
                if not math.isfinite(value):
                    failed.setdefault(
                        row.work_index,
                        EngineError(
                            f"the {work.loss_fn} loss is not finite for this request", "user"
                        ),
                    )
                    continue
                losses[row.work_index] += value
                sums = metric_sums[row.work_index]
                for key, metric in extra.items():
                    sums[key] = sums.get(key, 0.0) + metric
                logprobs[row.work_index].append(lp.detach().float().cpu().numpy())
                if not work.forward_only:
                    row_losses.append((row.work_index, loss))
            total = [loss for wi, loss in row_losses if wi not in failed]
            if needs_grad and total:
                # Backward inside the routing block: checkpointed LM-head chunks recompute
                # through the same adapters.
                torch.stack(total).sum().backward()

    def optim_step(self, adapter_id: str, step: AdamStep) -> dict[str, float]:
        return self._adapter(adapter_id).optimizer.step(step)

    # ---- state ------------------------------------------------------------------------------

    def save_state(self, adapter_id: str, directory: Path, *, optimizer: bool) -> int:
        adapter = self._adapter(adapter_id)
        factors = adapter.runtime.bank.state(adapter_id)
        if not optimizer:
            return checkpoints.write_adapter(directory, adapter.spec, factors)
        return checkpoints.write_adapter(
            directory,
            adapter.spec,
            factors,
            adapter.optimizer.state_dict(),
            adapter.optimizer.steps,
        )

    def save_sampler_weights(self, adapter_id: str, directory: Path) -> int:
        adapter = self._adapter(adapter_id)
        return checkpoints.write_adapter(
            directory, adapter.spec, adapter.runtime.bank.state(adapter_id)
        )

    def load_state(self, adapter_id: str, directory: Path, *, optimizer: bool) -> None:
        self._adapter(adapter_id)  # a missing adapter is the error, not a missing file
        factors = checkpoints.read_factors(directory)
        optimizer_state = checkpoints.read_optimizer(directory) if optimizer else None
        self.restore_adapter(adapter_id, factors, optimizer_state)

    # ---- hooks for worker groups (engine/workers): state in memory, gradients -----------------

    def restore_adapter(
        self,
        adapter_id: str,
        factors: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any] | None,
    ) -> None:
        """Set an adapter's factors (PEFT-named) and optimizer state (None: a fresh optimizer);
        accumulated gradients are dropped."""
        adapter = self._adapter(adapter_id)
        adapter.runtime.bank.load(adapter_id, factors)
        params = adapter.runtime.bank.parameters(adapter_id)
        adapter.optimizer = AdapterOptimizer(params)  # fresh, unless restored below
        if optimizer_state is not None:
            adapter.optimizer.load_state_dict(optimizer_state)
        for param in params:
            param.grad = None

    def adapter_state(self, adapter_id: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """An adapter's factors and optimizer state (`restore_adapter` takes them back)."""
        adapter = self._adapter(adapter_id)
        return adapter.runtime.bank.state(adapter_id), adapter.optimizer.state_dict()

    def adapter_parameters(self, adapter_id: str) -> list[nn.Parameter]:
        """An adapter's trainable factors in the optimizer's order (gradients live on them)."""
        return self._adapter(adapter_id).runtime.bank.parameters(adapter_id)

    def add_frozen_sampler(
        self, sampler_id: str, spec: AdapterSpec, factors: dict[str, torch.Tensor]
    ) -> None:
        """A sampler over factors held in memory (a snapshot restored elsewhere)."""
        runtime = self._runtime(spec.base_model)
        self.delete_sampler(sampler_id)
        runtime.bank.add_frozen(sampler_id, spec, factors)
        self._samplers[sampler_id] = runtime

    def sampler_state(self, sampler_id: str) -> tuple[AdapterSpec, dict[str, torch.Tensor]] | None:
        """A sampler's spec and factors (None: the base model alone, or no such sampler)."""
        runtime = self._samplers.get(sampler_id)
        if runtime is None or sampler_id not in runtime.bank.specs:
            return None
        return runtime.bank.specs[sampler_id], runtime.bank.state(sampler_id)

    # ---- sampling ---------------------------------------------------------------------------

    def create_sampler(
        self,
        sampler_id: str,
        base_model: str,
        *,
        adapter_id: str | None = None,
        weights_dir: Path | None = None,
    ) -> None:
        runtime = self._runtime(base_model)
        if sampler_id in self._adapters:
            raise EngineError(f"{sampler_id!r} names a training adapter", "user")
        self.delete_sampler(sampler_id)  # a reused id must not keep stale factors
        if adapter_id is not None:
            runtime.bank.snapshot(adapter_id, sampler_id)  # in memory, as of now
        elif weights_dir is not None:
            spec = checkpoints.read_spec(weights_dir, sampler_id)
            runtime.bank.add_frozen(sampler_id, spec, checkpoints.read_factors(weights_dir))
        self._samplers[sampler_id] = runtime

    def delete_sampler(self, sampler_id: str) -> None:
        runtime = self._samplers.pop(sampler_id, None)
        if runtime is not None:
            runtime.bank.delete(sampler_id)

    _decoding: _DecodeRun | None = None  # the decode run under way, for kv_tokens_in_use

    def sample(self, batch: Sequence[SampleWork]) -> list[SampleResult | EngineError]:
        """Every request of `batch`, in decode batches under the KV-token budget."""
        results: dict[int, SampleResult | EngineError] = {}
        self.sample_continuous(batch, list, lambda work, result: results.update({id(work): result}))
        return [results.get(id(w), EngineError("not run")) for w in batch]

    def sample_continuous(
        self,
        batch: Sequence[SampleWork],
        admit: Callable[[], Sequence[SampleWork]],
        deliver: Callable[[SampleWork, SampleResult | EngineError], None],
        cancelled: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        """Continuous batching: sample `batch`, let the requests `admit()` returns join the
        running decode batch at step boundaries, and `deliver` each result as soon as it is done.

        A joining request waits for the next decode batch when it is for another base model or
        its KV cache would exceed the token budget; `admit()` is called once per decode step.
        Requests of the samplers `cancelled()` names leave at the next step, answered with an
        error.
        """
        waiting = list(batch)
        try:
            while waiting:
                self._decoding = run = _DecodeRun(self, deliver, cancelled)
                waiting = run.run(waiting, admit)
        finally:
            self._decoding = None

    def kv_tokens_in_use(self) -> int:
        """KV-cache tokens the running decode batches hold (0 when none runs). For monitoring,
        from another thread: a step under way may change it as it is read."""
        run = self._decoding
        return sum(b.batch.kv_tokens() for b in list(run.buckets)) if run is not None else 0

    def kv_cache_use(self) -> KVCacheUse:
        tokens, held_bytes = self._kv_held
        return KVCacheUse(tokens=tokens, token_budget=self.sample_token_budget, bytes=held_bytes)

    def close(self) -> None:
        self._adapters.clear()
        self._samplers.clear()
        self._runtimes.clear()


def _put_back(
    params: dict[str, list[nn.Parameter]],
    held: dict[str, list[torch.Tensor | None]],
    *,
    keep_new: bool,
) -> None:
    """Gradients back to those `held` before a micro-batch, its own added (`keep_new`)."""
    for key, ps in params.items():
        for param, old in zip(ps, held[key], strict=True):
            new = param.grad if keep_new else None
            if old is not None and new is not None:
                param.grad = old.add_(new)
            else:
                param.grad = old if old is not None else new


def _finite_grads(params: Sequence[nn.Parameter]) -> bool:
    """Whether the gradients' global norm is finite (what optim_step requires)."""
    grads = [p.grad for p in params if p.grad is not None]
    return not grads or bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))


def _cancelled() -> EngineError:
    return EngineError(CANCELLED, "user")


def _width(work: SampleWork) -> int:
    """The cache length a request's rows reach: its prompt plus everything it may generate."""
    return len(work.prompt) + work.max_tokens


class _Bucket:
    """One decode batch of a run, with the widths and KV bound its admission rules need."""

    def __init__(self, batch: sampler.DecodeBatch, pad_factor: float) -> None:
        self.batch = batch
        self.pad_factor = pad_factor
        self.incoming: list[SampleWork] = []  # placed here by the join under way

    def _live(self) -> list[SampleWork]:
        return [request.work for request in self.batch.requests()] + self.incoming

    def width(self) -> int:
        """The widest its cache may grow: its padded width now plus the most a live row may
        still generate, or a live request's full width if larger."""
        live = self._live()
        if not live:
            return 0
        grow = max(w.max_tokens for w in live)
        return max([self.batch.mask.shape[1] + grow, *(_width(w) for w in live)])

    def kv_bound(self, extra_rows: int = 0, extra_width: int = 0) -> int:
        """Upper bound of the padded KV tokens, rows x width, with a request added."""
        rows = len(self.batch) + sum(w.num_samples for w in self.incoming) + extra_rows
        return rows * max(self.width(), extra_width)

    def fits(self, width: int) -> bool:
        live = self._live()
        if not live:
            return True
        widths = [_width(w) for w in live] + [self.width(), width]
        return max(widths) <= self.pad_factor * min(widths)


class _DecodeRun:
    """One decode run of `TorchBackend.sample_continuous`: one base model, requests joining
    while it runs, in length buckets under the KV-token budget."""

    def __init__(
        self,
        backend: TorchBackend,
        deliver: Callable[[SampleWork, SampleResult | EngineError], None],
        cancelled: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self.backend = backend
        self.deliver = deliver
        self.cancelled = cancelled
        self.runtime: _Runtime | None = None
        self.buckets: list[_Bucket] = []
        self.running: dict[int, SampleWork] = {}  # by id: SampleWork holds arrays, no __eq__
        self.later: list[SampleWork] = []  # for the next decode run
        self._kv_per_token: int | None = None  # KV-cache bytes per token of this run's model

    def _place(self, work: SampleWork, used: int) -> tuple[_Bucket | None, int] | None:
        """The bucket a request joins (None: a new one) and the KV tokens it adds; None if it
        must wait for the next decode run."""
        width = _width(work)
        # A fitting bucket if there is one (each bucket costs a forward pass per step), the one
        # it pads least; else a new bucket while there may be more.
        options: list[tuple[int, _Bucket | None]] = [
            (b.kv_bound(work.num_samples, width) - b.kv_bound(), b)
            for b in self.buckets
            if b.fits(width)
        ]
        if not options and len(self.buckets) < self.backend.max_buckets:
            options.append((work.num_samples * width, None))
        if not options:
            return None
        added, bucket = min(options, key=lambda o: o[0])
        if used and used + added > self.backend.sample_token_budget:
            return None
        return bucket, added

    def join(self, works: Sequence[SampleWork]) -> None:
        if not works:  # the common case, once per decode step: no bound to compute
            return
        used = sum(b.kv_bound() for b in self.buckets)
        gone = self.cancelled()
        for work in works:
            if work.cancelled_by(gone):
                self.deliver(work, _cancelled())
                continue
            owner = self.backend._samplers.get(work.sampler_id)
            if owner is None:
                self.deliver(work, EngineError(f"no sampler {work.sampler_id!r}", "user"))
                continue
            self.runtime = self.runtime or owner
            place = self._place(work, used) if owner is self.runtime else None
            if place is None:
                self.later.append(work)
                continue
            bucket, added = place
            if bucket is None:
                bucket = _Bucket(
                    sampler.DecodeBatch(
                        owner.model,
                        owner.bank,
                        pad_id=owner.pad_id,
                        decode=owner.decode,
                        prefill_chunk=self.backend.prefill_chunk,
                    ),
                    self.backend.pad_factor,
                )
                self.buckets.append(bucket)
            bucket.incoming.append(work)
            used += added
        runtime = self.runtime
        if runtime is None:
            return
        for bucket in self.buckets:
            fits, bucket.incoming = bucket.incoming, []
            if not fits:
                continue
            keys = [w.sampler_id if w.sampler_id in runtime.bank.specs else None for w in fits]
            self.running.update((id(w), w) for w in fits)
            others = any(b.batch.rows for b in self.buckets if b is not bucket)
            bucket.batch.add(fits, keys, others_decoding=others)

    def run(
        self, works: Sequence[SampleWork], admit: Callable[[], Sequence[SampleWork]]
    ) -> list[SampleWork]:
        """Decode until no row is left; returns the requests left for the next decode run."""
        try:
            self.join(works)
            while self.buckets:
                for bucket in list(self.buckets):
                    others = any(b.batch.rows for b in self.buckets if b is not bucket)
                    for request, result in bucket.batch.step(others_decoding=others):
                        self.running.pop(id(request.work), None)
                        self.deliver(request.work, result)
                self._drop_cancelled()
                for bucket in [b for b in self.buckets if not len(b.batch)]:
                    bucket.batch.close()
                    self.buckets.remove(bucket)
                self.join(admit())
                self._account_kv()
        except torch.OutOfMemoryError:
            for work in self.running.values():
                self.deliver(
                    work, EngineError("out of memory while sampling; retry with fewer samples")
                )
        finally:
            for bucket in self.buckets:
                bucket.batch.close()
            self.backend._kv_held = (0, 0)
        return self.later

    def _account_kv(self) -> None:
        """Publish the KV tokens held now, for `TorchBackend.kv_cache_use`."""
        tokens = sum(b.batch.kv_tokens() for b in self.buckets)
        if self._kv_per_token is None and self.runtime is not None:
            model = self.runtime.loaded.model
            self._kv_per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
        self.backend._kv_held = (tokens, tokens * (self._kv_per_token or 0))

    def _drop_cancelled(self) -> None:
        gone = self.cancelled()
        if not gone:
            return
        for bucket in self.buckets:
            for request in bucket.batch.drop(lambda work: work.cancelled_by(gone)):
                self.running.pop(id(request.work), None)
                self.deliver(request.work, _cancelled())
        for work in self.later:
            if work.cancelled_by(gone):
                self.deliver(work, _cancelled())
        self.later = [w for w in self.later if not w.cancelled_by(gone)]
