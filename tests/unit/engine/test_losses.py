"""The torch losses against the NumPy reference in loss_math: values and d loss / d lp."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch

from tuneloop.server.engine import loss_math
from tuneloop.server.engine.loss_specs import LOSS_SPECS, UNSUPPORTED_LOSSES
from tuneloop.server.engine.losses import LOSSES, compute_loss
from tuneloop.server.engine.types import EngineError

N = 24
K = 5
SEEDS = range(6)
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")


def as_f32_f64(array: np.ndarray) -> np.ndarray:
    """Round to float32 and back, so torch (float32) and NumPy (float64) see the same numbers."""
    return array.astype(np.float32).astype(np.float64)


def make_inputs(name: str, seed: int, two_d: bool = False) -> tuple[np.ndarray, dict]:
    """Random lp and inputs; q - lp spreads ratios well inside and outside [0.8, 1.2]."""
    rng = np.random.default_rng(seed)
    shape = (N, K) if two_d else (N,)
    lp = np.log(rng.uniform(0.01, 1.0, size=shape))
    inputs: dict[str, np.ndarray] = {}
    if name == "cross_entropy":
        inputs["weights"] = rng.normal(0.0, 1.0, size=shape)  # negative weights included
    else:
        inputs["logprobs"] = lp + rng.normal(0.0, 0.4, size=shape)
        inputs["advantages"] = rng.normal(0.0, 1.0, size=shape)
        inputs["advantages"][:3] = 0.0  # prompt-like positions
    if name == "gspo":
        inputs["sequence_ratio_mask"] = (rng.uniform(size=shape) > 0.3).astype(np.float64)
    if name == "stable_reinforce":
        # ratios from ~0.3 to ~3: the cap (2.0) binds on some tokens
        inputs["recorded_logprobs"] = lp + rng.normal(0.0, 0.6, size=shape)
        inputs["sampled_mask"] = (rng.uniform(size=shape) > 0.2).astype(np.float64)
        inputs["sampled_mask"][:3] = 0.0
        inputs["advantages"][:3] = 1.5  # prompt positions with an advantage: masked anyway
    lp = as_f32_f64(lp)
    return lp, {key: as_f32_f64(value) for key, value in inputs.items()}


def to_torch(inputs: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor(value, dtype=torch.float32) for key, value in inputs.items()}


def torch_value_and_grad(
    name: str, lp: np.ndarray, inputs: Mapping[str, np.ndarray], config: Mapping[str, float]
) -> tuple[torch.Tensor, np.ndarray]:
    lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    loss = compute_loss(name, lp_t, to_torch(inputs), config)
    (grad,) = torch.autograd.grad(loss, lp_t)
    return loss, grad.numpy().astype(np.float64)


def reference(
    name: str, lp: np.ndarray, inputs: Mapping[str, np.ndarray], config: Mapping[str, float]
) -> tuple[float, np.ndarray]:
    merged = {**LOSS_SPECS[name].config_defaults, **config}
    return loss_math.LOSS_FUNCTIONS[name](lp, inputs, merged)


def assert_matches_reference(
    name: str, lp: np.ndarray, inputs: Mapping[str, np.ndarray], config: Mapping[str, float]
) -> float:
    loss, grad = torch_value_and_grad(name, lp, inputs, config)
    ref_loss, ref_grad = reference(name, lp, inputs, config)
    assert loss.dtype == torch.float32
    assert loss.shape == ()
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    return ref_loss


def test_registry_covers_every_spec() -> None:
    assert set(LOSSES) == set(LOSS_SPECS) == set(loss_math.LOSS_FUNCTIONS)
    for fn in LOSSES.values():
        doc = fn.__doc__ or ""
        assert "L = " in doc, fn.__name__  # formula and sign in every docstring


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(LOSS_SPECS))
def test_matches_reference(name: str, seed: int) -> None:
    lp, inputs = make_inputs(name, seed)
    assert_matches_reference(name, lp, inputs, {})


@pytest.mark.parametrize("seed", SEEDS)
def test_cross_entropy_top_k_negative_weights(seed: int) -> None:
    lp, inputs = make_inputs("cross_entropy", seed, two_d=True)
    assert (inputs["weights"] < 0).any()
    lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    loss = compute_loss("cross_entropy", lp_t, to_torch(inputs), {})
    (grad,) = torch.autograd.grad(loss, lp_t)
    assert grad.shape == (N, K)
    assert_matches_reference("cross_entropy", lp, inputs, {})


def test_cross_entropy_without_weights_is_minus_sum() -> None:
    lp, _ = make_inputs("cross_entropy", 0, two_d=True)
    loss = assert_matches_reference("cross_entropy", lp, {}, {})
    assert loss == pytest.approx(-lp.sum())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_clipped_losses_cover_both_branches(name: str, seed: int) -> None:
    """Per token the gradient is either the unclipped -r A or zero; the data hit both."""
    lp, inputs = make_inputs(name, seed + 100)
    inputs["advantages"] = inputs["advantages"] * 3.0
    _, grad = torch_value_and_grad(name, lp, inputs, {})
    _, ref_grad = reference(name, lp, inputs, {})
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    if name == "ppo":
        ratio = np.exp(lp - inputs["logprobs"])
        adv = inputs["advantages"]
        assert ((ratio > 1.2) & (adv > 0)).any() or ((ratio < 0.8) & (adv < 0)).any()
        assert (ratio < 0.8).any()
        assert (ratio > 1.2).any()
        assert ((ratio > 0.8) & (ratio < 1.2) & (adv != 0)).any()
        assert (grad[adv != 0] == 0).any()  # some tokens clipped
        assert (grad[adv != 0] != 0).any()  # some tokens still learn


@pytest.mark.parametrize("log_ratio", [-1.0, -0.1, 0.1, 1.0])
@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_gspo_sequence_ratio_inside_and_outside_clip(log_ratio: float, sign: float) -> None:
    """Shift q so the sequence ratio exp(l) lands inside or outside [0.8, 1.2]."""
    lp, inputs = make_inputs("gspo", 7)
    mask = inputs["sequence_ratio_mask"] != 0
    inputs["logprobs"] = as_f32_f64(lp - log_ratio)
    inputs["advantages"] = sign * np.abs(inputs["advantages"])
    assert_matches_reference("gspo", lp, inputs, {})
    _, grad = torch_value_and_grad("gspo", lp, inputs, {})
    clipped = (sign > 0 and log_ratio > np.log(1.2)) or (sign < 0 and log_ratio < np.log(0.8))
    assert mask.any()
    assert (np.abs(grad).sum() == 0) == clipped


def test_gspo_without_mask_and_with_empty_mask() -> None:
    lp, inputs = make_inputs("gspo", 3)
    del inputs["sequence_ratio_mask"]
    assert_matches_reference("gspo", lp, inputs, {})
    inputs["sequence_ratio_mask"] = np.zeros_like(lp)
    assert_matches_reference("gspo", lp, inputs, {})


@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_ratio_exactly_one_keeps_full_gradient(name: str) -> None:
    """r = 1 ties the two PPO terms; the gradient must be the whole -A, not split."""
    lp, inputs = make_inputs(name, 11)
    inputs["logprobs"] = lp.copy()
    _, grad = torch_value_and_grad(name, lp, inputs, {})
    np.testing.assert_allclose(grad, -inputs["advantages"], rtol=1e-6, atol=1e-7)
    assert_matches_reference(name, lp, inputs, {})


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["ppo", "cispo", "gspo"])
def test_per_token_clip_thresholds_override_config(name: str, seed: int) -> None:
    lp, inputs = make_inputs(name, seed + 200)
    rng = np.random.default_rng(seed)
    if name == "gspo":  # sequence ratio ~1.16: clipped by the config, not by most tokens' bounds
        inputs["logprobs"] = as_f32_f64(lp - 0.15 + rng.normal(0.0, 0.05, size=N))
    config = {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}
    with_tokens = dict(inputs)
    with_tokens["clip_low_threshold"] = as_f32_f64(rng.uniform(0.3, 0.9, size=N))
    with_tokens["clip_high_threshold"] = as_f32_f64(rng.uniform(1.1, 2.0, size=N))
    per_token = assert_matches_reference(name, lp, with_tokens, config)
    config_only = assert_matches_reference(name, lp, inputs, config)
    assert per_token != pytest.approx(config_only)


@pytest.mark.parametrize("seed", SEEDS)
def test_dro_beta_from_config(seed: int) -> None:
    lp, inputs = make_inputs("dro", seed)
    assert_matches_reference("dro", lp, inputs, {"beta": 0.7})


@pytest.mark.parametrize("name", sorted(LOSS_SPECS))
def test_defaults_merged_when_config_is_empty(name: str) -> None:
    lp, inputs = make_inputs(name, 5)
    lp_t = torch.tensor(lp, dtype=torch.float32)
    defaults = dict(LOSS_SPECS[name].config_defaults)
    empty = compute_loss(name, lp_t, to_torch(inputs), {})
    explicit = compute_loss(name, lp_t, to_torch(inputs), defaults)
    assert torch.equal(empty, explicit)


@pytest.mark.parametrize("name", sorted(LOSS_SPECS))
def test_target_tokens_ignored_and_inputs_are_constants(name: str) -> None:
    lp, inputs = make_inputs(name, 9)
    lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    tensors = {key: value.requires_grad_() for key, value in to_torch(inputs).items()}
    plain = compute_loss(name, lp_t, tensors, {})
    tensors_with_targets = {**tensors, "target_tokens": torch.arange(N, dtype=torch.int64)}
    loss = compute_loss(name, lp_t, tensors_with_targets, {})
    assert torch.equal(plain, loss)
    grads = torch.autograd.grad(loss, [lp_t, *tensors.values()], allow_unused=True)
    assert grads[0] is not None
    assert all(grad is None for grad in grads[1:])


@pytest.mark.parametrize("name", sorted(LOSS_SPECS))
def test_bf16_logprobs_give_float32_loss(name: str) -> None:
    lp, inputs = make_inputs(name, 4)
    lp_bf16 = torch.tensor(lp, dtype=torch.bfloat16, requires_grad=True)
    loss = compute_loss(name, lp_bf16, to_torch(inputs), {})
    assert loss.dtype == torch.float32
    assert loss.shape == ()
    (grad,) = torch.autograd.grad(loss, lp_bf16)
    assert grad.dtype == torch.bfloat16
    # Same as float32 on the bf16-rounded logprobs.
    rounded = lp_bf16.detach().to(torch.float32).numpy().astype(np.float64)
    ref_loss, _ = reference(name, rounded, inputs, {})
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["no_such_loss", *sorted(UNSUPPORTED_LOSSES)])
def test_unknown_loss_name_raises(name: str) -> None:
    lp = torch.zeros(3)
    with pytest.raises(EngineError, match=f"unknown loss function '{name}'") as info:
        compute_loss(name, lp, {}, {})
    assert info.value.category == "user"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"kl_coeff": 0.3},
        {"clip_high_threshold": 1.1},
        {"kl_coeff": 1.0, "clip_high_threshold": 5.0},
    ],
)
def test_stable_reinforce_config(seed: int, config: dict[str, float]) -> None:
    lp, inputs = make_inputs("stable_reinforce", seed + 300)
    assert_matches_reference("stable_reinforce", lp, inputs, config)


def test_stable_reinforce_weights_are_truncated_and_masked() -> None:
    lp, inputs = make_inputs("stable_reinforce", 1)
    _, grad = torch_value_and_grad("stable_reinforce", lp, inputs, {})
    ratio = np.exp(lp - inputs["recorded_logprobs"])
    mask = inputs["sampled_mask"] != 0
    adv = inputs["advantages"]
    assert (ratio[mask] > 2.0).any()
    assert (ratio[mask] < 2.0).any()
    # the gradient is -min(r, 2) A on sampled tokens and nothing elsewhere
    np.testing.assert_allclose(grad[mask], -np.minimum(ratio, 2.0)[mask] * adv[mask], rtol=1e-5)
    assert (adv[~mask] != 0).any()
    assert (grad[~mask] == 0).all()
    assert np.abs(grad).max() <= 2.0 * np.abs(adv).max() + 1e-6


def test_stable_reinforce_on_policy_is_reinforce_and_ignores_request_logprobs() -> None:
    """With the recorded logprobs equal to the learner's (r = 1) the gradient is -A, as
    importance_sampling's; the request's own `logprobs` change nothing."""
    lp, inputs = make_inputs("stable_reinforce", 2)
    inputs["recorded_logprobs"] = lp.copy()
    inputs["sampled_mask"] = np.ones_like(lp)
    _, grad = torch_value_and_grad("stable_reinforce", lp, inputs, {"kl_coeff": 0.5})
    is_inputs = {"logprobs": lp.copy(), "advantages": inputs["advantages"]}
    _, is_grad = torch_value_and_grad("importance_sampling", lp, is_inputs, {})
    np.testing.assert_allclose(grad, is_grad, rtol=1e-6, atol=1e-7)
    with_client_q = {**inputs, "logprobs": lp - 3.0}
    _, grad_client = torch_value_and_grad("stable_reinforce", lp, with_client_q, {"kl_coeff": 0.5})
    np.testing.assert_array_equal(grad, grad_client)


def test_stable_reinforce_kl_pulls_toward_the_sampler() -> None:
    lp, inputs = make_inputs("stable_reinforce", 3)
    inputs["advantages"] = np.zeros_like(lp)
    _, grad = torch_value_and_grad("stable_reinforce", lp, inputs, {"kl_coeff": 2.0})
    mask = inputs["sampled_mask"] != 0
    diff = lp - inputs["recorded_logprobs"]
    # descending the loss moves lp toward q: the gradient has the sign of lp - q
    np.testing.assert_allclose(grad[mask], 2.0 * diff[mask], rtol=1e-5, atol=1e-6)
