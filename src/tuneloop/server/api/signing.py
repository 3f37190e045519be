"""Signed, expiring download URLs: an HMAC-SHA256 over exactly what one URL may fetch.

A signature covers (tenant, tinker path, file relative to the checkpoint, expiry), so a URL is
worth one file of one tenant's checkpoint until its expiry, and changing any part of it (another
file, checkpoint, run, a later expiry) makes the signature wrong. The key is a random secret in
the data dir, created 0600 on first use and kept across restarts (and shared by every server on
that data dir), so URLs stay valid through a restart; deleting the file revokes every URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SECRET_FILE = "url_signing.key"
# How long a download URL works. The official SDK re-signs 5 minutes before the expiry, so an
# hour lets it fetch several GB between signings.
DEFAULT_URL_TTL_S = 3600
_SECRET_BYTES = 32
_PURPOSE = "tuneloop-download-v1"  # a signature made for anything else never verifies here


class SignatureError(Exception):
    """The signature does not match what the URL asks for (tampered, or made with another key)."""


class ExpiredError(Exception):
    """A genuine signature whose expiry has passed."""


@dataclass(frozen=True)
class Grant:
    """What a signed URL lets its holder fetch: one file of one tenant's checkpoint, until
    `expires` (Unix seconds)."""

    tenant: str
    tinker_path: str
    file: str  # relative to the checkpoint folder, "/"-separated
    expires: int

    def message(self) -> bytes:
        # JSON of a list: no choice of fields can make two grants encode alike.
        fields = [_PURPOSE, self.tenant, self.tinker_path, self.file, self.expires]
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=True).encode()


def load_or_create_secret(path: Path) -> bytes:
    """The signing key at `path`, made (random, mode 0600) if absent.

    Created under a temporary name and hard-linked into place, so concurrent first uses by
    several servers agree on one key and none ever reads a half-written file.
    """
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_bytes(_SECRET_BYTES).hex())
        with contextlib.suppress(FileExistsError):  # another server made it first: use theirs
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    text = path.read_text().strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < _SECRET_BYTES:
        raise ValueError(
            f"{path} does not hold a URL-signing key ({_SECRET_BYTES * 2} hex digits); "
            "delete it to have a new one made (every download URL given out so far stops working)"
        )
    return secret


class UrlSigner:
    """Signs and checks grants. `clock` (Unix seconds) is replaceable for tests."""

    def __init__(
        self,
        secret: bytes,
        *,
        ttl_s: int = DEFAULT_URL_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._secret = secret
        self.ttl_s = ttl_s
        self.clock = clock

    def expiry(self) -> int:
        """The expiry of a grant made now."""
        return int(self.clock()) + self.ttl_s

    def sign(self, grant: Grant) -> str:
        return hmac.new(self._secret, grant.message(), hashlib.sha256).hexdigest()

    def verify(self, grant: Grant, signature: str) -> None:
        """Raise SignatureError unless `signature` is this key's for `grant`, then
        ExpiredError if it has expired. The comparison takes the same time wherever the two
        differ, so a signature cannot be guessed byte by byte."""
        expected = self.sign(grant).encode()
        if not hmac.compare_digest(expected, signature.encode("utf-8", "replace")):
            raise SignatureError("the signature does not match this URL")
        if self.clock() >= grant.expires:
            raise ExpiredError(f"this URL expired at Unix time {grant.expires}")
