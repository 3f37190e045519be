"""What a restart of the server loses, and the 410 answers that say so.

Sessions, training runs, checkpoints, samplers' records and usage are in the registry and survive
a restart, even a SIGKILL. Three things live only in the server process and die with it: the
results of requests still in flight, the adapters of training runs (weights and optimizer state
since the last checkpoint) and the samplers. A request that needs one of them is answered 410
with `reason: "server_restarted"` and a remedy, at once, instead of a 404 or a wait that never
ends: the client resubmits the request, or loads its last checkpoint into a new training run.
"""

from __future__ import annotations

from datetime import datetime

from tuneloop.server.api.errors import ApiError

REASON = {"reason": "server_restarted"}
LOAD = (
    "its weights and optimizer state since the last checkpoint are gone: load that checkpoint "
    "into a new training run (create_training_client_from_state_with_optimizer)"
)


def request_lost(request_id: str) -> ApiError:
    """A poll for a request an earlier run of the server accepted and never answered."""
    return ApiError(
        410,
        f"request {request_id!r} was accepted before the server restarted and its result was "
        "lost; submit the request again",
        "request_id",
        extra=REASON,
    )


def require_held(
    created_at: datetime, started_at: datetime, what: str, field: str, remedy: str
) -> None:
    """410 if `what` was created before this run of the server started (its state was lost).

    Adapters and samplers are registered after the engine created them, so a record older than
    the server's start belongs to an earlier process. This compares wall-clock times: a clock set
    back by more than the restart took would hide a loss (the backend then answers "no adapter").
    """
    if created_at < started_at:
        raise ApiError(
            410,
            f"{what} was lost when the server restarted; {remedy}",
            field,
            extra=REASON,
        )
