"""API keys: `tml-` prefixed (the official SDK insists), stored hashed, each bound to a tenant."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
import threading
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

KEY_PREFIX = "tml-"


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    tenant: str
    key_sha256: str
    created_at: str
    revoked: bool = False
    # An operator's key: its console also shows every tenant and the engine (read-only).
    admin: bool = False


class KeyStore:
    """A JSON file of hashed keys. Re-read when it changes, so `tuneloop keys` acts at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._mtime: float | None = None
        self._by_hash: dict[str, KeyRecord] = {}

    def _load(self) -> list[KeyRecord]:
        if not self.path.exists():
            return []
        return [KeyRecord(**row) for row in json.loads(self.path.read_text())["keys"]]

    def _save(self, records: list[KeyRecord]) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".keys.")
        with os.fdopen(fd, "w") as f:
            json.dump({"keys": [asdict(r) for r in records]}, f, indent=1)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)

    def create(self, tenant: str, *, admin: bool = False) -> tuple[str, KeyRecord]:
        if not tenant or not tenant.replace("-", "").replace("_", "").isalnum():
            raise ValueError("tenant must be letters, digits, '-' or '_'")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        record = KeyRecord(
            key_id=f"key-{secrets.token_hex(4)}",
            tenant=tenant,
            key_sha256=_hash(key),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            admin=admin,
        )
        with self._lock:
            self._save([*self._load(), record])
        return key, record

    def list(self) -> list[KeyRecord]:
        return self._load()

    def revoke(self, key_id: str) -> bool:
        with self._lock:
            records = self._load()
            found = any(r.key_id == key_id for r in records)
            self._save(
                [
                    KeyRecord(**{**asdict(r), "revoked": True}) if r.key_id == key_id else r
                    for r in records
                ]
            )
        return found

    def tenant_of(self, key: str) -> str | None:
        """The tenant a valid, unrevoked key belongs to; None otherwise."""
        return self.tenant_of_hash(key_hash(key))

    def tenant_of_hash(self, digest: str) -> str | None:
        """As `tenant_of`, for a key known by its `key_hash`."""
        record = self.record_of_hash(digest)
        return record.tenant if record is not None else None

    def _fresh(self) -> dict[str, KeyRecord] | None:
        """Records by hash, re-read if the file changed; None if there is no file."""
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        with self._lock:
            if mtime != self._mtime:
                self._by_hash = {r.key_sha256: r for r in self._load()}
                self._mtime = mtime
            return self._by_hash

    def record_of(self, key: str) -> KeyRecord | None:
        """The record of a valid, unrevoked key; None otherwise."""
        return self.record_of_hash(key_hash(key))

    def record_of_hash(self, digest: str) -> KeyRecord | None:
        """As `record_of`, for a key known by its `key_hash`."""
        records = self._fresh()
        record = records.get(digest) if records is not None else None
        return record if record is not None and not record.revoked else None

    def active(self, key_id: str) -> KeyRecord | None:
        """The record of key `key_id` unless it was revoked (tokens issued for it stop)."""
        records = self._fresh() or {}
        found = next((r for r in records.values() if r.key_id == key_id), None)
        return found if found is not None and not found.revoked else None


def key_hash(key: str) -> str:
    """How a key is stored and told apart: its SHA-256 (the key itself is kept nowhere)."""
    return _hash(key)
