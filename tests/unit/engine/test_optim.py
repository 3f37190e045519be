"""AdapterOptimizer against a plain torch AdamW + clip_grad_norm_ run on identical gradients."""

from __future__ import annotations

import copy
import io
import math
from typing import Any

import pytest
import torch

from tuneloop.server.engine.isolation import SKIPPED
from tuneloop.server.engine.optim import AdapterOptimizer
from tuneloop.server.engine.types import AdamStep

STEPS = [
    AdamStep(1e-2, 0.9, 0.95, 1e-12, 0.0, 0.0),
    AdamStep(5e-3, 0.9, 0.999, 1e-8, 0.1, 0.5),
    AdamStep(2e-2, 0.8, 0.95, 1e-6, 0.0, 100.0),
    AdamStep(1e-3, 0.95, 0.99, 1e-8, 0.01, 0.05),
    AdamStep(0.0, 0.9, 0.95, 1e-12, 0.5, 0.0),
    AdamStep(3e-3, 0.5, 0.9, 1e-8, 0.2, 1.0),
]


def make_model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def make_grads(step_index: int, model: torch.nn.Module) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step_index)
    return [torch.randn(p.shape, generator=generator) * 2.0 for p in model.parameters()]


def set_grads(model: torch.nn.Module, grads: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()


def reference_run(steps: list[AdamStep]) -> tuple[list[list[torch.Tensor]], list[float]]:
    """Parameters after every step, and the pre-clip norms, from plain torch."""
    model = make_model()
    adamw = torch.optim.AdamW(model.parameters())
    snapshots, norms = [], []
    for index, step in enumerate(steps):
        set_grads(model, make_grads(index, model))
        if step.grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), step.grad_clip_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        norms.append(float(norm))
        for group in adamw.param_groups:
            group.update(
                lr=step.learning_rate,
                betas=(step.beta1, step.beta2),
                eps=step.eps,
                weight_decay=step.weight_decay,
            )
        adamw.step()
        adamw.zero_grad()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots, norms


def run_steps(
    model: torch.nn.Module, optimizer: AdapterOptimizer, steps: list[AdamStep], first: int = 0
) -> tuple[list[list[torch.Tensor]], list[dict[str, float]]]:
    snapshots, metrics = [], []
    for index, step in enumerate(steps, start=first):
        set_grads(model, make_grads(index, model))
        metrics.append(optimizer.step(step))
        assert all(p.grad is None or not p.grad.any() for p in model.parameters())
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots, metrics


def assert_same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for params_a, params_b in zip(a, b, strict=True):
        for x, y in zip(params_a, params_b, strict=True):
            assert torch.equal(x, y)


def test_matches_reference_adamw_with_and_without_clipping() -> None:
    expected, norms = reference_run(STEPS)
    model = make_model()
    optimizer = AdapterOptimizer(list(model.parameters()))
    snapshots, metrics = run_steps(model, optimizer, STEPS)
    assert_same(snapshots, expected)
    assert optimizer.steps == len(STEPS)
    for step, got, norm in zip(STEPS, metrics, norms, strict=True):
        assert got == {
            "grad_norm": pytest.approx(norm, rel=1e-6),
            "learning_rate": step.learning_rate,
        }


def test_grad_norm_is_before_clipping() -> None:
    model = make_model()
    grads = make_grads(0, model)
    expected = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    optimizer = AdapterOptimizer(list(model.parameters()))
    set_grads(model, grads)
    metrics = optimizer.step(AdamStep(1e-3, 0.9, 0.95, 1e-8, 0.0, grad_clip_norm=0.01))
    assert expected > 1.0
    assert metrics["grad_norm"] == pytest.approx(expected, rel=1e-6)


def test_state_dict_round_trip_continues_exactly() -> None:
    expected, _ = reference_run(STEPS)
    model = make_model()
    optimizer = AdapterOptimizer(list(model.parameters()))
    run_steps(model, optimizer, STEPS[:2])
    # Through bytes, as a checkpoint would go; the live optimizer must not share tensors.
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    resumed_model = copy.deepcopy(model)
    resumed = AdapterOptimizer(list(resumed_model.parameters()))
    resumed.load_state_dict(state)
    assert resumed.steps == 2
    resumed_snapshots, _ = run_steps(resumed_model, resumed, STEPS[2:5], first=2)
    uninterrupted, _ = run_steps(model, optimizer, STEPS[2:5], first=2)
    assert_same(resumed_snapshots, uninterrupted)
    assert_same(resumed_snapshots, expected[2:5])
    assert resumed.steps == optimizer.steps == 5


