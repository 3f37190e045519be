"""The cyclic garbage collector, kept from stalling the event loop while large bodies decode.

A collection holds the GIL for its whole length, whichever thread triggered it: while a
forward_backward body of 64 MB is decoded on a worker thread (thousands of lists, arrays and
models), every tenant's request waits for the collections that decoding triggers. Measured with
bench/event_loop.py: full (generation 2) collections of 60-190 ms, which walk everything the
server imported and built at startup, and generation-1 collections of 5-20 ms that walk the
half-decoded body. Two remedies, both from the standard library:

- `freeze_startup_heap`: once the server is up, what it built so far (modules, models, the app)
  moves to the collector's permanent generation (`gc.freeze`), so later collections no longer
  walk it. Frozen objects are still freed by reference counting as usual.
- `collector_paused`: while a large training body is decoded and validated, no collection runs
  (`gc.disable`, counted across concurrent requests). The decoded objects hold no reference
  cycles and are freed by reference counting when the request is done; anything cyclic the
  rest of the server made meanwhile is collected by the first collection after.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

# Turned off together by bench/event_loop.py to measure the server without them.
ENABLED = True


def freeze_startup_heap() -> int:
    """Collect once, then exempt every object alive now from later collections; how many."""
    if not ENABLED:
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class _CollectorPause:
    """`gc.disable()` while at least one holder is inside; the collector's earlier state after."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    @property
    def holders(self) -> int:
        return self._holders

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if not ENABLED:
            yield
            return
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._was_enabled:
                    gc.enable()


collector_paused = _CollectorPause()

__all__ = ["ENABLED", "collector_paused", "freeze_startup_heap"]
