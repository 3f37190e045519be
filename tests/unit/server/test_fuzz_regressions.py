"""Requests the fuzz (tests/fuzz) found answered with a 5xx, each pinned as a 400 naming its
field."""

from __future__ import annotations

import pytest

from tests.unit.server.harness import MODEL, Api, expect_error


@pytest.mark.parametrize("route", ["sessions", "training_runs", "checkpoints"])
@pytest.mark.parametrize("offset", [str(2**63), "9" * 50])
async def test_offset_past_64_bits_is_400(api: Api, route: str, offset: str) -> None:
    # The database driver cannot bind such an integer; it was an OverflowError (500).
    expect_error(await api.get(route, params={"offset": offset}), 400, "offset")
    assert (await api.get(route, params={"offset": str(2**62)})).status_code == 200


@pytest.mark.parametrize("seed", [-1, 2**63, 2**70])
async def test_lora_seed_outside_64_bits_is_400(api: Api, seed: int) -> None:
    # A negative seed failed in the generator, a huge one in the database: both after the
    # request was accepted, as a server error on the future.
    session_id = await api.session()
    body = {
        "session_id": session_id,
        "model_seq_id": 0,
        "base_model": MODEL,
        "lora_config": {"rank": 4, "seed": seed},
    }
    expect_error(await api.post("create_model", body), 400, "lora_config.seed")


@pytest.mark.parametrize("name", ["since", "until"])
async def test_usage_span_past_year_one_is_400(api: Api, name: str) -> None:
    # `now - 9999999999h` is before what a datetime holds: it was an OverflowError (500).
    expect_error(await api.get("usage", params={name: "9999999999h"}), 400, name)
    assert (await api.get("usage", params={name: "24h"})).status_code == 200
