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
        before = self._copy()
        if step.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self._params, step.grad_clip_norm, total_norm)
        for group in self._adamw.param_groups:
            group["lr"] = step.learning_rate
            group["betas"] = (step.beta1, step.beta2)
            group["eps"] = step.eps
            group["weight_decay"] = step.weight_decay
        self._adamw.step()
        self.zero_grad()
        if not self._finite():
            self._restore(before)
            return skipped_step_metrics("weights", step.learning_rate)
        self._steps += 1
        return {"grad_norm": grad_norm, "learning_rate": step.learning_rate}

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

    def _finite(self) -> bool:
        """Whether every weight and every AdamW moment is finite."""
        tensors: list[torch.Tensor] = [p.detach() for p in self._params]
        for state in self._adamw.state.values():
            tensors += [v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)]
        return all(bool(torch.isfinite(t).all()) for t in tensors)

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
