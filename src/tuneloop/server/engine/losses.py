"""Built-in losses in torch: pure functions of one datum behind a name registry.

Conventions (wire spec section 3), shared by every loss here:
- lp = the learner's logprob of each target token (the differentiable input), q = the sampler's
  logprobs (input ``logprobs``), A = ``advantages``, w = ``weights``, r = exp(lp - q).
- Sign: the value is a loss to MINIMISE (the optimizer descends it), so rewards enter negated.
- Reduction: a plain SUM over every token of the datum; no normalisation by token count or batch
  size. Gradients of successive calls add up until the optimizer step.

Each loss is written once, as its per-token terms (``TERMS``: a tensor shaped like ``lp``, which
depends on ``logprobs`` only: every other input is treated as a constant); the loss of one datum
(``LOSSES``, ``compute_loss``) is their sum, with exactly the value and d loss / d lp of the NumPy
reference in ``loss_math`` (which the FakeBackend trains with; ``tests/unit/engine/test_losses.py``
checks it). ``batch_losses`` takes every datum of a request in one pass: the datums' tokens end
to end, one set of elementwise operations, per-datum sums by a segment reduction (``index_add``),
and no device-to-host copy, so a training step syncs once per micro-batch, not twice per datum.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from tuneloop.server.engine.custom_loss import input_tensors, run_custom_loss
from tuneloop.server.engine.loss_specs import LOSS_SPECS
from tuneloop.server.engine.types import EngineError, ForwardBackwardWork

__all__ = ["LOSSES", "TERMS", "Segments", "batch_losses", "compute_loss", "datum_loss"]

Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float]
LossFn = Callable[[torch.Tensor, Inputs, Config], torch.Tensor]


@dataclass(frozen=True)
class Segments:
    """The datums of tokens laid end to end: ``index[t]`` is token t's datum, of ``count``."""

    index: torch.Tensor  # [N] int64
    count: int

    @classmethod
    def of_lengths(cls, lengths: Sequence[int], device: torch.device | None) -> Segments:
        sizes = torch.as_tensor(list(lengths), dtype=torch.long)
        index = torch.repeat_interleave(torch.arange(len(lengths)), sizes)
        return cls(index.to(device), len(lengths))

    def sums(self, x: torch.Tensor) -> torch.Tensor:
        """Per datum, the sum of its tokens' x ([N] or [N, K]): [count]."""
        per_token = x if x.ndim == 1 else x.reshape(x.shape[0], -1).sum(-1)
        return per_token.new_zeros(self.count).index_add(0, self.index, per_token)

    def spread(self, per_datum: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A per-datum value back on each token, broadcastable against `like` ([N] or [N, K])."""
        out = per_datum.index_select(0, self.index)
        return out.reshape(out.shape + (1,) * (like.ndim - 1))


# Per-token terms: (lp, inputs, config, segments) -> a tensor shaped like lp whose sum over a
# datum's tokens is its loss. `segments` is None for one datum alone; only losses with a
# per-sequence quantity (GSPO's sequence ratio) read it.
TermFn = Callable[[torch.Tensor, Inputs, Config, "Segments | None"], torch.Tensor]

Bound = torch.Tensor | float


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _const(inputs: Inputs, key: str) -> torch.Tensor:
    """A loss input as a float32 constant: never part of the graph, even if the caller's was."""
    return _f32(inputs[key].detach())


def cross_entropy(
    lp: torch.Tensor, inputs: Inputs, config: Config, segments: Segments | None = None
) -> torch.Tensor:
    """Weighted negative log-likelihood: ``L = -sum_t w_t * lp_t``.

    Shapes: lp and w are [N], or [N, K] for the top-K (soft target) form, summed over both axes.
    Weights may be any real number, negative included (the client-side custom-loss surrogate
    sends w = -dC/dlp); missing weights mean all ones. dL/dlp = -w.
    """
    weights = inputs.get("weights")
    if weights is None:
        return -lp
    return -(_f32(weights.detach()) * lp)


def importance_sampling(
    lp: torch.Tensor, inputs: Inputs, config: Config, segments: Segments | None = None
) -> torch.Tensor:
    """Off-policy REINFORCE: ``L = -sum_t exp(lp_t - q_t) * A_t``; dL/dlp_t = -r_t A_t.

    RL losses take no ``weights``: prompt and padding positions carry A = 0.
    """
    ratio = torch.exp(lp - _const(inputs, "logprobs"))
    return -(ratio * _const(inputs, "advantages"))


def _clip_bounds(inputs: Inputs, config: Config) -> tuple[Bound, Bound]:
    """Absolute ratio bounds; per-token ``clip_*_threshold`` inputs override the config."""
    low: Bound = (
        _const(inputs, "clip_low_threshold")
        if "clip_low_threshold" in inputs
        else float(config["clip_low_threshold"])
    )
    high: Bound = (
        _const(inputs, "clip_high_threshold")
        if "clip_high_threshold" in inputs
        else float(config["clip_high_threshold"])
    )
    return low, high


def _clip(x: torch.Tensor, low: Bound, high: Bound) -> torch.Tensor:
    """``np.clip``: min(max(x, low), high), so high wins if the bounds cross."""
    low_t = torch.as_tensor(low, dtype=x.dtype, device=x.device)
    high_t = torch.as_tensor(high, dtype=x.dtype, device=x.device)
    return torch.minimum(torch.maximum(x, low_t), high_t)


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, low: Bound, high: Bound
) -> torch.Tensor:
    """``-min(r_t A_t, clip(r_t, lo, hi) A_t)`` per token.

    The gradient flows (as -A dr) only where the unclipped term is the minimum, ties included;
    where the clipped term is strictly smaller the token contributes a constant. Written with an
    explicit ``where`` rather than ``torch.minimum`` so ties do not split the gradient.
    """
    unclipped = ratio * adv
    clipped = (_clip(ratio.detach(), low, high) * adv).detach()
    return -torch.where(unclipped.detach() <= clipped, unclipped, clipped)


