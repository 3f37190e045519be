"""Continuous batching over one base model's paged decoder (`TorchBackend.sample_continuous`).

Requests join at step boundaries: those `admit()` returns (once per step) wait in arrival order
until the decoder has the KV blocks for their worst case, then start prefilling while the rows
already there keep decoding. Requests for another base model wait for the next run (one model
decodes at a time); those of cancelled samplers are answered at once, wherever they are.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from tuneloop.server.engine.decoder import Decoder
from tuneloop.server.engine.runtime import Runtime
from tuneloop.server.engine.types import CANCELLED, EngineError, SampleResult, SampleWork

__all__ = ["ContinuousRun"]

Deliver = Callable[[SampleWork, SampleResult | EngineError], None]


def _cancelled() -> EngineError:
    return EngineError(CANCELLED, "user")


class ContinuousRun:
    """One run: the first request's base model, until no row of it is left."""

    def __init__(
        self,
        owner: Callable[[str], Runtime | None],
        decoder: Callable[[Runtime], Decoder],
        route: Callable[[str, Runtime], tuple[str | None, str]],
        deliver: Deliver,
        cancelled: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self.owner, self.make_decoder, self.route = owner, decoder, route
        self.deliver, self.cancelled = deliver, cancelled
        self.runtime: Runtime | None = None
        self.decoder: Decoder | None = None
        self.waiting: list[SampleWork] = []  # this model's, in arrival order
        self.running: dict[int, SampleWork] = {}  # by id: SampleWork holds arrays, no __eq__
        self.later: list[SampleWork] = []  # for the next run

    def join(self, works: Sequence[SampleWork]) -> None:
        if works:  # the common case, once per step, is none
            gone = self.cancelled()
            for work in works:
                if work.cancelled_by(gone):
                    self.deliver(work, _cancelled())
                    continue
                owner = self.owner(work.sampler_id)
                if owner is None:
                    self.deliver(work, EngineError(f"no sampler {work.sampler_id!r}", "user"))
                    continue
                if self.runtime is None:
                    self.runtime, self.decoder = owner, self.make_decoder(owner)
                (self.waiting if owner is self.runtime else self.later).append(work)
        self._admit()

    def _admit(self) -> None:
        """Start the waiting requests that fit, in order: the first that does not fit waits
        (a long request is not overtaken for ever by short ones)."""
        decoder, runtime = self.decoder, self.runtime
        while self.waiting and decoder is not None and runtime is not None:
            work = self.waiting[0]
            key, namespace = self.route(work.sampler_id, runtime)
            try:
                started = decoder.admit(work, key, namespace)
            except EngineError as exc:
                self.waiting.pop(0)
                self.deliver(work, exc)
                continue
            if started is None:
                if not len(decoder):  # an empty pool fits any admissible request
                    raise RuntimeError("KV blocks are held with no request running")
                return
            self.waiting.pop(0)
            self.running[id(work)] = work

    def run(
        self, works: Sequence[SampleWork], admit: Callable[[], Sequence[SampleWork]]
    ) -> list[SampleWork]:
        """Decode until no row is left; returns the requests left for the next run."""
        decoder: Decoder | None = None
        try:
            self.join(works)
            decoder = self.decoder
            while decoder is not None and (len(decoder) or self.waiting):
                for request, result in decoder.step():
                    self.running.pop(id(request.work), None)
                    self.deliver(request.work, result)
                self._drop_cancelled()
                self.join(admit())
        except torch.OutOfMemoryError:
            if decoder is not None:
                decoder.abort()
            for work in [*self.running.values(), *self.waiting]:
                self.deliver(
                    work, EngineError("out of memory while sampling; retry with fewer samples")
                )
        except BaseException:
            if decoder is not None:  # the blocks of what was running go back to the pool
                decoder.abort()
            raise
        return self.later

    def _drop_cancelled(self) -> None:
        gone = self.cancelled()
        if not gone:
            return
        if self.decoder is not None:
            for request in self.decoder.drop(lambda work: work.cancelled_by(gone)):
                self.running.pop(id(request.work), None)
                self.deliver(request.work, _cancelled())
        for queue in (self.waiting, self.later):
            for work in [w for w in queue if w.cancelled_by(gone)]:
                self.deliver(work, _cancelled())
            queue[:] = [w for w in queue if not w.cancelled_by(gone)]
