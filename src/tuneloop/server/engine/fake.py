"""FakeBackend: a deterministic NumPy "model" behind the real `Backend` protocol.

The model is a bigram table (logits depend on the current token only) plus, per adapter, a
low-rank update `A[token] @ B * alpha/rank` (B starts at zero, so a new adapter equals the
base, as LoRA does). Gradients are exact and analytic, losses come from `loss_math`, AdamW is
real, so training through the control plane really changes what the model samples. It exists
to test the layers above the engine quickly and without torch; it is not the engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from tuneloop.server.engine import loss_math
from tuneloop.server.engine.backend import KVCacheUse
from tuneloop.server.engine.files import atomic_directory, directory_size
from tuneloop.server.engine.isolation import (
    NON_FINITE_LOGITS,
    all_finite,
    alone_error,
    skipped_step_metrics,
)
from tuneloop.server.engine.loss_specs import LOSS_SPECS
from tuneloop.server.engine.types import (
    AdamStep,
    AdapterSpec,
    EngineError,
    Example,
    ForwardBackwardResult,
    ForwardBackwardWork,
    ModelSpec,
    SampledTokens,
    SampleResult,
    SampleWork,
    TopkRow,
)

FAKE_MODEL_NAME = "tuneloop/fake-tiny"
_TOKENIZER_DIR = Path(str(resources.files("tuneloop") / "assets" / "tokenizers" / "byte-level"))


# A frozen low-rank update: (A [V, r], B [r, V], alpha / rank).
_Lora = tuple[np.ndarray, np.ndarray, float]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@dataclass
class _Adapter:
    spec: AdapterSpec
    a: np.ndarray  # [V, r]
    b: np.ndarray  # [r, V]
    grad_a: np.ndarray
    grad_b: np.ndarray
    m: list[np.ndarray]
    v: list[np.ndarray]
    step: int = 0

    @property
    def scale(self) -> float:
        return self.spec.alpha / self.spec.rank

    def params(self) -> list[np.ndarray]:
        return [self.a, self.b]


class FakeBackend:
    def __init__(self, vocab_size: int = 259, max_context_length: int = 2048, seed: int = 0):
        rng = np.random.default_rng(seed)
        self._spec = ModelSpec(
            name=FAKE_MODEL_NAME,
            arch="bigram",
            vocab_size=vocab_size,
            max_context_length=max_context_length,
            eos_token_id=258,
            tokenizer_dir=_TOKENIZER_DIR,
        )
        self._base = rng.normal(0.0, 2.0, size=(vocab_size, vocab_size))  # [V, V]
        self._adapters: dict[str, _Adapter] = {}
        self._samplers: dict[str, _Lora | None] = {}
        self._tokenizer: Any = None

    # ---- models and adapters ----------------------------------------------------------------

    def models(self) -> Sequence[ModelSpec]:
        return [self._spec]

    def _check_model(self, name: str) -> None:
        if name != self._spec.name:
            raise EngineError(f"model {name!r} is not served by this backend", "user")

    def create_adapter(self, spec: AdapterSpec) -> None:
        self._check_model(spec.base_model)
        vocab = self._spec.vocab_size
        rng = np.random.default_rng(spec.seed)
        a = rng.normal(0.0, 1.0 / np.sqrt(spec.rank), size=(vocab, spec.rank))
        b = np.zeros((spec.rank, vocab))
        self._adapters[spec.adapter_id] = _Adapter(
            spec,
            a,
            b,
            np.zeros_like(a),
            np.zeros_like(b),
            [np.zeros_like(a), np.zeros_like(b)],
            [np.zeros_like(a), np.zeros_like(b)],
        )

    def delete_adapter(self, adapter_id: str) -> None:
        self._adapters.pop(adapter_id, None)

    def _adapter(self, adapter_id: str) -> _Adapter:
        try:
            return self._adapters[adapter_id]
        except KeyError:
            raise EngineError(f"no adapter {adapter_id!r}", "user") from None

    def _logits(self, tokens: np.ndarray, lora: _Lora | None) -> np.ndarray:
        logits = self._base[tokens]
        if lora is not None:
            a, b, scale = lora
            with np.errstate(over="ignore", invalid="ignore"):  # checked by the callers
                logits = logits + scale * (a[tokens] @ b)
        return logits

    # ---- training ---------------------------------------------------------------------------

    def forward_backward(
        self, batch: Sequence[ForwardBackwardWork]
    ) -> list[ForwardBackwardResult | EngineError]:
        results: list[ForwardBackwardResult | EngineError] = []
        for work in batch:
            # Each request on its own: whatever one raises fails it alone.
            try:
                results.append(self._forward_backward_one(work))
            except Exception as exc:
                results.append(alone_error(exc, "forward_backward"))
        return results

    def _forward_backward_one(self, work: ForwardBackwardWork) -> ForwardBackwardResult:
        adapter = self._adapter(work.adapter_id)
        total = 0.0
        metric_sums: dict[str, float] = {}
        outputs: list[np.ndarray] = []
        # This request's gradients, added to the adapter's only once all are known and finite:
        # a request that fails part-way leaves the adapter as it was.
        grad_a, grad_b = np.zeros_like(adapter.grad_a), np.zeros_like(adapter.grad_b)
        # Overflows are not warned about: the loss and gradients are checked below.
        for example in work.examples:
            lp, logprobs_all, targets = self._target_logprobs(adapter, example)
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                if work.custom_loss is not None:
                    # torch only for this: the graph is torch ops (autograd gives d loss / d lp)
                    from tuneloop.server.engine import custom_loss

                    loss, grad_lp, metrics = custom_loss.value_and_grad(
                        work.custom_loss, lp.astype(np.float32), example.inputs
                    )
                    for key, value in metrics.items():
                        metric_sums[key] = metric_sums.get(key, 0.0) + value
                else:
                    loss_fn = loss_math.LOSS_FUNCTIONS[work.loss_fn]
                    config = {**LOSS_SPECS[work.loss_fn].config_defaults, **work.loss_config}
                    inputs = {
                        k: v.astype(np.float64)
                        for k, v in example.inputs.items()
                        if k != "target_tokens"
                    }
                    loss, grad_lp = loss_fn(lp, inputs, config)
                total += loss
                outputs.append(lp.astype(np.float32))
                if not work.forward_only:
                    self._accumulate(
                        adapter, example.tokens, logprobs_all, targets, grad_lp, (grad_a, grad_b)
                    )
        if not np.isfinite(total) or not all_finite(*outputs):
            raise EngineError(f"the {work.loss_fn} loss is not finite for this request", "user")
        if not all_finite(grad_a, grad_b):
            raise EngineError(
                "the gradients of this request are not finite (its loss inputs are too large); "
                "nothing was accumulated",
                "user",
            )
        adapter.grad_a += grad_a
        adapter.grad_b += grad_b
        if metric_sums:
            from tuneloop.server.engine.custom_loss_graph import reduce_metrics

            return ForwardBackwardResult(
                outputs, {"loss:sum": total, **reduce_metrics(metric_sums, len(work.examples))}
            )
        return ForwardBackwardResult(outputs, {"loss:sum": total})

    def _target_logprobs(
        self, adapter: _Adapter, example: Example
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lora = (adapter.a, adapter.b, adapter.scale)
        logprobs_all = _log_softmax(self._logits(example.tokens, lora))  # [N, V]
        targets = example.inputs["target_tokens"]
        targets_2d = targets if targets.ndim == 2 else targets[:, None]  # [N, K]
        lp = np.take_along_axis(logprobs_all, targets_2d, axis=1)
        return (lp if targets.ndim == 2 else lp[:, 0]), logprobs_all, targets_2d

    def _accumulate(
        self,
        adapter: _Adapter,
        tokens: np.ndarray,
        logprobs_all: np.ndarray,
        targets_2d: np.ndarray,
        grad_lp: np.ndarray,
        into: tuple[np.ndarray, np.ndarray],
    ) -> None:
        grad_2d = grad_lp if grad_lp.ndim == 2 else grad_lp[:, None]  # [N, K]
        probs = np.exp(logprobs_all)
        # d lp[t,k] / d logits[t] = onehot(target[t,k]) - softmax[t]
        dlogits = -grad_2d.sum(axis=1, keepdims=True) * probs
        np.add.at(dlogits, (np.arange(len(tokens))[:, None], targets_2d), grad_2d)
        scale = adapter.scale
        grad_a, grad_b = into
        np.add.at(grad_a, tokens, scale * dlogits @ adapter.b.T)
        grad_b += scale * adapter.a[tokens].T @ dlogits

    def optim_step(self, adapter_id: str, step: AdamStep) -> dict[str, float]:
        """One AdamW step, computed aside and kept only if all of it is finite; otherwise
        skipped (as mixed-precision trainers skip a step), said so in the metrics
        (`isolation.skipped_step_metrics`). Either way the gradients are cleared."""
        adapter = self._adapter(adapter_id)
        grads = [adapter.grad_a, adapter.grad_b]
        with np.errstate(over="ignore", invalid="ignore"):
            norm = float(np.sqrt(sum((g**2).sum() for g in grads)))
        if not np.isfinite(norm):
            self._clear_grads(adapter)
            return skipped_step_metrics("gradients", step.learning_rate)
        clip = 1.0
        if step.grad_clip_norm > 0 and norm > step.grad_clip_norm:
            clip = step.grad_clip_norm / (norm + 1e-6)
        t = adapter.step + 1
        new: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        with np.errstate(over="ignore", invalid="ignore"):
            for param, grad, m, v in zip(
                adapter.params(), grads, adapter.m, adapter.v, strict=True
            ):
                g = grad * clip
                p = param * (1.0 - step.learning_rate * step.weight_decay)  # decoupled, as AdamW
                m_new = step.beta1 * m + (1 - step.beta1) * g
                v_new = step.beta2 * v + (1 - step.beta2) * g * g
                m_hat = m_new / (1 - step.beta1**t)
                v_hat = v_new / (1 - step.beta2**t)
                p = p - step.learning_rate * m_hat / (np.sqrt(v_hat) + step.eps)
                new.append((p, m_new, v_new))
        self._clear_grads(adapter)
        if not all_finite(*(x for triple in new for x in triple)):
            return skipped_step_metrics("weights", step.learning_rate)
        for param, m, v, (p, m_new, v_new) in zip(
            adapter.params(), adapter.m, adapter.v, new, strict=True
        ):
            param[:], m[:], v[:] = p, m_new, v_new
        adapter.step = t
        return {"grad_norm": norm, "learning_rate": step.learning_rate}

    @staticmethod
    def _clear_grads(adapter: _Adapter) -> None:
        adapter.grad_a[:] = 0.0
        adapter.grad_b[:] = 0.0

    # ---- state ------------------------------------------------------------------------------

    def save_state(self, adapter_id: str, directory: Path, *, optimizer: bool) -> int:
        adapter = self._adapter(adapter_id)
        arrays = {"a": adapter.a, "b": adapter.b}
        if optimizer:
            arrays |= {
                "m_a": adapter.m[0],
                "m_b": adapter.m[1],
                "v_a": adapter.v[0],
                "v_b": adapter.v[1],
                "step": np.array(adapter.step),
            }
        return _write_atomically(directory, arrays, adapter.spec)

    def save_sampler_weights(self, adapter_id: str, directory: Path) -> int:
        adapter = self._adapter(adapter_id)
        return _write_atomically(directory, {"a": adapter.a, "b": adapter.b}, adapter.spec)

    def load_state(self, adapter_id: str, directory: Path, *, optimizer: bool) -> None:
        adapter = self._adapter(adapter_id)
        arrays = _read(directory)
        _check_finite(arrays, directory)
        if arrays["a"].shape != adapter.a.shape:
            raise EngineError("checkpoint rank does not match the adapter's rank", "user")
        adapter.a[:], adapter.b[:] = arrays["a"], arrays["b"]
        adapter.grad_a[:], adapter.grad_b[:] = 0.0, 0.0
        if optimizer:
            if "m_a" not in arrays:
                raise EngineError("checkpoint holds no optimizer state", "user")
            adapter.m = [arrays["m_a"].copy(), arrays["m_b"].copy()]
            adapter.v = [arrays["v_a"].copy(), arrays["v_b"].copy()]
            adapter.step = int(arrays["step"])
        else:
            adapter.m = [np.zeros_like(adapter.a), np.zeros_like(adapter.b)]
            adapter.v = [np.zeros_like(adapter.a), np.zeros_like(adapter.b)]
            adapter.step = 0

    # ---- sampling ---------------------------------------------------------------------------

    def create_sampler(
        self,
        sampler_id: str,
        base_model: str,
        *,
        adapter_id: str | None = None,
        weights_dir: Path | None = None,
    ) -> None:
        self._check_model(base_model)
        if adapter_id is not None:
            adapter = self._adapter(adapter_id)
            self._samplers[sampler_id] = (adapter.a.copy(), adapter.b.copy(), adapter.scale)
        elif weights_dir is not None:
            arrays = _read(weights_dir)
            _check_finite(arrays, weights_dir)
            meta = json.loads((weights_dir / "adapter_config.json").read_text())
            scale = float(meta["lora_alpha"]) / int(meta["r"])
            self._samplers[sampler_id] = (arrays["a"], arrays["b"], scale)
        else:
            self._samplers[sampler_id] = None

    def delete_sampler(self, sampler_id: str) -> None:
        self._samplers.pop(sampler_id, None)

    def sample(self, batch: Sequence[SampleWork]) -> list[SampleResult | EngineError]:
        results: list[SampleResult | EngineError] = []
        for work in batch:
            if work.sampler_id not in self._samplers:
                results.append(EngineError(f"no sampler {work.sampler_id!r}", "user"))
                continue
            # Each request on its own: whatever one raises fails it alone.
            try:
                results.append(self._sample_one(work, self._samplers[work.sampler_id]))
            except Exception as exc:
                results.append(alone_error(exc, "sample"))
        return results

    def _decode(self, tokens: list[int]) -> str:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(_TOKENIZER_DIR / "tokenizer.json"))
        return str(self._tokenizer.decode(tokens, skip_special_tokens=False))

    def _sample_one(self, work: SampleWork, lora: _Lora | None) -> SampleResult:
        prompt_lp: list[float | None] | None = None
        prompt_topk: list[TopkRow] | None = None
        if work.prompt_logprobs or work.topk_prompt_logprobs:
            logits_all = self._logits(work.prompt[:-1], lora)  # predicts 1..P-1
            if not all_finite(logits_all):
                raise EngineError(NON_FINITE_LOGITS, "user")
            logprobs_all = _log_softmax(logits_all)
            if work.prompt_logprobs:
                picked = np.take_along_axis(logprobs_all, work.prompt[1:, None], axis=1)[:, 0]
                prompt_lp = [None, *(float(x) for x in picked)]
            if work.topk_prompt_logprobs:
                prompt_topk = [
                    None,
                    *(_topk(row, work.topk_prompt_logprobs) for row in logprobs_all),
                ]
        seed = work.seed if work.seed is not None else int.from_bytes(os.urandom(8), "little")
        rng = np.random.default_rng(seed % (2**63))
        sequences = [self._generate(work, lora, rng) for _ in range(work.num_samples)]
        return SampleResult(sequences, prompt_lp, prompt_topk)

    def _generate(
        self, work: SampleWork, lora: _Lora | None, rng: np.random.Generator
    ) -> SampledTokens:
        tokens: list[int] = []
        logprobs: list[float] = []
        topk: list[TopkRow] = []
        last = int(work.prompt[-1])
        for _ in range(work.max_tokens):
            logits = self._logits(np.array([last]), lora)[0]
            if not all_finite(logits):
                raise EngineError(NON_FINITE_LOGITS, "user")
            # Reported logprobs are the model's at temperature 1 (what training computes);
            # temperature, top-k and top-p only shape which token is drawn.
            model_logprobs = _log_softmax(logits)
            if work.temperature == 0:
                token = int(np.argmax(logits))
            else:
                scaled = _log_softmax(logits / work.temperature)
                token = int(rng.choice(len(logits), p=_truncated_probs(scaled, work)))
            tokens.append(token)
            logprobs.append(float(model_logprobs[token]))
            if work.topk_sample_logprobs:
                topk.append(_topk(model_logprobs, work.topk_sample_logprobs))
            if token in work.stop_token_ids or (
                work.stop_strings and any(s in self._decode(tokens) for s in work.stop_strings)
            ):
                return SampledTokens(tokens, logprobs, "stop", topk or None)
            last = token
        return SampledTokens(tokens, logprobs, "length", topk or None)

    def kv_cache_use(self) -> KVCacheUse:
        # No KV cache: each sample is generated token by token from the bigram table.
        return KVCacheUse(tokens=0, token_budget=0, bytes=0)

    def close(self) -> None:
        self._adapters.clear()
        self._samplers.clear()


def _check_finite(arrays: dict[str, np.ndarray], directory: Path) -> None:
    """Weights with a NaN or an infinity are refused where they would enter the engine."""
    for name, array in arrays.items():
        if np.issubdtype(array.dtype, np.floating) and not all_finite(array):
            raise EngineError(
                f"checkpoint {directory.name!r} holds non-finite weights ({name})", "user"
            )


def _truncated_probs(logprobs: np.ndarray, work: SampleWork) -> np.ndarray:
    probs = np.exp(logprobs)
    if work.top_k > 0:
        cutoff = np.sort(probs)[-work.top_k]
        probs = np.where(probs >= cutoff, probs, 0.0)
    if work.top_p < 1.0:
        order = np.argsort(-probs)
        cumulative = np.cumsum(probs[order]) / probs.sum()
        keep = order[: int(np.searchsorted(cumulative, work.top_p) + 1)]
        mask = np.zeros_like(probs)
        mask[keep] = 1.0
        probs = probs * mask
    return probs / probs.sum()


def _topk(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    order = np.argsort(-logprobs, kind="stable")[:k]
    return [(int(i), float(logprobs[i])) for i in order]


def _write_atomically(directory: Path, arrays: dict[str, np.ndarray], spec: AdapterSpec) -> int:
    with atomic_directory(directory) as tmp:
        with (tmp / "weights.npz").open("wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
        config = {
            "r": spec.rank,
            "lora_alpha": spec.alpha,
            "base_model_name_or_path": spec.base_model,
        }
        (tmp / "adapter_config.json").write_text(json.dumps(config))
    return directory_size(directory)


def _read(directory: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(directory / "weights.npz") as data:
            return {k: data[k] for k in data.files}
    except FileNotFoundError:
        raise EngineError(f"no weights under {directory.name!r}", "user") from None