def ppo(
    lp: torch.Tensor, inputs: Inputs, config: Config, segments: Segments | None = None
) -> torch.Tensor:
    """PPO clipped objective: ``L = -sum_t min(r_t A_t, clip(r_t, lo, hi) A_t)``.

    lo/hi (config ``clip_low_threshold``/``clip_high_threshold``, defaults 0.8/1.2) are absolute
    ratio bounds, not epsilons. dL/dlp_t = -r_t A_t where r_t A_t is the minimum, else 0.
    """
    low, high = _clip_bounds(inputs, config)
    ratio = torch.exp(lp - _const(inputs, "logprobs"))
    return _clipped_surrogate(ratio, _const(inputs, "advantages"), low, high)


def cispo(
    lp: torch.Tensor, inputs: Inputs, config: Config, segments: Segments | None = None
) -> torch.Tensor:
    """CISPO: ``L = -sum_t sg(clip(r_t, lo, hi)) * lp_t * A_t`` (sg = stop-gradient).

    The clipped ratio is a constant weight (defaults lo/hi = 0.0/4.0, one-sided), so
    dL/dlp_t = -clip(r_t, lo, hi) A_t.
    """
    low, high = _clip_bounds(inputs, config)
    ratio = torch.exp(lp.detach() - _const(inputs, "logprobs"))
    weight = _clip(ratio, low, high) * _const(inputs, "advantages")
    return -(weight * lp)


def dro(
    lp: torch.Tensor, inputs: Inputs, config: Config, segments: Segments | None = None
) -> torch.Tensor:
    """DRO: ``L = -sum_t [lp_t A_t - beta/2 (lp_t - q_t)^2]``.

    dL/dlp_t = -(A_t - beta (lp_t - q_t)). ``beta`` comes from the config (default 0.05);
    A is expected in DRO's soft form.
    """
    beta = float(config["beta"])
    diff = lp - _const(inputs, "logprobs")
    return -(lp * _const(inputs, "advantages") - 0.5 * beta * diff * diff)


