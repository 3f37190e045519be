"""The custom losses sessions created: per tenant, by loss id, bounded.

A session holds at most `MAX_PER_SESSION` losses, the server at most `MAX_LOSSES` (the least
recently used go first; a forward_backward naming an evicted loss gets a 404 and the client
creates it again).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from tuneloop.server.api.errors import ApiError
from tuneloop.server.engine.custom_loss_graph import CustomLoss

__all__ = ["MAX_LOSSES", "MAX_PER_SESSION", "CustomLossStore"]

MAX_PER_SESSION = 64
MAX_LOSSES = 4096


class CustomLossStore:
    def __init__(self, max_losses: int = MAX_LOSSES) -> None:
        self._max = max_losses
        self._lock = threading.Lock()
        # (tenant, loss_id) -> (body fingerprint, session_id, loss)
        self._losses: OrderedDict[tuple[str, str], tuple[str, str, CustomLoss]] = OrderedDict()

    def add(
        self, tenant: str, session_id: str, loss_id: str, digest: str, loss: CustomLoss
    ) -> None:
        with self._lock:
            key = (tenant, loss_id)
            existing = self._losses.get(key)
            if existing is not None and existing[0] != digest:
                raise ApiError(
                    409,
                    f"custom_loss_seq_id: {loss_id!r} already holds another loss",
                    "custom_loss_seq_id",
                )
            if existing is None:
                in_session = sum(
                    1 for t, s in self._session_keys() if (t, s) == (tenant, session_id)
                )
                if in_session >= MAX_PER_SESSION:
                    raise ApiError(
                        429,
                        f"session {session_id!r} already holds {MAX_PER_SESSION} custom losses",
                        "session_id",
                    )
            self._losses[key] = (digest, session_id, loss)
            self._losses.move_to_end(key)
            while len(self._losses) > self._max:
                self._losses.popitem(last=False)

    def _session_keys(self) -> list[tuple[str, str]]:
        return [(tenant, entry[1]) for (tenant, _), entry in self._losses.items()]

    def get(self, tenant: str, loss_id: str) -> tuple[str, CustomLoss] | None:
        """(session_id, loss) of the tenant's loss, or None."""
        with self._lock:
            entry = self._losses.get((tenant, loss_id))
            if entry is None:
                return None
            self._losses.move_to_end((tenant, loss_id))
            return entry[1], entry[2]
