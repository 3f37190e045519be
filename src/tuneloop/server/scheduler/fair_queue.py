"""Sampling admission, round-robin by tenant.

Sampling requests carry no order among themselves, so the queue is free to choose which run
first: each tenant has its own FIFO, and a take hands out one request per tenant in turn, the
tenant served last going to the back; a tenant that had nothing queued goes ahead of those
served since. One tenant's thousand queued samples then delay another tenant's single request
by at most one request each of the tenants ahead of it, not by a thousand; within a tenant,
requests still run in arrival order.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["RoundRobin"]

T = TypeVar("T")


class RoundRobin(Generic[T]):
    """FIFOs per key, taken from one item per key in turn, the least recently served first."""

    def __init__(self, key: Callable[[T], str]) -> None:
        self._key = key
        # Keys with items queued that were not served since: first, in arrival order.
        self._fresh: collections.OrderedDict[str, collections.deque[T]] = collections.OrderedDict()
        # Keys served since their items arrived, least recently served first.
        self._served: collections.OrderedDict[str, collections.deque[T]] = collections.OrderedDict()
        self._size = 0

    def __len__(self) -> int:  # a plain read: safe from another thread
        return self._size

    def __iter__(self) -> Iterator[T]:
        for fifo in [*self._fresh.values(), *self._served.values()]:
            yield from fifo

    def append(self, item: T) -> None:
        key = self._key(item)
        fifo = self._fresh.get(key)
        if fifo is None:
            fifo = self._served.get(key)
        if fifo is None:
            fifo = self._fresh[key] = collections.deque()
        fifo.append(item)
        self._size += 1

    def peek(self) -> T | None:
        """The item `take(1)` would return, left in place."""
        fifos = self._fresh or self._served
        return next(iter(fifos.values()))[0] if fifos else None

    def take(self, limit: int) -> list[T]:
        """Up to `limit` items, one per key in turn, each key's oldest first."""
        out: list[T] = []
        while len(out) < limit and (self._fresh or self._served):
            key, fifo = (self._fresh or self._served).popitem(last=False)
            out.append(fifo.popleft())
            self._size -= 1
            if fifo:
                self._served[key] = fifo  # to the back: the others go first next time
        return out

    def remove(self, drop: Callable[[T], bool]) -> list[T]:
        """Take out every item `drop` names; the rest keep their order and turns."""
        dropped: list[T] = []
        for fifos in (self._fresh, self._served):
            for key in list(fifos):
                kept: collections.deque[T] = collections.deque()
                for item in fifos[key]:
                    (dropped if drop(item) else kept).append(item)
                if kept:
                    fifos[key] = kept
                else:
                    del fifos[key]
        self._size -= len(dropped)
        return dropped
