"""The reference losses: each returned gradient against a central finite difference (float64)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from tuneloop.server.engine import loss_math
from tuneloop.server.engine.loss_specs import LOSS_SPECS, UNSUPPORTED_LOSSES

RNG = np.random.default_rng(1234)
N = 12


def finite_difference(
    fn: loss_math.LossFn, lp: np.ndarray, inputs: Mapping[str, np.ndarray], config: Mapping
) -> np.ndarray:
    h = 1e-6
    grad = np.zeros_like(lp)
    for index in np.ndindex(lp.shape):
        up, down = lp.copy(), lp.copy()
        up[index] += h
        down[index] -= h
        grad[index] = (fn(up, inputs, config)[0] - fn(down, inputs, config)[0]) / (2 * h)
    return grad


def check_gradient(
    name: str, lp: np.ndarray, inputs: Mapping[str, np.ndarray], config: Mapping | None = None
) -> tuple[float, np.ndarray]:
    fn = loss_math.LOSS_FUNCTIONS[name]
    config = {**LOSS_SPECS[name].config_defaults, **(config or {})}
    loss, grad = fn(lp, inputs, config)
    assert isinstance(loss, float)
    assert grad.shape == lp.shape
    np.testing.assert_allclose(grad, finite_difference(fn, lp, inputs, config), atol=1e-6)
    return loss, grad


def rl_inputs(lp: np.ndarray, ratios: np.ndarray, advantages: np.ndarray) -> dict[str, np.ndarray]:
    """Sampler logprobs chosen so that exp(lp - q) equals `ratios` exactly."""
    return {"logprobs": lp - np.log(ratios), "advantages": advantages.astype(np.float64)}


def test_every_loss_has_a_spec_and_a_function() -> None:
    assert set(loss_math.LOSS_FUNCTIONS) == set(LOSS_SPECS)
    assert not set(UNSUPPORTED_LOSSES) & set(LOSS_SPECS)


def test_cross_entropy_1d_with_real_weights() -> None:
    lp = -RNG.uniform(0.1, 5, N)
    weights = RNG.normal(0, 1, N)  # negative weights are allowed
    loss, grad = check_gradient("cross_entropy", lp, {"weights": weights})
    assert np.isclose(loss, -(weights * lp).sum())
    np.testing.assert_array_equal(grad, -weights)
    loss, grad = check_gradient("cross_entropy", lp, {})
    assert np.isclose(loss, -lp.sum())


def test_cross_entropy_2d_topk_form() -> None:
    lp = -RNG.uniform(0.1, 5, (N, 4))
    weights = RNG.dirichlet(np.ones(4), N)
    loss, grad = check_gradient("cross_entropy", lp, {"weights": weights})
    assert np.isclose(loss, -(weights * lp).sum())
    assert grad.shape == (N, 4)


def test_importance_sampling() -> None:
    lp = -RNG.uniform(0.1, 3, N)
    inputs = rl_inputs(lp, RNG.uniform(0.5, 2, N), RNG.normal(0, 1, N))
    loss, grad = check_gradient("importance_sampling", lp, inputs)
    ratio = np.exp(lp - inputs["logprobs"])
    assert np.isclose(loss, -(ratio * inputs["advantages"]).sum())
    np.testing.assert_allclose(grad, -ratio * inputs["advantages"])


# Ratios and advantages covering every region of the clipped surrogate (bounds 0.8 / 1.2),
# away from the kinks: inside, above with A > 0 (clipped), above with A < 0 (not clipped),
# below with A < 0 (clipped), below with A > 0 (not clipped), and A = 0.
REGIONS = [
    (1.05, 0.7, True),
    (0.9, -1.3, True),
    (1.6, 0.8, False),
    (1.6, -0.8, True),
    (0.5, -1.1, False),
    (0.5, 1.1, True),
    (1.0, 0.0, True),
]


@pytest.mark.parametrize(("ratio", "advantage", "flows"), REGIONS)
def test_ppo_gradient_in_every_region(ratio: float, advantage: float, flows: bool) -> None:
    lp = -RNG.uniform(0.1, 3, 5)
    inputs = rl_inputs(lp, np.full(5, ratio), np.full(5, advantage))
    _loss, grad = check_gradient("ppo", lp, inputs)
    expected = -ratio * advantage if flows else 0.0
    np.testing.assert_allclose(grad, np.full(5, expected), atol=1e-12)


def test_ppo_mixed_tokens_and_per_token_thresholds() -> None:
    ratios = np.array([r for r, _, _ in REGIONS])
    advantages = np.array([a for _, a, _ in REGIONS])
    lp = -RNG.uniform(0.1, 3, len(REGIONS))
    check_gradient("ppo", lp, rl_inputs(lp, ratios, advantages))
    check_gradient("ppo", lp, rl_inputs(lp, ratios, advantages), {"clip_low_threshold": 0.3})
    per_token = {
        **rl_inputs(lp, ratios, advantages),
        "clip_low_threshold": np.full(len(REGIONS), 0.95),
        "clip_high_threshold": np.full(len(REGIONS), 1.01),
    }
    check_gradient("ppo", lp, per_token)


def test_ppo_defaults_clip_the_ratio_at_0_8_and_1_2() -> None:
    assert dict(LOSS_SPECS["ppo"].config_defaults) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
    }
    lp = np.array([-1.0, -1.0])
    config = LOSS_SPECS["ppo"].config_defaults
    high, _ = loss_math.ppo(lp, rl_inputs(lp, np.array([2.0, 3.0]), np.ones(2)), config)
    assert np.isclose(high, -2 * 1.2)
    low, _ = loss_math.ppo(lp, rl_inputs(lp, np.array([0.5, 0.1]), -np.ones(2)), config)
    assert np.isclose(low, 2 * 0.8)
    inside, _ = loss_math.ppo(lp, rl_inputs(lp, np.array([0.9, 1.1]), np.ones(2)), config)
    assert np.isclose(inside, -2.0)


def test_cispo_gradient_is_minus_clipped_ratio_times_advantage() -> None:
    lp = -RNG.uniform(0.1, 3, N)
    ratios = RNG.uniform(0.2, 6, N)
    inputs = rl_inputs(lp, ratios, RNG.normal(0, 1, N))
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    loss, grad = loss_math.cispo(lp, inputs, config)
    clipped = np.clip(ratios, 0.5, 2.0)
    np.testing.assert_allclose(grad, -clipped * inputs["advantages"])
    assert np.isclose(loss, -(clipped * inputs["advantages"] * lp).sum())
    # Where the clip is active the weight is constant, so the finite difference agrees there.
    outside = (ratios < 0.45) | (ratios > 2.2)
    assert outside.any()
    numeric = finite_difference(loss_math.cispo, lp, inputs, config)
    np.testing.assert_allclose(grad[outside], numeric[outside], atol=1e-6)
    assert dict(LOSS_SPECS["cispo"].config_defaults) == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 4.0,
    }


def test_dro() -> None:
    lp = -RNG.uniform(0.1, 3, N)
    inputs = rl_inputs(lp, RNG.uniform(0.5, 2, N), RNG.normal(0, 1, N))
    loss, _ = check_gradient("dro", lp, inputs)
    check_gradient("dro", lp, inputs, {"beta": 0.7})
    diff = lp - inputs["logprobs"]
    assert np.isclose(loss, -(lp * inputs["advantages"] - 0.025 * diff**2).sum())


@pytest.mark.parametrize(
    ("log_ratio", "advantage"), [(0.05, 1.0), (0.4, 1.0), (0.4, -1.0), (-0.5, -1.0), (-0.5, 1.0)]
)
def test_gspo_sequence_advantage_matches_finite_difference(
    log_ratio: float, advantage: float
) -> None:
    # With one advantage for the sequence and a full mask, the per-token gradient (each token's
    # own path) sums to the gradient of the sequence-level objective, so they agree exactly.
    lp = -RNG.uniform(0.1, 3, N)
    noise = RNG.normal(0, 0.05, N)
    inputs = {
        "logprobs": lp - log_ratio - (noise - noise.mean()),
        "advantages": np.full(N, advantage),
    }
    loss, _ = check_gradient("gspo", lp, inputs)
    s = np.exp(log_ratio)
    clipped = np.clip(s, 0.8, 1.2)
    assert np.isclose(loss, -N * min(s * advantage, clipped * advantage))


def test_gspo_per_token_form_with_mask() -> None:
    lp = -RNG.uniform(0.1, 3, N)
    q = lp - RNG.normal(0, 0.3, N)
    mask = (RNG.uniform(size=N) > 0.4).astype(np.float64)
    adv = RNG.normal(0, 1, N)
    config = LOSS_SPECS["gspo"].config_defaults
    loss, grad = loss_math.gspo(
        lp, {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask}, config
    )
    s = np.exp(((lp - q) * mask).sum() / mask.sum())
    unclipped, clipped = s * adv, np.clip(s, 0.8, 1.2) * adv
    assert np.isclose(loss, -np.minimum(unclipped, clipped).sum())
    np.testing.assert_allclose(grad, np.where(unclipped <= clipped, -s * adv, 0.0))
    # An empty mask means a ratio of 1.
    loss, _ = loss_math.gspo(
        lp, {"logprobs": q, "advantages": adv, "sequence_ratio_mask": np.zeros(N)}, config
    )
    assert np.isclose(loss, -adv.sum())
