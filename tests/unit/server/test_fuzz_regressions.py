"""Requests the fuzz (tests/fuzz) found answered with a 5xx, each pinned as a 400 naming its
field."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.server.harness import MODEL, PROTO, Api, expect_error, post_raw
from tuneloop.types import proto


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


def _sparse_targets(model_id: str, crow: list[int], cols: list[int], shape: list[int]) -> bytes:
    message = proto.ForwardBackwardRequestProto(
        model_id=model_id, seq_id=1, loss_fn="cross_entropy"
    )
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([5, 6, 7], "<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype = proto.DTYPE_INT64
    targets.shape.extend(shape)
    targets.sparse_csr.values = np.ones(len(cols), "<i8").tobytes()
    targets.sparse_csr.crow_indices = np.asarray(crow, "<i8").tobytes()
    targets.sparse_csr.col_indices = np.asarray(cols, "<i8").tobytes()
    return bytes(message.SerializeToString())


@pytest.mark.parametrize(
    ("crow", "cols", "shape", "says"),
    [
        ([0, 0, 0, 1], [99], [3, 5], "sparse_col_indices"),  # was an IndexError
        ([0, 0, 0, 1], [-7], [3, 5], "sparse_col_indices"),  # was an IndexError
        ([0, 0, 0, 1], [1], [3, -5], "negative dimension"),  # was a ValueError
        ([0, 0, 0, 1], [1], [3, 2**40], "columns"),  # was a 24 TiB allocation
        ([0, 5, 0, 1], [1], [3, 5], "sparse_crow_indices"),  # was accepted, rows garbled
    ],
)
async def test_hostile_sparse_targets_are_400(
    api: Api, crow: list[int], cols: list[int], shape: list[int], says: str
) -> None:
    model_id = await api.model(await api.session())
    body = _sparse_targets(model_id, crow, cols, shape)
    response = await post_raw(api, "forward_backward", body, PROTO)
    assert response.status_code == 400, response.text
    assert says in response.json()["detail"]
    assert response.json()["field"].startswith("data[0].loss_fn_inputs")
