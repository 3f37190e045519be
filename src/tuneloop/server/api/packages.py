"""Model-package rules the API enforces: the TTL range, and the collection of expired packages."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime

from tuneloop.server.api.errors import bad_request
from tuneloop.server.storage.registry import Registry, utcnow

log = logging.getLogger(__name__)

# The range the hosted service accepts (spec 4.10): an hour to ten years; None = no expiry.
TTL_MIN_S = 3600
TTL_MAX_S = 10 * 365 * 86400
# Expiry is in hours at the least, so a minute's lag before the files go costs nothing.
GC_INTERVAL_S = 60.0


def check_ttl(ttl_seconds: int | None, field_name: str = "ttl_seconds") -> None:
    if ttl_seconds is not None and not TTL_MIN_S <= ttl_seconds <= TTL_MAX_S:
        raise bad_request(
            f"{field_name}: must be from {TTL_MIN_S} (an hour) to {TTL_MAX_S} (ten years), "
            "or null for no expiry",
            field_name,
        )


async def run_package_gc(
    registry: Registry,
    interval_s: float = GC_INTERVAL_S,
    clock: Callable[[], datetime] = utcnow,
) -> None:
    """The background task: every `interval_s`, remove expired packages (row, then files)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            removed = await asyncio.to_thread(registry.collect_expired, clock())
        except Exception:  # the database may be busy for a moment: the next round retries
            log.exception("collecting expired checkpoints failed; will retry")
            continue
        for row in removed:
            log.info("checkpoint %s of %s expired and was removed", row.tinker_path, row.tenant)
