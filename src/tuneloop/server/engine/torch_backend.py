"""TorchBackend: frozen base models resident in memory, many LoRA adapters on each.

Training batches mix adapters and run in micro-batches (training.py); gradients accumulate
across forward_backward calls until that adapter's optim_step. Sampling runs on each model's
paged decoder (decoder.py), requests joining while it decodes (sampling_run.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tuneloop.server.engine import (
    checkpoints,
    compiled,
    cpu_fp32_matmul,
    gated_mlp,
    host_allocator,
    native_draw,
    packed,
    rotary,
    training,
)
from tuneloop.server.engine.backend import KVCacheUse
from tuneloop.server.engine.decoder import DEFAULT_PREFILL_CHUNK, Decoder
from tuneloop.server.engine.isolation import bisect_failures
from tuneloop.server.engine.kv.block_manager import KVUsage
from tuneloop.server.engine.memory import (
    kv_bytes_per_token,
    kv_cache_tokens,
    training_token_budget,
)
from tuneloop.server.engine.models import default_dtype, load_model, with_adapters
from tuneloop.server.engine.optim import AdapterOptimizer
from tuneloop.server.engine.packing import enable_packing
from tuneloop.server.engine.runtime import Runtime
from tuneloop.server.engine.sampling_run import ContinuousRun
from tuneloop.server.engine.types import (
    AdamStep,
    AdapterSpec,
    EngineError,
    ForwardBackwardResult,
    ForwardBackwardWork,
    ModelSpec,
    SampleResult,
    SampleWork,
)


@dataclass
class _Adapter:
    runtime: Runtime
    spec: AdapterSpec
    optimizer: AdapterOptimizer


def _device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TorchBackend:
    # Training work may run between the decode steps of a sampling batch: the model, its
    # adapter bank and the KV pool are this process's, and a decode step carries no state in
    # them from one step to the next but the pool (scheduler/admission.py).
    trains_between_decode_steps = True

    def __init__(
        self,
        models: Sequence[str],
        *,
        cache_dir: Path,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        token_budget: int | None = None,
        sample_token_budget: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        kv_block_size: int | None = None,
        merge_lone_adapter: bool | None = None,
        fuse_lone_key: bool | None = None,
        compile_norms: bool | None = None,
        decode_graphs: bool | None = None,
    ) -> None:
        self.device = _device(device)
        if self.device.type == "cpu":
            host_allocator.tune_for_cpu_engine()  # step-sized buffers stay mapped (its doc)
        self.dtype = dtype  # None: per model, the measured fastest (dtypes.py)
        # Tokens per training micro-batch (packed: real tokens; padded: rows x padded width):
        # a large request is split so that activations fit. None: sized from free memory.
        self.token_budget = token_budget or 0
        # KV-cache tokens of each model's sampling pool (decoder.py); None: sized from the
        # memory free when the pool is made (memory.kv_cache_tokens)
        self.sample_token_budget = sample_token_budget
        # Prompt tokens a joining request prefills per decode step (decoder.py).
        self.prefill_chunk = prefill_chunk
        self.kv_block_size = kv_block_size  # None: 16 tokens, 256 with the CUDA kernel
        # How a decode step whose rows all use one key (a frozen adapter snapshot or the base
        # model) runs its linear layers (model_runner.py, lora/fused.py): on a copy of their
        # weights with sibling layers (q/k/v, gate/up) stacked into one matmul, the adapter's
        # delta either merged into it (`merge_lone_adapter`) or in extra columns, its products
        # exact (`fuse_lone_key`); otherwise the base layers and the LoRA products.
        # merge_lone_adapter None: merged at fp32 on a CPU, where merging loses nothing (fp32
        # has the bits for a young adapter's delta) and sampling calls ran 1.18x the products';
        # not at half precision, where merged weights round most of the delta away (2 AdamW
        # steps at lr 1e-3 on SmolLM2-135M: 72 % of its norm) and the sampler's logprobs sit
        # 2-3x further from a training pass's (docs/benchmarks.md). True: always; False: never.
        # fuse_lone_key None: where this CPU packs the model's half-precision weights (bf16/fp16
        # with native kernels: 1.19x the products there, the delta kept whole; fp32 merged
        # copies are packed too, packed.py); True: always; False: never.
        # A merged copy wins where both are asked. Steps shared by several keys keep the
        # products (at fp32 a row's result then differs from its lone steps' by the kernels'
        # rounding, ~1e-7 in a logprob), their base part on a CPU from a shared packed copy
        # of the base weights (`AdapterBank.shared_weights`).
        self.merge_lone_adapter = merge_lone_adapter
        self.fuse_lone_key = fuse_lone_key
        # Decode steps replayed as CUDA graphs (decode_graphs.py). None: on a GPU.
        self.decode_graphs = decode_graphs
        self._runtimes: dict[str, Runtime] = {}
        for name in models:
            loaded = load_model(
                name,
                cache_dir=cache_dir,
                device=self.device,
                dtype=dtype or default_dtype(name, self.device),
            )
            pad = getattr(loaded.model.config, "pad_token_id", None)
            loaded, bank = with_adapters(loaded)  # or refused: layers LoRA cannot adapt
            # RMSNorms and the decode attention as compiled kernels (compiled.py,
            # kv/decode_attention.py). None: for models wide enough to pay for the seconds of
            # compiling (on CUDA the norms' kernels run inside decode graphs only).
            compile_kernels = compile_norms or (
                compile_norms is None and compiled.wanted(loaded.model, self.device)
            )
            if compile_kernels:
                threads = torch.get_num_threads()
                on_cpu = self.device.type == "cpu"
                compiled.install(loaded.model, training.part_threads(threads) if on_cpu else ())
                if on_cpu:  # sampling steps' SiLU product (gated_mlp.py)
                    gated_mlp.install(loaded.model)
            # the rotary embedding (rotary.py): C++ loops for the CPU steps of models wide
            # enough to pay for building them, else one node in training (torch's operations)
            rotary.install(loaded.model, loops=compile_kernels and self.device.type == "cpu")
            runtime = Runtime(
                loaded,
                bank,
                pad if isinstance(pad, int) else loaded.spec.eos_token_id,
                packed=enable_packing(loaded.model),
            )
            if compile_kernels and self.device.type == "cpu":  # CUDA: flash-attn or SDPA
                runtime.compile_decode()
            if self.device.type == "cpu":  # the draw's C++ kernel built now, not at the first
                native_draw.available()  # sampling step (native_draw.py)
                if next(loaded.model.parameters()).dtype == torch.float32:
                    cpu_fp32_matmul.onednn_chosen()  # its probe (~0.7 s) now, not in a request
            self._runtimes[loaded.spec.name] = runtime
            if token_budget is None:  # the tightest model's budget, measured after it loaded
                budget = training_token_budget(
                    loaded.model.config, next(loaded.model.parameters()).dtype, self.device
                )
                self.token_budget = min(self.token_budget or budget, budget)
        self._adapters: dict[str, _Adapter] = {}
        self._samplers: dict[str, Runtime] = {}
        # Bumped whenever a sampler id gets new factors: the prefix cache's namespace, so that
        # a re-created sampler never finds keys computed with another adapter's weights.
        self._versions: dict[str, int] = {}
        # The continuous run decoding now (engine thread writes; kv_cache_use reads its counts).
        self._run: ContinuousRun | None = None

    # ---- models and adapters ----------------------------------------------------------------

    def models(self) -> Sequence[ModelSpec]:
        return [rt.loaded.spec for rt in self._runtimes.values()]

    def resident_models(self) -> dict[str, nn.Module]:
        """Each loaded base model's module (a sharded worker group shards them in place)."""
        return {name: rt.model for name, rt in self._runtimes.items()}

    def _runtime(self, base_model: str) -> Runtime:
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

            def train(works: Sequence[ForwardBackwardWork], rt: Runtime = runtime) -> list[Any]:
                return list(training.train(rt, works, self.token_budget))

            # Micro-batches fail request by request (training.py); anything else that raises
            # runs the requests again apart, before any of them accumulated.
            trained = bisect_failures(train, [batch[i] for i in indices], "forward_backward")
            for index, result in zip(indices, trained, strict=True):
                results[index] = result
        self._release_host_memory()
        return [r if r is not None else EngineError("not run") for r in results]

    def _release_host_memory(self) -> None:
        """After a pass on a CPU: unused allocator pages back to the OS once past a slack over
        the working set (host_allocator.release_fragmentation; under jemalloc only)."""
        if self.device.type == "cpu":
            host_allocator.release_fragmentation()

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
        self._versions[sampler_id] = self._versions.get(sampler_id, 0) + 1

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
        self._versions[sampler_id] = self._versions.get(sampler_id, 0) + 1

    def delete_sampler(self, sampler_id: str) -> None:
        runtime = self._samplers.pop(sampler_id, None)
        if runtime is not None:
            runtime.bank.delete(sampler_id)
            if runtime.decoder is not None:  # its held routings point at the key's copy
                runtime.decoder.runner.forget_routings()

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
                run = ContinuousRun(
                    self._samplers.get, self._decoder, self._route, deliver, cancelled
                )
                self._run = run
                waiting = run.run(waiting, admit)
        finally:
            self._run = None
            self._release_host_memory()
            if self.device.type == "cuda":  # device memory is for KV blocks and training
                for runtime in self._runtimes.values():
                    runtime.bank.release_lone()
                    if runtime.decoder is not None:  # its held routings point at them too
                        runtime.decoder.runner.forget_routings()

    def _decoder(self, runtime: Runtime) -> Decoder:
        weight = next(runtime.model.parameters())
        merge, fuse = self.merge_lone_adapter, self.fuse_lone_key  # None: as __init__ says
        if merge is None:
            merge = fuse is not True and weight.dtype == torch.float32 and weight.is_cpu
        if fuse is None:
            fuse = weight.dtype != torch.float32 and packed.packable(weight)
        graphs = self.decode_graphs
        if graphs is None:
            graphs = self.device.type == "cuda"
        return runtime.sampling_decoder(
            self.sample_token_budget, self.prefill_chunk, self.kv_block_size, merge, fuse, graphs
        )

    def _route(self, sampler_id: str, runtime: Runtime) -> tuple[str | None, str]:
        """The adapter key a sampler's rows use (None: the base model) and its prefix-cache
        namespace: base-model samplers share one, each adapter snapshot has its own."""
        if sampler_id not in runtime.bank.specs:
            return None, ""
        return sampler_id, f"{sampler_id}#{self._versions.get(sampler_id, 0)}"

    def kv_cache_use(self) -> KVCacheUse:
        """Tokens (blocks in use x block size) and bytes the sampling KV pools hold now, their
        capacity, and the block counts admission reads: of the pool decoding now (or of the
        first model's, between runs). Counters only, safe to read from another thread while a
        step runs."""
        tokens = held = 0
        capacity = 0
        for runtime in list(self._runtimes.values()):
            decoder = runtime.decoder
            if decoder is None:
                continue
            blocks = decoder.blocks
            in_use = blocks.used() * blocks.block_size
            tokens += in_use
            held += in_use * kv_bytes_per_token(runtime.model.config, decoder.pool.dtype)
            capacity += blocks.num_blocks * blocks.block_size
        if not capacity and self._runtimes:  # no pool yet: what the first model's will take
            first = next(iter(self._runtimes.values())).model
            param = next(first.parameters())
            capacity = kv_cache_tokens(
                first.config, param.dtype, param.device, self.sample_token_budget
            )
        use = KVCacheUse(tokens, capacity or self.sample_token_budget or 0, held)
        run = self._run
        pools = [r.decoder for r in list(self._runtimes.values()) if r.decoder is not None]
        decoding = run.decoder if run is not None else (pools[0] if pools else None)
        if decoding is None:  # nothing sampled yet: no pool to count
            return use
        pool = decoding.blocks
        return replace(
            use,
            block_size=pool.block_size,
            total_blocks=pool.num_blocks,
            free_blocks=pool.available(),
            running=len(decoding),
            waiting=len(run.waiting) if run is not None else 0,
        )

    def kv_usage(self) -> dict[str, KVUsage]:
        """Per base model that has sampled, its KV pool's blocks (used, reserved, cached)."""
        return {
            name: runtime.decoder.usage()
            for name, runtime in self._runtimes.items()
            if runtime.decoder is not None
        }

    def close(self) -> None:
        self._adapters.clear()
        self._samplers.clear()
        self._runtimes.clear()
