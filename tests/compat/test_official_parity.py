"""Every public method of the official SDK's ServiceClient, TrainingClient, SamplingClient,
RestClient and AdminClient (sync and async, found by introspection) works against a real
`tuneloop serve`: none may answer 404/405/501 or fail otherwise. A method a new SDK release adds
fails here until official_parity.py has a recipe for it and the server serves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.compat.runner import run_official
from tuneloop._local_server import create_key, live_server
from tuneloop.hf_cache import install_tokenizer

pytest.importorskip("tinker")
pytestmark = [pytest.mark.compat, pytest.mark.integration]

MODEL = "tuneloop/fake-tiny"
MISSING_ROUTE = (404, 405, 501)
# Calls that fail today on purpose, each with why. The test also checks each still fails, so
# whoever makes one work must remove it here (and from docs/rest.md).
# Methods that are known not to work yet, with why; the test also checks they still fail, so
# one that starts working must leave this table. None today.
EXPECTED_GAPS: dict[str, str] = {}


def test_every_official_sdk_method_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --jwt: RestClient.whoami reads the claims of the exchanged token. --tokenizer-id name:
    # set up as for a client on another machine, both get_tokenizer()s load by model name.
    extra = ("--jwt", "--tokenizer-id", "name")
    with live_server(tmp_path / "server", *extra, backend="fake", models=(MODEL,)) as live:
        # get_tokenizer() loads by model name from the HF cache: put the server's tokenizer
        # there first (docs/rest.md), then the SDK needs no hub.
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        install_tokenizer(MODEL, base_url=live.url, api_key=live.key)
        other_key = create_key(live.data_dir, "bob")  # reads alice's published checkpoints
        done = run_official("official_parity", live.url, live.key, MODEL, other_key, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = [
        json.loads(line.removeprefix("PARITY "))
        for line in done.stdout.splitlines()
        if line.startswith("PARITY ")
    ]
    by_method = {r["method"]: r for r in reports}
    assert len(by_method) > 100, sorted(by_method)  # the walk found the SDK's methods
    assert sum(m.startswith("other tenant:") for m in by_method) == 3
    missing = [r for r in reports if r.get("status") in MISSING_ROUTE]
    failed = [r for r in reports if r["outcome"] != "ok" and r["method"] not in EXPECTED_GAPS]
    still_gaps = {m for m in EXPECTED_GAPS if by_method.get(m, {}).get("outcome") == "error"}
    assert not missing or all(r["method"] in EXPECTED_GAPS for r in missing), missing
    assert failed == [], json.dumps(failed, indent=1)[:8000]
    # whoami decodes the token the SDK got from the exchange: it used JWTs throughout.
    assert "tml:user:alice" in by_method["RestClient.whoami"]["value"]
    assert still_gaps == set(EXPECTED_GAPS), (
        f"now working, remove from EXPECTED_GAPS: {set(EXPECTED_GAPS) - still_gaps}"
    )


def test_the_official_sdk_exchanges_renews_and_loses_its_token(tmp_path: Path) -> None:
    with live_server(tmp_path, "--jwt", backend="fake", models=(MODEL,)) as live:
        done = run_official("official_jwt", live.url, live.key, MODEL, str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "official SDK JWT flow: OK" in done.stdout
