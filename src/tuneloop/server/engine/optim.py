"""One AdamW optimizer per adapter, driven by the client's per-step hyperparameters.

The client sends the learning rate (and betas, eps, weight decay, clip norm) with every
``optim_step``, so any schedule is the client's job: each step rewrites the param group's
hyperparameters before stepping ``torch.optim.AdamW`` (decoupled weight decay, "identical to
torch.optim.AdamW" per the wire spec).

Order of one step: global grad norm -> skip on a non-finite norm -> global-norm clip (when
``grad_clip_norm`` > 0) -> AdamW -> skip (undo) if a weight or moment came out non-finite ->
clear the grads. A skipped step changes nothing but the gradients (discarded) and says so in
its metrics (`isolation.skipped_step_metrics`), as mixed-precision trainers skip a step whose
gradients overflowed: an adapter never becomes non-finite. A parameter whose ``.grad`` is None (no
``forward_backward`` reached it since the last step) counts as a zero gradient, so its moments
still decay, weight decay still applies and every parameter shares one step count.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch

from tuneloop.server.engine.isolation import skipped_step_metrics
from tuneloop.server.engine.types import AdamStep

_STEPS_KEY = "tuneloop_steps"


class AdapterOptimizer:
    """AdamW over one adapter's parameters; ``state_dict`` holds all it needs to continue."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._params = list(params)
        if not self._params:
            raise ValueError("AdapterOptimizer needs at least one parameter")
        # foreach/fused left at torch's default: deterministic on CPU (single-tensor there).
        self._adamw = torch.optim.AdamW(self._params, lr=0.0, weight_decay=0.0)
        self._steps = 0
        # Upper bounds of max |weight|, |first moment|, |second moment| over every element,
        # carried from step to step in closed form (None: measure them). While a step's
        # bounds stay far below the dtype's range it cannot overflow and needs no copy to take
        # back; only a step that might is copied, applied, checked and undone if non-finite.
        self._bounds: tuple[float, float, float] | None = None

    @property
    def steps(self) -> int:
        return self._steps

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def step(self, step: AdamStep) -> dict[str, float]:
        """Clip, apply one AdamW step with ``step``'s hyperparameters, then clear the grads.

        Returns ``grad_norm`` (the global L2 norm before clipping) and ``learning_rate``. A
        non-finite norm, or a step whose weights or moments would be non-finite, is skipped:
        the weights and optimizer state stay as they were, the grads are cleared so the adapter
        can train again, and the metrics say so.
        """
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self._params if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        grad_norm = float(total_norm)
        if not math.isfinite(grad_norm):
            self.zero_grad()
            return skipped_step_metrics("gradients", step.learning_rate)
        # Every element of the (clipped) gradient is at most its global norm.
        largest = min(grad_norm, step.grad_clip_norm) if step.grad_clip_norm > 0 else grad_norm
        bounds = self._bounds_after(step, largest, self._bounds or self._measure())
        if bounds is None and self._bounds is not None:  # the carried bounds may be loose
            bounds = self._bounds_after(step, largest, self._measure())
        before = self._copy() if bounds is None else None
        if step.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self._params, step.grad_clip_norm, total_norm)
        for group in self._adamw.param_groups:
            group["lr"] = step.learning_rate
            group["betas"] = (step.beta1, step.beta2)
            group["eps"] = step.eps
            group["weight_decay"] = step.weight_decay
        self._adamw.step()
        self.zero_grad()
        self._bounds = bounds
        if before is not None and not self._finite():
            self._restore(before)
            return skipped_step_metrics("weights", step.learning_rate)
        self._steps += 1
        return {"grad_norm": grad_norm, "learning_rate": step.learning_rate}

    def _measure(self) -> tuple[float, float, float]:
        """The actual max |weight|, |first moment|, |second moment| (one device sync)."""
        groups: list[list[torch.Tensor]] = [[p.detach() for p in self._params], [], []]
        for state in self._adamw.state.values():
            for index, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
                if isinstance(state.get(key), torch.Tensor):
                    groups[index].append(state[key])
        # Before the first step there are no moments: a zero on the weights' device (a CPU
        # zero stacked with CUDA maxima fails).
        zero = torch.zeros((), device=self._params[0].device)
        maxima = [torch.stack([t.abs().max() for t in g]).max() if g else zero for g in groups]
        weight, m, v = (float(x) for x in torch.stack(maxima).tolist())
        return weight, m, v

    def _bounds_after(
        self, step: AdamStep, largest_grad: float, bounds: tuple[float, float, float]
    ) -> tuple[float, float, float] | None:
        """Bounds after `step` (torch AdamW: decay, moments, p -= lr/bc1 * m / (sqrt(v/bc2) +
        eps), the denominator >= eps, bc1 >= 1 - beta1), or None if they could overflow."""
        weight, m, v = bounds
        m = step.beta1 * m + (1 - step.beta1) * largest_grad
        v = step.beta2 * v + (1 - step.beta2) * largest_grad * largest_grad
        correction = 1 - step.beta1 if step.beta1 > 0 else 1.0
        update = step.learning_rate * m / correction / step.eps
        weight = abs(1 - step.learning_rate * step.weight_decay) * weight + update
        limit = torch.finfo(self._params[0].dtype).max / 1e3  # margin for rounding
        after = (weight, m, v)
        return after if all(math.isfinite(x) and x < limit for x in after) else None

    def _copy(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """The weights and AdamW state as they are, to take a step back that went non-finite."""
        weights = [p.detach().clone() for p in self._params]
        return weights, copy.deepcopy(self._adamw.state_dict())

    def _restore(self, saved: tuple[list[torch.Tensor], dict[str, Any]]) -> None:
        weights, state = saved
        with torch.no_grad():
            for param, weight in zip(self._params, weights, strict=True):
                param.copy_(weight)
        self._adamw.load_state_dict(state)
        self._bounds = None

    def _finite(self) -> bool:
        """Whether every weight and every AdamW moment is finite."""
        tensors: list[torch.Tensor] = [p.detach() for p in self._params]
        for state in self._adamw.state.values():
            tensors += [v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)]
        # One device sync for all of them, not one per tensor.
        return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())

    def state_dict(self) -> dict[str, Any]:
        """The AdamW state (moments and per-parameter step counts) plus the step count."""
        state = self._adamw.state_dict()
        state[_STEPS_KEY] = self._steps
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output onto the same parameters, in the same order."""
        adamw_state = {k: v for k, v in state.items() if k != _STEPS_KEY}
        self._adamw.load_state_dict(adamw_state)
        self._steps = int(state.get(_STEPS_KEY, 0))
        self._bounds = None
