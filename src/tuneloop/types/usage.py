"""Usage metering and checkpoint TTL wire types."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from tuneloop.types._base import ResponseBase, StrictBase
from tuneloop.types.fields import Int64


class UsageCounts(ResponseBase):
    """Tokens by class and requests.

    prefill: prompt tokens of sample requests (once per request) and input tokens of
    forward-only requests; sampled: tokens generated over every returned sequence; trained:
    input tokens of forward_backward datums.
    """

    prefill_tokens: int = 0
    sampled_tokens: int = 0
    trained_tokens: int = 0
    requests: int = 0


class UsageBucket(ResponseBase):
    """One hour or day (UTC) starting at `start`."""

    start: datetime
    totals: UsageCounts
    by_operation: dict[str, UsageCounts] = Field(default_factory=dict)


class UsageResponse(ResponseBase):
    """Usage metered for a tenant, optionally of one session or training run (or sampler),
    over [since, until) at hour resolution.

    `by_operation` is keyed by "forward_backward", "forward" and "sample" (a map, so a server
    may add operations without breaking older clients). `buckets` is empty when `bucket` is
    "none", else one entry per hour or day that has usage, oldest first.
    """

    tenant: str
    session_id: str | None = None
    training_run_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    bucket: str = "none"
    totals: UsageCounts
    by_operation: dict[str, UsageCounts] = Field(default_factory=dict)
    buckets: list[UsageBucket] = Field(default_factory=list)


class SetCheckpointTtlRequest(StrictBase):
    """`PUT .../checkpoints/{checkpoint_id}/ttl`: expire `ttl_seconds` from now; None = never."""

    ttl_seconds: Int64 | None
