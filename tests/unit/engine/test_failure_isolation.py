"""One request's failure is its own (TorchBackend): a poisoned sampler, an exception in one
request's own work, or one request's overflowing gradients fail that request alone, and every
other request of the batch gets exactly what it gets alone."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import (  # noqa: E402
    TINY,
    adam,
    adapter_spec,
    assert_near,
    bank,
    example,
    grads,
    ok,
    params,
    seq,
    train,
    work,
)
from tests.unit.engine.test_sampler import prompt, sw  # noqa: E402
from tuneloop.server.engine import decoder as decoder_module  # noqa: E402
from tuneloop.server.engine import training as training_module  # noqa: E402
from tuneloop.server.engine.isolation import NON_FINITE_LOGITS, SKIPPED  # noqa: E402
from tuneloop.server.engine.model_runner import ModelRunner  # noqa: E402
from tuneloop.server.engine.types import EngineError, SampleResult, SampleWork  # noqa: E402

TRAIN_DATA = [example(seq(12, 31)), example(seq(9, 32))]


@pytest.fixture
def poisoned(backend: Any) -> Any:
    """Sampler "good" (a trained adapter's snapshot), "base", and two poisoned samplers over
    the same adapter's factors: "nan" (a NaN in every factor) and "huge" (finite factors so
    large that the logits overflow)."""
    backend.create_adapter(adapter_spec("A", rank=4, seed=1))
    train(backend, "A", TRAIN_DATA, 2, lr=2e-2)
    backend.create_sampler("good", TINY, adapter_id="A")
    backend.create_sampler("base", TINY)
    spec = adapter_spec("A", rank=4, seed=1)
    factors = params(backend, "A")
    backend.add_frozen_sampler("nan", spec, {k: v * float("nan") for k, v in factors.items()})
    backend.add_frozen_sampler("huge", spec, {k: v * 1e30 for k, v in factors.items()})
    return backend


def _victims() -> list[SampleWork]:
    return [
        sw("good", prompt(5, 1), num_samples=2, seed=7, prompt_logprobs=True),
        sw("base", prompt(9, 2), temperature=0.7, top_k=20, seed=8, topk_sample_logprobs=3),
        sw("good", prompt(3, 3), temperature=0.0, max_tokens=5),
    ]


def _same(mine: SampleResult, alone: SampleResult) -> None:
    assert [s.tokens for s in mine.sequences] == [s.tokens for s in alone.sequences]
    assert_near(
        [s.logprobs for s in mine.sequences], [s.logprobs for s in alone.sequences], 1e-5, "lp"
    )
    if alone.prompt_logprobs is not None:
        assert mine.prompt_logprobs is not None
        assert_near(mine.prompt_logprobs[1:], alone.prompt_logprobs[1:], 1e-5, "prompt lp")


@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_a_poisoned_sampler_fails_alone_in_a_shared_decode_batch(
    poisoned: Any, poison: str
) -> None:
    victims = _victims()
    alone = [ok(poisoned.sample([w])[0]) for w in victims]
    bad = [
        sw(poison, prompt(4, 4), num_samples=2, seed=1),
        sw(poison, prompt(6, 5), prompt_logprobs=True, seed=2),
    ]
    results = poisoned.sample([victims[0], bad[0], victims[1], bad[1], victims[2]])
    for result in (results[1], results[3]):
        assert isinstance(result, EngineError)
        assert result.category == "user"
        assert str(result) == NON_FINITE_LOGITS
    for mine, ref in zip([results[0], results[2], results[4]], alone, strict=True):
        _same(ok(mine), ref)


@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_a_step_whose_every_row_is_poisoned_answers_each_request(
    poisoned: Any, poison: str
) -> None:
    """No row left to draw from: every request still gets its own user error."""
    bad = [sw(poison, prompt(4, 15), num_samples=2, seed=1), sw(poison, prompt(6, 16), seed=2)]
    for result in poisoned.sample(bad):
        assert isinstance(result, EngineError)
        assert (str(result), result.category) == (NON_FINITE_LOGITS, "user")


def test_a_poisoned_request_joining_a_running_batch_fails_alone(poisoned: Any) -> None:
    """Continuous batching: the poisoned request joins mid-decode; the running and the other
    joining requests finish with what they get alone, each answered exactly once."""
    victims = _victims()
    long = sw("good", prompt(5, 9), max_tokens=24, seed=3)
    alone = {id(w): ok(poisoned.sample([w])[0]) for w in (long, *victims)}
    bad = sw("nan", prompt(5, 10), seed=4)
    steps = 0
    got: dict[int, Any] = {}

    def admit() -> list[SampleWork]:
        nonlocal steps
        steps += 1
        return [victims[0], bad, *victims[1:]] if steps == 2 else []

    def deliver(w: SampleWork, result: Any) -> None:
        assert id(w) not in got
        got[id(w)] = result

    poisoned.sample_continuous([long], admit, deliver)
    assert len(got) == 5
    [runtime] = poisoned._runtimes.values()
    usage = runtime.decoder.usage()  # the failed request's blocks went back too
    assert (usage.blocks_used, usage.blocks_reserved) == (0, 0)
    assert isinstance(got[id(bad)], EngineError)
    assert got[id(bad)].category == "user"
    for w in (long, *victims):
        _same(ok(got[id(w)]), alone[id(w)])


def test_an_exception_in_one_requests_stop_check_fails_it_alone(
    poisoned: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Post-processing: decoding for a stop string raises for one request only."""
    victims = _victims()
    alone = [ok(poisoned.sample([w])[0]) for w in victims]
    [runtime] = poisoned._runtimes.values()
    decode = runtime.decode

    def fragile(tokens: list[int]) -> str:
        if len(tokens) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        return decode(tokens)

    monkeypatch.setattr(runtime.decoder, "decode", fragile)  # made by the runs above
    culprit = sw("good", prompt(4, 11), seed=5, stop_strings=("never",))
    results = poisoned.sample([victims[0], culprit, *victims[1:]])
    assert isinstance(results[1], EngineError)
    assert "UnicodeDecodeError" in str(results[1])
    assert "alone" in str(results[1])
    for mine, ref in zip([results[0], *results[2:]], alone, strict=True):
        _same(ok(mine), ref)


