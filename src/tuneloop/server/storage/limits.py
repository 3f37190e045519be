"""Per-tenant quota overrides: a small JSON file beside keys.json, set by the operator.

`tuneloop keys limits TENANT --max-sessions N --max-inflight M` writes it; a running server
re-reads it when it changes, so a new limit applies from the next request on, with no restart.
A tenant without an entry (or an entry without a value) gets the server's defaults.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)
LIMIT_NAMES = ("max_sessions", "max_inflight")


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's overrides; None keeps the server default, 0 means unlimited."""

    max_sessions: int | None = None
    max_inflight: int | None = None

    def __post_init__(self) -> None:
        for name in LIMIT_NAMES:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 (0: unlimited), got {value!r}")


class LimitStore:
    """The overrides file. Reads are cached until the file changes (inode, mtime or size)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._cached: dict[str, TenantLimits] = {}

    def _read(self) -> dict[str, TenantLimits]:
        if not self.path.exists():
            return {}
        rows = json.loads(self.path.read_text())["tenants"]
        return {tenant: TenantLimits(**values) for tenant, values in rows.items()}

    def _write(self, limits: dict[str, TenantLimits]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".limits.")
        with os.fdopen(fd, "w") as f:
            json.dump({"tenants": {t: asdict(v) for t, v in sorted(limits.items())}}, f, indent=1)
        os.replace(tmp, self.path)  # atomic: a server reading it sees the old or the new file

    def all(self) -> dict[str, TenantLimits]:
        """Every tenant's overrides (what the file holds now)."""
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return {}
        # The inode changes with every write (os.replace): caught even within one mtime tick.
        stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
        with self._lock:
            if stamp != self._stamp:
                try:
                    self._cached = self._read()
                except (ValueError, KeyError, TypeError, AttributeError):
                    # A hand edit gone wrong must not fail every request: keep the last good
                    # overrides, and say so once per change of the file.
                    log.exception("ignoring unreadable quota overrides in %s", self.path)
                self._stamp = stamp
            return dict(self._cached)

    def get(self, tenant: str) -> TenantLimits:
        return self.all().get(tenant, TenantLimits())

    def set(self, tenant: str, **values: int | None) -> TenantLimits:
        """Set some of a tenant's overrides (a None value goes back to the server default)."""
        unknown = set(values) - set(LIMIT_NAMES)
        if unknown:
            raise ValueError(f"unknown limits: {sorted(unknown)} (known: {list(LIMIT_NAMES)})")
        with self._lock:
            limits = self._read()
            updated = TenantLimits(**{**asdict(limits.get(tenant, TenantLimits())), **values})
            if updated == TenantLimits():
                limits.pop(tenant, None)
            else:
                limits[tenant] = updated
            self._write(limits)
        return updated

    def reset(self, tenant: str) -> bool:
        """Drop all of a tenant's overrides; False if it had none."""
        with self._lock:
            limits = self._read()
            found = limits.pop(tenant, None) is not None
            if found:
                self._write(limits)
        return found
