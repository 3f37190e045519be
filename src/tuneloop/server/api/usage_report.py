"""Usage reports: times given as ISO or relative ("24h"), and registry sums turned into totals,
per-operation counts and hour or day buckets. Shared by the REST route and `tuneloop usage`."""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from tuneloop.server.api.metering import HOUR_S, OPERATIONS, epoch, hour_of
from tuneloop.server.storage.registry import UsageSum
from tuneloop.types import UsageBucket, UsageCounts, UsageResponse

BUCKETS = ("none", "hour", "day")
_RELATIVE = re.compile(r"^(\d+)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_time(value: str, now: datetime) -> datetime:
    """An ISO 8601 time (UTC if it names no zone) or a span back from `now` like 30m, 24h, 7d.

    ValueError with a message that says which forms are accepted.
    """
    match = _RELATIVE.match(value.strip())
    if match:
        try:
            return now - timedelta(seconds=int(match.group(1)) * _UNIT_S[match.group(2)])
        except OverflowError:  # past what datetime holds (year 1)
            raise ValueError(f"{value!r} reaches back before the year 1") from None
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(
            f"{value!r} is neither an ISO time (2025-01-31T12:00:00Z) nor a span like 24h, 7d"
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def hour_range(since: datetime | None, until: datetime | None) -> tuple[int | None, int | None]:
    """Hour keys covering [since, until): an hour counts if any of it lies in the range, since
    usage is kept per hour."""
    since_hour = hour_of(since) if since is not None else None
    until_hour = None
    if until is not None:
        until_hour = hour_of(until)
        if until_hour < int(until.timestamp()):
            until_hour += HOUR_S
    return since_hour, until_hour


def _counts(values: list[int]) -> UsageCounts:
    return UsageCounts(
        prefill_tokens=values[0], sampled_tokens=values[1], trained_tokens=values[2],
        requests=values[3],
    )  # fmt: skip


def _summed(by_operation: dict[str, list[int]]) -> tuple[UsageCounts, dict[str, UsageCounts]]:
    total = [sum(v[i] for v in by_operation.values()) for i in range(4)]
    ops = {op: _counts(by_operation.get(op, [0, 0, 0, 0])) for op in OPERATIONS}
    ops |= {op: _counts(v) for op, v in by_operation.items() if op not in ops}
    return _counts(total), ops


def bucket_start(hour: int, bucket: str) -> int:
    return hour - hour % 86400 if bucket == "day" else hour


def build_report(
    sums: Iterable[UsageSum],
    tenant: str,
    *,
    bucket: str = "none",
    session_id: str | None = None,
    training_run_id: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> UsageResponse:
    """One tenant's report from its sums (rows of other tenants are ignored)."""
    overall: dict[str, list[int]] = {}
    per_bucket: dict[int, dict[str, list[int]]] = {}
    for s in sums:
        if s.tenant != tenant:
            continue
        values = (s.prefill_tokens, s.sampled_tokens, s.trained_tokens, s.requests)
        targets = [overall]
        if bucket != "none":
            targets.append(per_bucket.setdefault(bucket_start(s.hour, bucket), {}))
        for target in targets:
            row = target.setdefault(s.operation, [0, 0, 0, 0])
            for i, v in enumerate(values):
                row[i] += v
    totals, by_operation = _summed(overall)
    buckets = []
    for start in sorted(per_bucket):
        bucket_totals, bucket_ops = _summed(per_bucket[start])
        buckets.append(
            UsageBucket(start=epoch(start), totals=bucket_totals, by_operation=bucket_ops)
        )
    return UsageResponse(
        tenant=tenant,
        session_id=session_id,
        training_run_id=training_run_id,
        since=since,
        until=until,
        bucket=bucket,
        totals=totals,
        by_operation=by_operation,
        buckets=buckets,
    )
