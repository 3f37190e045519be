"""One request's failure is its own on the fake backend too (it stands in for the engine in the
tests of the layers above), and its optim_step never makes an adapter non-finite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tuneloop.server.engine.fake import FAKE_MODEL_NAME, FakeBackend
from tuneloop.server.engine.isolation import NON_FINITE_LOGITS, SKIPPED, bisect_failures
from tuneloop.server.engine.types import (
    AdamStep,
    AdapterSpec,
    EngineError,
    Example,
    ForwardBackwardWork,
    SampleResult,
    SampleWork,
)

ADAM = AdamStep(0.05, 0.9, 0.95, 1e-8, 0.0, 0.0)


def datum(seed: int, n: int = 8, weight: float = 1.0) -> Example:
    tokens = np.random.default_rng(seed).integers(0, 256, size=n + 1).astype(np.int64)
    inputs = {"target_tokens": tokens[1:], "weights": np.full(n, weight, np.float32)}
    return Example(tokens[:-1], inputs)


def fb(adapter_id: str, *examples: Example, loss_fn: str = "cross_entropy") -> ForwardBackwardWork:
    return ForwardBackwardWork(adapter_id, examples, loss_fn, {}, False)


def sw(sampler_id: str, seed: int, **kw: Any) -> SampleWork:
    args: dict[str, Any] = {
        "num_samples": 2,
        "max_tokens": 6,
        "temperature": 1.0,
        "top_k": -1,
        "top_p": 1.0,
        "seed": seed,
        "stop_token_ids": (),
        "stop_strings": (),
    }
    args.update(kw)
    prompt = np.random.default_rng(seed).integers(0, 256, size=4).astype(np.int64)
    return SampleWork(sampler_id, prompt, **args)


@pytest.fixture
def be(tmp_path: Path) -> FakeBackend:
    """Adapter "A" trained a step, samplers "good" (its snapshot), "base", and "huge": A's
    weights saved and scaled on disk so that its logits overflow (finite, but 1e200)."""
    backend = FakeBackend()
    backend.create_adapter(AdapterSpec("A", FAKE_MODEL_NAME, 4, 1))
    assert not isinstance(backend.forward_backward([fb("A", datum(1))])[0], EngineError)
    backend.optim_step("A", ADAM)
    backend.create_sampler("good", FAKE_MODEL_NAME, adapter_id="A")
    backend.create_sampler("base", FAKE_MODEL_NAME)
    backend.save_sampler_weights("A", tmp_path / "w")
    with np.load(tmp_path / "w" / "weights.npz") as data:
        arrays = {k: data[k] for k in data.files}
    np.savez(tmp_path / "w" / "weights.npz", a=arrays["a"] * 1e200, b=arrays["b"] * 1e200)
    backend.create_sampler("huge", FAKE_MODEL_NAME, weights_dir=tmp_path / "w")
    return backend


def _tokens(result: Any) -> list[list[int]]:
    assert isinstance(result, SampleResult), result
    return [s.tokens for s in result.sequences]


def test_a_poisoned_sampler_fails_alone_and_the_others_get_what_they_get_alone(
    be: FakeBackend,
) -> None:
    victims = [sw("good", 1, prompt_logprobs=True), sw("base", 2), sw("good", 3, temperature=0)]
    alone = [be.sample([w])[0] for w in victims]
    results = be.sample([victims[0], sw("huge", 4), victims[1], sw("huge", 5), victims[2]])
    for bad in (results[1], results[3]):
        assert isinstance(bad, EngineError)
        assert bad.category == "user"
        assert str(bad) == NON_FINITE_LOGITS
    for mine, ref in zip([results[0], results[2], results[4]], alone, strict=True):
        assert mine == ref  # exactly: the fake is deterministic per request


def test_non_finite_checkpoints_are_refused_where_they_would_enter(
    be: FakeBackend, tmp_path: Path
) -> None:
    be.save_sampler_weights("A", tmp_path / "n")
    with np.load(tmp_path / "n" / "weights.npz") as data:
        arrays = {k: data[k] for k in data.files}
    arrays["b"][0, 0] = np.nan
    np.savez(tmp_path / "n" / "weights.npz", **arrays)
    with pytest.raises(EngineError, match="non-finite weights") as info:
        be.create_sampler("nan", FAKE_MODEL_NAME, weights_dir=tmp_path / "n")
    assert info.value.category == "user"
    with pytest.raises(EngineError, match="non-finite weights"):
        be.load_state("A", tmp_path / "n", optimizer=False)


def test_one_failing_forward_backward_request_leaves_the_others_and_its_adapter(
    be: FakeBackend,
) -> None:
    be.create_adapter(AdapterSpec("B", FAKE_MODEL_NAME, 4, 2))
    good = fb("A", datum(2), datum(3))
    [alone] = be.forward_backward([good])
    alone_grads = [g.copy() for g in (be._adapters["A"].grad_a, be._adapters["A"].grad_b)]
    be._adapters["A"].grad_a[:] = 0.0
    be._adapters["A"].grad_b[:] = 0.0
    results = be.forward_backward(
        [
            fb("B", datum(4), loss_fn="no-such-loss"),  # raises in its own pre-processing
            good,
            fb("B", datum(5), datum(6, weight=np.inf)),  # loss and gradients not finite
        ]
    )
    assert isinstance(results[0], EngineError)
    assert "KeyError" in str(results[0])
    assert isinstance(results[2], EngineError)
    assert results[2].category == "user"
    assert "not finite" in str(results[2])
    mine = results[1]
    assert not isinstance(mine, EngineError)
    assert not isinstance(alone, EngineError)
    assert mine.metrics == alone.metrics
    for x, y in zip(mine.logprobs, alone.logprobs, strict=True):
        np.testing.assert_array_equal(x, y)
    for mine, ref in zip(
        (be._adapters["A"].grad_a, be._adapters["A"].grad_b), alone_grads, strict=True
    ):
        np.testing.assert_array_equal(mine, ref)
    adapter_b = be._adapters["B"]
    assert not adapter_b.grad_a.any()
    assert not adapter_b.grad_b.any()


def test_optim_step_skips_what_would_be_non_finite(be: FakeBackend) -> None:
    adapter = be._adapters["A"]
    before = [p.copy() for p in adapter.params()]
    moments = [m.copy() for m in adapter.m + adapter.v]
    step_count = adapter.step

    adapter.grad_a[0, 0] = np.inf
    metrics = be.optim_step("A", ADAM)
    assert metrics == {SKIPPED: 1.0, SKIPPED + "_nonfinite_gradients": 1.0, "learning_rate": 0.05}

    # Finite gradients whose step overflows: a huge first moment that beta2 = 0 lets the second
    # moment forget, divided by eps.
    adapter.m[1][0, 0] = 1e300
    moments[1][0, 0] = 1e300
    metrics = be.optim_step("A", AdamStep(1.0, 0.9, 0.0, 1e-8, 0.0, 0.0))
    assert metrics[SKIPPED] == 1.0
    assert metrics[SKIPPED + "_nonfinite_weights"] == 1.0
    for p, b in zip(adapter.params(), before, strict=True):
        np.testing.assert_array_equal(p, b)
    for m, b in zip(adapter.m + adapter.v, moments, strict=True):
        np.testing.assert_array_equal(m, b)
    assert adapter.step == step_count
    assert not adapter.grad_a.any()
    assert not adapter.grad_b.any()


def test_bisect_failures_narrows_a_raising_batch_to_its_culprits() -> None:
    calls: list[list[str]] = []

    def call(items: Any) -> list[Any]:
        calls.append(list(items))
        if "bad" in items:
            raise ValueError("bad in batch")
        if "user" in items:
            raise EngineError("your fault", "user")
        return [f"ok {i}" for i in items]

    items = ["a", "bad", "b", "c", "user", "d"]
    results = bisect_failures(call, items, "sample")
    assert results[0] == "ok a"
    assert results[2:4] == ["ok b", "ok c"]
    assert results[5] == "ok d"
    assert isinstance(results[1], EngineError)
    assert results[1].category == "server"
    assert "ValueError: bad in batch" in str(results[1])
    assert isinstance(results[4], EngineError)
    assert results[4].category == "user"
    assert str(results[4]) == "your fault"
    assert calls[0] == items

    def broken(items: Any) -> list[Any]:
        raise RuntimeError("device on fire")

    everyone = bisect_failures(broken, ["x", "y", "z"], "forward_backward")
    assert len(everyone) == 3  # a failure of the shared pass: one answer each
    assert all(isinstance(e, EngineError) and "device on fire" in str(e) for e in everyone)
    miscounted = bisect_failures(lambda items: [], ["p", "q"], "sample")
    assert [e.category for e in miscounted] == ["server", "server"]


def test_logprobs_beyond_float32_fail_the_request_not_the_result(be: FakeBackend) -> None:
    """Float64 logprobs of -1e40 are finite, but the float32 a result carries would be -inf."""
    be.create_adapter(AdapterSpec("B", FAKE_MODEL_NAME, 4, 2))
    b = be._adapters["B"].b
    b[:] = np.random.default_rng(3).normal(0.0, 1e40, size=b.shape)
    [result] = be.forward_backward(
        [ForwardBackwardWork("B", (datum(7),), "cross_entropy", {}, True)]
    )
    assert isinstance(result, EngineError)
    assert result.category == "user"
    assert "not finite" in str(result)
