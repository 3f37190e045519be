"""The official SDK against `tuneloop serve --jwt`: `python -m tests.compat.official_jwt URL KEY
MODEL DATA_DIR`. It trades its key for a token by itself, renews it when the server voids it
(the signing secret deleted), and stops once the key is revoked."""

from __future__ import annotations

import sys
from pathlib import Path

import tinker

from tuneloop.server.api.auth_tokens import SECRET_FILE
from tuneloop.server.storage.keys import KeyStore


def run(url: str, key: str, model: str, data_dir: Path) -> None:
    service = tinker.ServiceClient(base_url=url, api_key=key)
    rest = tinker.RestClient(base_url=url, api_key=key)
    who = rest.whoami().result()
    assert who.user_urn == "tml:user:alice", who
    assert who.org_urn == "tml:organization:alice", who
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    auth = service.holder._default_auth
    first = auth._token
    assert first.startswith("eyJ"), "the SDK sends a token, not the key"

    # Every token is void now: the next request gets the 401 that makes the SDK renew.
    (data_dir / SECRET_FILE).unlink()
    path = training.save_state("after-rotation").result(timeout=120).path
    assert path.endswith("/weights/after-rotation")
    assert auth._token != first, "the SDK exchanged its key for a new token"

    # Revoked: the token stops at once and renewing with the key fails.
    keys = KeyStore(data_dir / "keys.json")
    for record in keys.list():
        keys.revoke(record.key_id)
    try:
        rest.list_training_runs().result(timeout=120)
    except tinker.AuthenticationError:
        pass
    else:
        raise AssertionError("a revoked key's token still works")
    print("official SDK JWT flow: OK", flush=True)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]))
