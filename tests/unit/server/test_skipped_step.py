"""An optim_step the engine skips (its gradients or update would be non-finite) changes
nothing, so the run's training step, which checkpoints record, does not advance either."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.unit.server.harness import Api, datum, optim_step
from tuneloop.server.engine.fake import FakeBackend
from tuneloop.server.engine.isolation import SKIPPED


async def test_a_skipped_optim_step_does_not_count_as_a_training_step(
    api: Api, server: tuple[Any, Any]
) -> None:
    backend = server[0].state.tuneloop.engine.backend
    assert isinstance(backend, FakeBackend)
    model_id = await api.model(await api.session())
    await api.result(await api.forward_backward(model_id, 1, [datum([1, 2, 3])]))
    assert SKIPPED not in (await optim_step(api, model_id, 2)).json()["metrics"]

    # The accumulated gradients overflowed (what no route can do to the float64 fake, so it is
    # done to its adapter here, between requests): the engine skips the step and says so.
    await api.result(await api.forward_backward(model_id, 3, [datum([1, 2, 3])]))
    backend._adapters[model_id].grad_a[0, 0] = np.inf
    metrics = (await optim_step(api, model_id, 4)).json()["metrics"]
    assert metrics[SKIPPED] == 1.0
    assert metrics[SKIPPED + "_nonfinite_gradients"] == 1.0

    await api.result(await api.forward_backward(model_id, 5, [datum([1, 2, 3])]))
    assert SKIPPED not in (await optim_step(api, model_id, 6)).json()["metrics"]
    body = {"model_id": model_id, "path": "after", "seq_id": 7}
    saved = (await api.result(await api.post("save_weights", body))).json()["path"]
    listed = (await api.get(f"training_runs/{model_id}/checkpoints")).json()["checkpoints"]
    [package] = [c for c in listed if c["tinker_path"] == saved]
    assert package["training_step"] == 2  # the two steps applied, not the skipped one
    assert backend._adapters[model_id].step == 2  # as the engine counts them