def test_a_prefill_that_raises_is_run_again_request_by_request(
    poisoned: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pre-processing: scoring the prompts raises whenever one request is among them; only
    that request fails, holding no KV block."""
    victims = _victims()
    alone = [ok(poisoned.sample([w])[0]) for w in victims]
    culprit = sw("good", prompt(7, 12), seed=6, prompt_logprobs=True)
    score = decoder_module.score_prompts

    def fragile(model: Any, bank: Any, works: Any, *rest: Any) -> Any:
        if any(w is culprit for w in works):
            raise RuntimeError("scoring exploded")
        return score(model, bank, works, *rest)

    monkeypatch.setattr(decoder_module, "score_prompts", fragile)
    results = poisoned.sample([victims[0], culprit, *victims[1:]])
    [runtime] = poisoned._runtimes.values()
    assert runtime.decoder.usage().blocks_reserved == 0
    assert isinstance(results[1], EngineError)
    assert "scoring exploded" in str(results[1])
    for mine, ref in zip([results[0], *results[2:]], alone, strict=True):
        _same(ok(mine), ref)


def test_a_chunked_prefill_that_raises_fails_only_its_request(
    poisoned: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A joining prefill (chunked, while rows decode) that raises whenever one request's prompt
    is in the step's forward pass: the step runs again in halves, and only that request fails."""
    poisoned.prefill_chunk = 2
    victims = _victims()
    long = sw("good", prompt(5, 13), max_tokens=16, seed=3)
    alone = {id(w): ok(poisoned.sample([w])[0]) for w in (long, *victims)}
    culprit = sw("base", prompt(8, 14), seed=9)
    culprit_prompt = culprit.prompt.tolist()
    run = ModelRunner.run

    def fragile(self: Any, work: Any) -> Any:
        if any(item.seq.tokens == culprit_prompt for item in work):
            raise RuntimeError("prefill exploded")
        return run(self, work)

    monkeypatch.setattr(ModelRunner, "run", fragile)
    steps = 0
    got: dict[int, Any] = {}

    def admit() -> list[SampleWork]:
        nonlocal steps
        steps += 1
        return [victims[0], culprit, *victims[1:]] if steps == 2 else []

    poisoned.sample_continuous([long], admit, lambda w, r: got.setdefault(id(w), r))
    assert "prefill exploded" in str(got[id(culprit)])
    [runtime] = poisoned._runtimes.values()
    usage = runtime.decoder.usage()
    assert (usage.blocks_used, usage.blocks_reserved) == (0, 0)
    for w in (long, *victims):
        _same(ok(got[id(w)]), alone[id(w)])


# ---- training ---------------------------------------------------------------------------------


def _two_adapters(backend: Any) -> None:
    backend.create_adapter(adapter_spec("A", rank=4, seed=1))
    backend.create_adapter(adapter_spec("B", rank=4, seed=2))


def _huge(sequence: np.ndarray) -> Any:
    """A datum whose finite float32 weights keep its loss finite but make its gradients
    overflow."""
    return example(sequence, weights=np.full(len(sequence) - 1, 1e36, np.float32))


@pytest.mark.parametrize("packed", [True, False])
def test_one_requests_overflowing_gradients_fail_it_alone(backend: Any, packed: bool) -> None:
    """B's request overflows; A's request of the same batch (packed end to end with it, or
    padded) gets its loss, logprobs and gradients as alone, and B's adapter is unchanged."""
    [runtime] = backend._runtimes.values()
    runtime.packed = packed and runtime.packed
    _two_adapters(backend)
    good = work("A", TRAIN_DATA)
    [alone] = backend.forward_backward([good])
    alone_grads = grads(backend, "A")
    _two_adapters_again(backend)  # fresh adapters, the same weights
    results = backend.forward_backward([good, work("B", [_huge(seq(10, 33))])])
    assert_not_finite_alone(results, alone, grads(backend, "A"), alone_grads)
    assert all(not g.any() for g in grads(backend, "B"))  # nothing accumulated for B
    assert SKIPPED not in backend.optim_step("B", adam())


def assert_not_finite_alone(
    results: list[Any], alone: Any, got_grads: list[Any], alone_grads: list[Any]
) -> None:
    """results[1] failed with a user error for a loss or gradient that is not finite, and
    results[0] got the loss, logprobs and gradients (`got_grads`) it gets alone."""
    assert isinstance(results[1], EngineError)
    assert results[1].category == "user"
    assert "not finite" in str(results[1])
    mine = ok(results[0])
    assert mine.metrics["loss:sum"] == pytest.approx(ok(alone).metrics["loss:sum"], rel=1e-5)
    assert_near(mine.logprobs, ok(alone).logprobs, 1e-5, "logprobs")
    assert_near(got_grads, alone_grads, 1e-5, "grads", relative=True)


def _two_adapters_again(backend: Any) -> None:
    for adapter_id in ("A", "B"):
        backend.delete_adapter(adapter_id)
    _two_adapters(backend)


def test_an_exception_in_one_requests_loss_fails_it_alone(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _two_adapters(backend)
    good = work("A", TRAIN_DATA)
    [alone] = backend.forward_backward([good])
    alone_grads = grads(backend, "A")
    _two_adapters_again(backend)
    compute = training_module.batch_losses

    def fragile(work: Any, lps: Any, inputs: Any, device: Any = None) -> Any:
        if "poison" in work.loss_config:
            raise ZeroDivisionError("loss exploded")
        return compute(dataclasses.replace(work, loss_config={}), lps, inputs, device)

    monkeypatch.setattr(training_module, "batch_losses", fragile)
    bad = work("B", [example(seq(8, 34))], config={"poison": 1.0})
    results = backend.forward_backward([bad, good])
    assert isinstance(results[0], EngineError)
    assert "loss exploded" in str(results[0])
    assert_near(ok(results[1]).logprobs, ok(alone).logprobs, 1e-5, "logprobs")
    assert_near(grads(backend, "A"), alone_grads, 1e-5, "grads", relative=True)
    assert all(not g.any() for g in grads(backend, "B"))


def test_optim_step_skips_non_finite_gradients_and_keeps_the_adapter(backend: Any) -> None:
    _two_adapters(backend)
    ok(backend.forward_backward([work("A", TRAIN_DATA)])[0])
    before = params(backend, "A")
    for p in bank(backend).parameters("A"):
        assert p.grad is not None
        p.grad[0] = float("inf")
        break
    metrics = backend.optim_step("A", adam())
    assert metrics[SKIPPED] == 1.0
    assert metrics[SKIPPED + "_nonfinite_gradients"] == 1.0
    assert_near(params(backend, "A"), before, 0.0, "unchanged")
    assert all(not g.any() for g in grads(backend, "A"))  # discarded: it trains again
    ok(backend.forward_backward([work("A", TRAIN_DATA)])[0])
    assert SKIPPED not in backend.optim_step("A", adam())