def gspo(
    lp: torch.Tensor, inputs: Inputs, config: Config, segments: Segments | None = None
) -> torch.Tensor:
    """GSPO-token: ``L = -sum_t min(s_t A_t, clip(s_t, lo, hi) A_t)``.

    Sequence log-ratio ``l = mean_{t in M} (sg(lp_t) - q_t)`` over the mask M (tokens where
    ``sequence_ratio_mask`` != 0; missing mask = every token; an empty mask gives l = 0), and
    ``s_t = exp(l + lp_t - sg(lp_t))``: every token's value is exp(l), its gradient with respect to
    lp_t is s_t (the token's own path only). Clip defaults as PPO's (0.8/1.2).
    dL/dlp_t = -s_t A_t where s_t A_t is the minimum, else 0.
    """
    mask_in = inputs.get("sequence_ratio_mask")
    lp_const = lp.detach()
    if mask_in is None:
        mask = torch.ones_like(lp_const)
    else:
        mask = (mask_in.detach() != 0).to(lp_const.dtype)
    masked = (lp_const - _const(inputs, "logprobs")) * mask
    if segments is None:
        count, total = mask.sum(), masked.sum()
    else:  # each datum's own sequence ratio
        count, total = segments.sums(mask), segments.sums(masked)
    log_ratio = torch.where(count > 0, total / count.clamp_min(1.0), torch.zeros_like(count))
    if segments is not None:
        log_ratio = segments.spread(log_ratio, lp_const)
    seq_ratio = torch.exp(log_ratio + (lp - lp_const))
    low, high = _clip_bounds(inputs, config)
    return _clipped_surrogate(seq_ratio, _const(inputs, "advantages"), low, high)


def stable_reinforce(
    lp: torch.Tensor, inputs: Inputs, config: Config, segments: Segments | None = None
) -> torch.Tensor:
    """REINFORCE with truncated importance weights against the sampler's RECORDED logprobs:
    ``L = -sum_t m_t [sg(min(r_t, c)) A_t lp_t - kl_coeff/2 (lp_t - q_t)^2]``.

    q = ``recorded_logprobs``: the logprob the server's sampler gave each sampled token when it
    drew it (kept per sequence_id by the stability records; the request's ``logprobs`` are not
    trusted for this). r_t = exp(lp_t - q_t); m = ``sampled_mask`` (1 on targets that are
    sampled tokens, 0 on prompt positions, whatever their advantage); c =
    ``clip_high_threshold`` (default 2.0) caps the weight, so stale (off-policy) or
    low-precision samples cannot blow the update up; the weight is a constant (REINFORCE form,
    the gradient never flows through the ratio). kl_coeff (default 0) adds the k2 penalty
    1/2 (log pi/q)^2 toward the sampling policy.
    dL/dlp_t = -m_t (min(r_t, c) A_t - kl_coeff (lp_t - q_t)). On-policy (r = 1) the gradient
    is plain REINFORCE, -A grad lp, the same as importance_sampling's.
    """
    q = _const(inputs, "recorded_logprobs")
    mask = _const(inputs, "sampled_mask")
    diff = lp - q
    cap = torch.as_tensor(float(config["clip_high_threshold"]), dtype=lp.dtype, device=lp.device)
    weight = torch.minimum(torch.exp(diff.detach()), cap)
    kl = float(config["kl_coeff"])
    return -(mask * (weight * _const(inputs, "advantages") * lp - 0.5 * kl * diff * diff))


TERMS: Mapping[str, TermFn] = MappingProxyType(
    {
        "cross_entropy": cross_entropy,
        "importance_sampling": importance_sampling,
        "ppo": ppo,
        "cispo": cispo,
        "dro": dro,
        "gspo": gspo,
        "stable_reinforce": stable_reinforce,
    }
)


