"""JWT exchange (`tuneloop serve --jwt`): an API key is traded for a short-lived HS256 token.

The claims are those the official SDK reads: `exp` and `iat` (it renews at half the lifetime),
`sub` and `org_id` (RestClient.whoami), `email` (empty: tenants have none). `kid` names the key
the token was issued for: every request checks that key is still unrevoked, so revoking a key
(`tuneloop keys revoke`) stops its tokens at once, not at their expiry. The signing secret is a
random file in the data dir (0600), like the URL-signing key; deleting it voids every token.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jwt

from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.signing import load_or_create_secret
from tuneloop.server.storage.keys import KeyRecord, KeyStore

__all__ = ["ISSUER", "SECRET_FILE", "TokenIssuer", "looks_like_jwt"]

SECRET_FILE = "jwt_signing.key"
ISSUER = "tuneloop"
_ALGORITHM = "HS256"
# What the official SDK answers to, on a 401: renew the token and replay the request once.
INVALID_TOKEN = {"WWW-Authenticate": 'Bearer error="invalid_token"'}


def looks_like_jwt(credential: str) -> bool:
    return credential.startswith("eyJ") and credential.count(".") == 2


class TokenIssuer:
    """Issues and checks tokens with the secret in `path`, re-read when the file changes:
    deleting it (a new one is made on the next issue) voids every token at once, and the
    official SDK, told so by the 401, exchanges its key for a new one by itself."""

    def __init__(self, path: Path, ttl_s: int) -> None:
        self.path = path
        self.ttl_s = ttl_s
        self._stamp: tuple[int, int] | None = None
        self._secret = b""

    @classmethod
    def for_data_dir(cls, data_dir: Path, ttl_s: int) -> TokenIssuer:
        return cls(data_dir / SECRET_FILE, ttl_s)

    @property
    def secret(self) -> bytes:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            stat = None
        if stat is None or (stat.st_ino, stat.st_mtime_ns) != self._stamp:
            self._secret = load_or_create_secret(self.path)
            stat = self.path.stat()
            self._stamp = (stat.st_ino, stat.st_mtime_ns)
        return self._secret

    def issue(self, record: KeyRecord) -> str:
        now = int(time.time())
        claims = {
            "iss": ISSUER,
            "sub": f"tml:user:{record.tenant}",
            "org_id": record.tenant,
            "email": "",
            "kid": record.key_id,
            "iat": now,
            "exp": now + self.ttl_s,
        }
        return jwt.encode(claims, self.secret, algorithm=_ALGORITHM)

    def verify(self, token: str, keys: KeyStore) -> KeyRecord:
        """The (unrevoked) key record a genuine, unexpired token was issued for; else a 401 the
        SDK answers by renewing its token."""
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                self.secret,
                algorithms=[_ALGORITHM],
                issuer=ISSUER,
                options={"require": ["exp", "iat", "kid", "org_id"]},
            )
        except jwt.ExpiredSignatureError:
            raise ApiError(
                401, "token expired: exchange the API key again", "X-API-Key", headers=INVALID_TOKEN
            ) from None
        except jwt.InvalidTokenError as exc:
            raise ApiError(
                401, f"invalid token: {exc}", "X-API-Key", headers=INVALID_TOKEN
            ) from None
        record = keys.active(str(claims["kid"]))
        if record is None or record.tenant != claims["org_id"]:
            raise ApiError(
                401,
                "the key this token was issued for is revoked",
                "X-API-Key",
                headers=INVALID_TOKEN,
            )
        return record