def test_missing_grad_counts_as_zero() -> None:
    """A parameter no forward_backward reached still decays its moments and weights."""
    model = make_model()
    reference = copy.deepcopy(model)
    optimizer = AdapterOptimizer(list(model.parameters()))
    adamw = torch.optim.AdamW(reference.parameters())
    for index, step in enumerate(STEPS[:3]):
        grads = make_grads(index, model)
        if index == 1:
            grads[1] = torch.zeros_like(grads[1])
            set_grads(model, grads)
            model.bias.grad = None
        else:
            set_grads(model, grads)
        set_grads(reference, grads)
        if step.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), step.grad_clip_norm)
        for group in adamw.param_groups:
            group.update(
                lr=step.learning_rate,
                betas=(step.beta1, step.beta2),
                eps=step.eps,
                weight_decay=step.weight_decay,
            )
        adamw.step()
        optimizer.step(step)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach())


def test_step_without_any_grad_is_well_defined() -> None:
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = AdapterOptimizer(list(model.parameters()))
    metrics = optimizer.step(AdamStep(1e-2, 0.9, 0.95, 1e-12, 0.0, 1.0))
    assert metrics["grad_norm"] == 0.0
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)  # zero gradient, no decay: nothing moves
    assert optimizer.steps == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_skips_the_step_and_leaves_everything_usable(bad: float) -> None:
    expected, _ = reference_run(STEPS[:3])
    model = make_model()
    optimizer = AdapterOptimizer(list(model.parameters()))
    run_steps(model, optimizer, STEPS[:1])
    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = copy.deepcopy(optimizer.state_dict())

    grads = make_grads(99, model)
    grads[0][1, 2] = bad
    set_grads(model, grads)
    metrics = optimizer.step(STEPS[1])
    assert metrics == {
        SKIPPED: 1.0,
        SKIPPED + "_nonfinite_gradients": 1.0,
        "learning_rate": STEPS[1].learning_rate,
    }
    assert all(math.isfinite(v) for v in metrics.values())  # JSON-safe
    for p, b in zip(model.parameters(), params_before, strict=True):
        assert torch.equal(p.detach(), b)
        assert p.grad is None or not p.grad.any()
    assert optimizer.steps == 1
    state_after = optimizer.state_dict()
    for key, values in state_before["state"].items():
        for name, value in values.items():
            assert torch.equal(state_after["state"][key][name], value)

    # Usable afterwards: the next steps match an uninterrupted run.
    snapshots, _ = run_steps(model, optimizer, STEPS[1:3], first=1)
    assert_same(snapshots, expected[1:3])
    assert optimizer.steps == 3


def test_needs_parameters() -> None:
    with pytest.raises(ValueError, match="at least one parameter"):
        AdapterOptimizer([])


def test_a_step_whose_weights_would_overflow_is_skipped_and_taken_back() -> None:
    """Finite gradients and hyperparameters can still overflow AdamW: with beta2 = 0 the second
    moment forgets a huge gradient at once while the first remembers it, and a tiny eps then
    divides it by ~0. The step is undone (weights and moments as before) and reported."""
    model = make_model()
    optimizer = AdapterOptimizer(list(model.parameters()))
    huge = AdamStep(1e-2, 0.9, 0.0, 1e-30, 0.0, 0.0)
    set_grads(model, [torch.full_like(p, 1e18) for p in model.parameters()])
    first = optimizer.step(huge)
    assert SKIPPED not in first
    assert math.isfinite(first["grad_norm"])
    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = copy.deepcopy(optimizer.state_dict())

    set_grads(model, [torch.zeros_like(p) for p in model.parameters()])
    metrics = optimizer.step(huge)
    assert metrics[SKIPPED] == 1.0
    assert metrics[SKIPPED + "_nonfinite_weights"] == 1.0
    for p, b in zip(model.parameters(), params_before, strict=True):
        assert torch.equal(p.detach(), b)
        assert p.grad is None or not p.grad.any()
    assert optimizer.steps == 1
    state_after = optimizer.state_dict()
    for key, values in state_before["state"].items():
        for name, value in values.items():
            assert torch.equal(state_after["state"][key][name], value)
    # Still trainable with sane settings.
    set_grads(model, make_grads(0, model))
    assert SKIPPED not in optimizer.step(STEPS[0])
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_ordinary_steps_are_not_copied_and_a_risky_one_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy that takes a non-finite step back is made only for a step whose closed-form
    bounds could overflow: ordinary training pays nothing for it, and stays bit-exact."""
    copies: list[int] = []
    original = AdapterOptimizer._copy

    def counted(self: AdapterOptimizer) -> Any:
        copies.append(self.steps)
        return original(self)

    monkeypatch.setattr(AdapterOptimizer, "_copy", counted)
    expected, _ = reference_run(STEPS)
    model = make_model()
    optimizer = AdapterOptimizer(list(model.parameters()))
    snapshots, _ = run_steps(model, optimizer, STEPS)
    assert_same(snapshots, expected)
    assert copies == []
    risky = AdamStep(1.0, 0.9, 0.0, 1e-30, 0.0, 0.0)  # m / eps could reach 1e37
    set_grads(model, [g * 1e6 for g in make_grads(50, model)])
    assert SKIPPED not in optimizer.step(risky)  # finite, but only known so after the fact
    assert copies == [len(STEPS)]