def _summed(terms: TermFn) -> LossFn:
    def loss(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
        return terms(lp, inputs, config, None).sum()

    loss.__name__ = loss.__qualname__ = terms.__name__
    loss.__doc__ = terms.__doc__
    return loss


# name -> the summed loss of one datum (a 0-d tensor).
LOSSES: Mapping[str, LossFn] = MappingProxyType({k: _summed(v) for k, v in TERMS.items()})


def compute_loss(
    loss_fn: str, logprobs: torch.Tensor, inputs: Inputs, config: Config
) -> torch.Tensor:
    """The summed loss of one datum as a 0-d float32 tensor, differentiable w.r.t. ``logprobs``.

    ``config`` is merged over the loss's defaults from ``LOSS_SPECS`` (the caller usually has
    already done so); bf16/fp16 logprobs are upcast to float32 first. ``target_tokens`` and any
    input a loss does not name are ignored. An unknown name raises a user ``EngineError``.
    """
    fn = LOSSES.get(loss_fn)
    if fn is None:
        known = ", ".join(sorted(LOSSES))
        raise EngineError(f"unknown loss function {loss_fn!r}; known: {known}", "user")
    merged = {**LOSS_SPECS[loss_fn].config_defaults, **config}
    return fn(_f32(logprobs), inputs, merged)


def datum_loss(
    work: ForwardBackwardWork,
    logprobs: torch.Tensor,
    inputs: Mapping[str, np.ndarray],
    device: torch.device | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one datum of `work` and its metrics (a custom loss's ``custom/...``).

    Built-in losses see every input but ``target_tokens`` as float32 on `device`; a custom loss
    sees the inputs it declared, each in its own dtype (as the SDK's client-side run does).
    """
    if work.custom_loss is not None:
        # On the CPU whatever the device: a user's indexing out of range is an exception there,
        # where on a GPU it would be a device-side assert that ends the process's CUDA context
        # (every tenant's work). The vectors are small; autograd carries the gradient back.
        tensors = input_tensors(work.custom_loss, inputs)
        loss, metrics = run_custom_loss(work.custom_loss, _f32(logprobs).cpu(), tensors)
        return loss.to(logprobs.device), metrics
    floats = {
        k: torch.as_tensor(v, dtype=torch.float32, device=device)
        for k, v in inputs.items()
        if k != "target_tokens"
    }
    return compute_loss(work.loss_fn, logprobs, floats, work.loss_config), {}


def batch_losses(
    work: ForwardBackwardWork,
    logprobs: Sequence[torch.Tensor],
    inputs: Sequence[Mapping[str, np.ndarray]],
    device: torch.device | None = None,
) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """The loss of every datum of `work` ([n] float32, differentiable) and each one's metrics.

    `logprobs[i]` and `inputs[i]` are datum i's. A built-in loss runs once over the datums end
    to end (their inputs concatenated on the host and copied over once), summed per datum by
    `Segments`; nothing here waits for the device. Datums whose inputs cannot be laid end to end
    (different input names or top-K widths) and custom losses run datum by datum, still
    without a sync. An unknown loss raises a user ``EngineError``.
    """
    if work.custom_loss is not None or not _concatenable(logprobs, inputs):
        pairs = [
            datum_loss(work, lp, inp, device) for lp, inp in zip(logprobs, inputs, strict=True)
        ]
        losses = torch.stack([_f32(loss).reshape(()) for loss, _ in pairs])
        return losses, [metrics for _, metrics in pairs]
    terms_fn = TERMS.get(work.loss_fn)
    if terms_fn is None:
        known = ", ".join(sorted(TERMS))
        raise EngineError(f"unknown loss function {work.loss_fn!r}; known: {known}", "user")
    floats = {
        key: torch.as_tensor(
            np.concatenate([inp[key] for inp in inputs]), dtype=torch.float32, device=device
        )
        for key in inputs[0]
        if key != "target_tokens"
    }
    segments = Segments.of_lengths([lp.shape[0] for lp in logprobs], device)
    merged = {**LOSS_SPECS[work.loss_fn].config_defaults, **work.loss_config}
    lp = torch.cat([_f32(x) for x in logprobs]) if len(logprobs) > 1 else _f32(logprobs[0])
    terms = terms_fn(lp, floats, merged, segments)
    return segments.sums(terms), [{} for _ in logprobs]


def _concatenable(
    logprobs: Sequence[torch.Tensor], inputs: Sequence[Mapping[str, np.ndarray]]
) -> bool:
    """Whether the datums' logprobs and inputs can be laid end to end along their first axis."""
    if len({tuple(lp.shape[1:]) for lp in logprobs}) != 1:
        return False
    names = {frozenset(inp) for inp in inputs}
    if len(names) != 1:
        return False
    return all(
        len({np.shape(inp[key])[1:] for inp in inputs}) == 1
        and all(
            np.shape(inp[key])[:1] == tuple(lp.shape[:1])
            for inp, lp in zip(inputs, logprobs, strict=True)
        )
        for key in next(iter(names))
        if key != "target_tokens"
    )
