"""Per-request failure isolation for batch calls: a batch that raises is run again in halves.

A batch call (forward_backward, sample) answers each request with a result or an `EngineError`;
an exception raised by the call as a whole says only that *something* in the batch failed. The
batch is then run again split in two, each half split again while it still fails, so that the
request that fails even alone gets the error and every other request its own result: what it
would have had alone. Only a failure of the shared pass itself (every request fails, alone too)
fails the whole batch, and then each request still gets exactly one answer.

The calls this wraps must leave no effect when they raise (the backends take back what a
failed batch accumulated), or running the halves again would apply a request twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from tuneloop.server.engine.types import EngineError

__all__ = [
    "NON_FINITE_LOGITS",
    "SKIPPED",
    "all_finite",
    "alone_error",
    "bisect_failures",
    "skipped_step_metrics",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# The error of a sampling request whose model (its adapter) gives NaN or infinite logits.
NON_FINITE_LOGITS = (
    "the sampler's weights give non-finite (NaN or infinite) logits for this request; "
    "sample from a checkpoint whose weights are finite"
)


# The metric of an optim_step that was not applied: 1.0, with `SKIPPED + "_nonfinite_" + what`
# (what: "gradients" or "weights") naming why. Applied steps do not carry it.
SKIPPED = "optim/skipped"


def skipped_step_metrics(nonfinite: str, learning_rate: float) -> dict[str, float]:
    """The metrics of an optim_step skipped because its `nonfinite` ("gradients": the
    accumulated gradients, or "weights": the weights or moments it would have produced) were
    NaN or infinite: nothing changed but the gradients, which are discarded, as a
    mixed-precision trainer skips a step whose gradients overflowed."""
    return {SKIPPED: 1.0, f"{SKIPPED}_nonfinite_{nonfinite}": 1.0, "learning_rate": learning_rate}


def alone_error(exc: BaseException, what: str) -> EngineError:
    """The error of the one request a failing batch was narrowed down to: its own
    `EngineError` (and category) as is, anything else a server error naming the exception."""
    if isinstance(exc, EngineError):
        return exc
    return EngineError(f"{what} failed for this request alone: {type(exc).__name__}: {exc}")


def bisect_failures(
    call: Callable[[Sequence[T]], Sequence[Any]], items: Sequence[T], what: str
) -> list[Any]:
    """`call(items)`, one answer per item; if it raises (or answers the wrong count), the
    halves are run apart, recursively, until the failing items are alone."""
    try:
        results = list(call(items))
        if len(results) != len(items):
            raise RuntimeError(f"{len(results)} answers for {len(items)} requests")
        return results
    except Exception as exc:
        if len(items) <= 1:
            log.exception("a %s request failed on its own", what)
            return [alone_error(exc, what) for _ in items]
        log.warning(
            "a %s batch of %d failed (%s: %s); running its halves apart",
            what,
            len(items),
            type(exc).__name__,
            exc,
        )
        middle = len(items) // 2
        return bisect_failures(call, items[:middle], what) + bisect_failures(
            call, items[middle:], what
        )


def all_finite(*arrays: np.ndarray) -> bool:
    """Whether every value of every array is finite (NaN and +-inf are not)."""
    return all(bool(np.isfinite(a).all()) for a in arrays)
