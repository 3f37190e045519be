"""JWT exchange (`serve --jwt`): a key is traded for a short-lived token with the claims the
official SDK reads; expired, forged or revoked-key tokens get the 401 that makes the SDK renew."""

from __future__ import annotations

import time
from pathlib import Path

import jwt

from tests.unit.server.harness import expect_error, serve
from tuneloop.server.api.auth_tokens import SECRET_FILE
from tuneloop.server.api.signing import load_or_create_secret

INVALID = 'Bearer error="invalid_token"'


async def test_token_exchange_claims_use_and_revocation(tmp_path: Path) -> None:
    async with serve(tmp_path, jwt=True, jwt_ttl_s=600) as api:
        flags = (await api.post("client/config", {"sdk_version": "0.38.0"})).json()
        assert flags["pjwt_auth_enabled"] is True
        token = (await api.post("auth/token", {})).json()["jwt"]
        claims = jwt.decode(token, options={"verify_signature": False})
        assert claims["sub"] == "tml:user:alice"
        assert claims["org_id"] == "alice"
        assert claims["exp"] - claims["iat"] == 600
        assert abs(claims["iat"] - time.time()) < 5
        as_token = {"x-api-key": token}
        made = await api.http.post("/api/v1/create_session", json={"tags": []}, headers=as_token)
        assert made.status_code == 200, made.text
        # A token is renewed from the key, never from itself.
        again = await api.http.post("/api/v1/auth/token", json={}, headers=as_token)
        assert again.status_code == 401
        # Forged (signed with another secret) or expired: the SDK's renew-and-replay 401.
        forged = jwt.encode({**claims}, b"x" * 32, algorithm="HS256")
        secret = load_or_create_secret(tmp_path / SECRET_FILE)
        expired = jwt.encode(
            {**claims, "iat": claims["iat"] - 900, "exp": int(time.time()) - 1},
            secret,
            algorithm="HS256",
        )
        for bad in (forged, expired):
            response = await api.http.get("/api/v1/sessions", headers={"x-api-key": bad})
            expect_error(response, 401, "X-API-Key")
            assert response.headers["www-authenticate"] == INVALID
        # Revoking the key stops its tokens now, not at their expiry; the key can't renew.
        key_id = claims["kid"]
        assert api.keys.revoke(key_id)
        response = await api.http.get("/api/v1/sessions", headers=as_token)
        expect_error(response, 401, "X-API-Key")
        assert response.headers["www-authenticate"] == INVALID
        expect_error(await api.post("auth/token", {}), 401, "X-API-Key")
        # The revocation stops the audit reads through the token too.
        assert (await api.http.get("/api/v1/audit", headers=as_token)).status_code == 401


async def test_without_the_flag_there_is_no_exchange_and_tokens_are_refused(tmp_path: Path) -> None:
    async with serve(tmp_path) as api:
        flags = (await api.post("client/config", {"sdk_version": "0.38.0"})).json()
        assert flags["pjwt_auth_enabled"] is False
        assert (await api.post("auth/token", {})).status_code == 404
        token = jwt.encode({"sub": "x", "exp": time.time() + 60}, b"k" * 32, algorithm="HS256")
        response = await api.http.get("/api/v1/sessions", headers={"x-api-key": token})
        expect_error(response, 401, "X-API-Key")


async def test_key_use_token_issue_and_quota_refusals_are_audited(tmp_path: Path) -> None:
    async with serve(tmp_path, jwt=True, max_sessions=1) as api:
        await api.post("auth/token", {})
        await api.session()
        for _ in range(3):  # refused three times, written once (REPEAT_S)
            assert (await api.post("create_session", {"tags": []})).status_code == 429
        entries = (await api.get("audit", params={"event_type": "organizations"})).json()["entries"]
        events = [e["event"] for e in entries]
        assert events.count("key_used") == 1
        assert events.count("key_token_issued") == 1
        assert events.count("quota_refused") == 1
        refused = next(e for e in entries if e["event"] == "quota_refused")
        assert refused["event_details"]["limit"] == "max_sessions"
        yesterday = time.strftime("%Y-%m-%d", time.gmtime(time.time() - 86400))
        old = await api.get("audit", params={"day": yesterday})
        assert old.json()["entries"] == []
        expect_error(await api.get("audit", params={"event_type": "nope"}), 400, "event_type")
