"""Bodies over the off-loop threshold are decoded, checked and hashed on a worker thread: the
answers are those of the same work sent in small bodies (speed: bench/event_loop.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.unit.server.harness import datum, decode_output, serve
from tuneloop.server.api.deps import OFF_LOOP_BYTES
from tuneloop.types.codec import ForwardBackwardRequest, encode_forward_backward_request


async def test_a_large_forward_body_answers_as_small_ones_do(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    data = [datum(rng.integers(0, 259, 1500).tolist()) for _ in range(24)]
    body = encode_forward_backward_request(
        ForwardBackwardRequest("m", 1, data, "cross_entropy", {}, True)
    )
    assert len(body) > OFF_LOOP_BYTES
    async with serve(tmp_path) as api:
        model_id = await api.model(await api.session())
        submitted = await api.forward_backward(model_id, 1, data, forward_only=True)
        whole = await api.result(submitted)
        assert whole.status_code == 200, whole.text
        together = decode_output(whole.content).loss_fn_outputs
        assert len(together) == len(data)
        for i, one in enumerate(data):
            small = await api.forward_backward(model_id, 2 + i, [one], forward_only=True)
            alone = decode_output((await api.result(small)).content).loss_fn_outputs[0]
            np.testing.assert_allclose(
                together[i]["logprobs"].to_numpy(), alone["logprobs"].to_numpy(), rtol=1e-6
            )
        # A retry of the large body (hashed off the loop too) maps to the first request.
        again = await api.forward_backward(model_id, 1, data, forward_only=True)
        assert again.json()["request_id"] == submitted.json()["request_id"]
