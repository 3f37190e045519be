"""Reference loss math in NumPy: per-token loss and its gradient with respect to the logprobs.

Conventions (wire spec section 3): every loss is a SUM over tokens with no normalisation;
lp = learner logprob of the target, q = sampler logprob, A = advantage, r = exp(lp - q).
Each function returns (loss, dloss/dlp) with dloss/dlp shaped like lp. The FakeBackend trains
with these, and the torch engine's losses are tested against them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

Inputs = Mapping[str, np.ndarray]
Config = Mapping[str, float]
LossFn = Callable[[np.ndarray, Inputs, Config], tuple[float, np.ndarray]]


def cross_entropy(lp: np.ndarray, inputs: Inputs, config: Config) -> tuple[float, np.ndarray]:
    """L = -sum w * lp; weights may be any real number and 2-D (top-K soft targets)."""
    w = inputs.get("weights")
    w = np.ones_like(lp) if w is None else w.astype(np.float64)
    return float(-(w * lp).sum()), -w


def importance_sampling(lp: np.ndarray, inputs: Inputs, config: Config) -> tuple[float, np.ndarray]:
    """L = -sum exp(lp - q) * A; dL/dlp = -r * A."""
    ratio = np.exp(lp - inputs["logprobs"])
    adv = inputs["advantages"]
    return float(-(ratio * adv).sum()), -ratio * adv


def _clip_bounds(inputs: Inputs, config: Config) -> tuple[np.ndarray | float, np.ndarray | float]:
    low = inputs.get("clip_low_threshold", config["clip_low_threshold"])
    high = inputs.get("clip_high_threshold", config["clip_high_threshold"])
    return low, high


def _clipped_surrogate(
    ratio: np.ndarray, adv: np.ndarray, low: np.ndarray | float, high: np.ndarray | float
) -> tuple[float, np.ndarray]:
    """-sum min(r A, clip(r) A); the gradient flows (as -A dr) only where r A is the minimum."""
    unclipped = ratio * adv
    clipped = np.clip(ratio, low, high) * adv
    loss = -np.minimum(unclipped, clipped).sum()
    grad = np.where(unclipped <= clipped, -unclipped, 0.0)
    return float(loss), grad


def ppo(lp: np.ndarray, inputs: Inputs, config: Config) -> tuple[float, np.ndarray]:
    """L = -sum min(r A, clip(r, lo, hi) A); lo/hi are absolute ratio bounds (0.8/1.2)."""
    low, high = _clip_bounds(inputs, config)
    return _clipped_surrogate(np.exp(lp - inputs["logprobs"]), inputs["advantages"], low, high)


def cispo(lp: np.ndarray, inputs: Inputs, config: Config) -> tuple[float, np.ndarray]:
    """L = -sum sg(clip(r, lo, hi)) * lp * A; the clipped ratio is a constant weight."""
    low, high = _clip_bounds(inputs, config)
    weight = np.clip(np.exp(lp - inputs["logprobs"]), low, high) * inputs["advantages"]
    return float(-(weight * lp).sum()), -weight


def dro(lp: np.ndarray, inputs: Inputs, config: Config) -> tuple[float, np.ndarray]:
    """L = -sum [lp A - beta/2 (lp - q)^2]."""
    beta = config["beta"]
    diff = lp - inputs["logprobs"]
    adv = inputs["advantages"]
    return float(-(lp * adv - 0.5 * beta * diff**2).sum()), -(adv - beta * diff)


def gspo(lp: np.ndarray, inputs: Inputs, config: Config) -> tuple[float, np.ndarray]:
    """GSPO-token: s_t = exp(l + lp_t - sg(lp_t)), l = mean over the mask of (sg(lp) - q).

    L = -sum min(s A, clip(s) A). The value of s_t is exp(l) for every token; its gradient
    with respect to lp_t is s_t (the token's own path only).
    """
    mask = inputs.get("sequence_ratio_mask")
    mask = np.ones_like(lp) if mask is None else (mask != 0).astype(np.float64)
    count = mask.sum()
    log_ratio = float(((lp - inputs["logprobs"]) * mask).sum() / count) if count else 0.0
    seq_ratio = np.full_like(lp, np.exp(log_ratio))
    low, high = _clip_bounds(inputs, config)
    return _clipped_surrogate(seq_ratio, inputs["advantages"], low, high)


def stable_reinforce(lp: np.ndarray, inputs: Inputs, config: Config) -> tuple[float, np.ndarray]:
    """L = -sum m [sg(min(r, c)) A lp - kl_coeff/2 (lp - q)^2], with q the recorded sampler
    logprobs (``recorded_logprobs``), r = exp(lp - q), m = ``sampled_mask``, c =
    ``clip_high_threshold``; dL/dlp = -m (min(r, c) A - kl_coeff (lp - q))."""
    q = inputs["recorded_logprobs"]
    mask = inputs["sampled_mask"]
    adv = inputs["advantages"]
    kl = config["kl_coeff"]
    diff = lp - q
    weight = np.minimum(np.exp(diff), config["clip_high_threshold"])
    loss = -(mask * (weight * adv * lp - 0.5 * kl * diff**2)).sum()
    return float(loss), -mask * (weight * adv - kl * diff)


LOSS_FUNCTIONS: Mapping[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}
