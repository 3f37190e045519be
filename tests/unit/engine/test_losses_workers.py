"""stable_reinforce and a server-side custom loss run inside each rank of a 2-rank worker group
and give the single-process results: loss sums, custom metrics (a ":mean" over datums split
unevenly between the ranks is weighted by each rank's datum count), gradients and weights.
Tolerances as in test_workers_group (float32 sums in another order)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tinker")

from tests.unit.engine.conftest import (  # noqa: E402
    TINY,
    adam,
    adapter_spec,
    assert_near,
    example,
    ok,
    seq,
    work,
)
from tests.unit.engine.test_custom_loss import dpo_inputs, dpo_loss  # noqa: E402
from tuneloop.server.engine.checkpoints import read_factors  # noqa: E402
from tuneloop.server.engine.types import ForwardBackwardWork  # noqa: E402

TOL = 1e-5
WEIGHT_TOL = 1e-4


def _custom_work(adapter: str) -> Any:
    examples = []
    for i, n in enumerate([21, 6, 9]):
        tokens = seq(n + 1, 60 + i)
        _, inputs = dpo_inputs(i, n)
        examples.append(
            example(tokens, inputs["weights"], **{k: inputs[k] for k in ("ref_logprobs", "sign")})
        )
    return ForwardBackwardWork(
        adapter, tuple(examples), "custom", {}, False, custom_loss=dpo_loss()
    )


def _stable_work(adapter: str) -> Any:
    rng = np.random.default_rng(4)
    examples = []
    for i, n in enumerate([17, 8, 12]):
        mask = (np.arange(n) >= 4).astype(np.float32)
        inputs = {
            "advantages": rng.normal(size=n).astype(np.float32),
            "recorded_logprobs": rng.normal(-5.5, 0.5, size=n).astype(np.float32),
            "sampled_mask": mask,
        }
        ex = example(seq(n + 1, 80 + i), **inputs)
        del ex.inputs["weights"]
        examples.append(ex)
    return work(adapter, examples, loss_fn="stable_reinforce", config={"kl_coeff": 0.1})


def _run(be: Any, prefix: str, out: Path) -> dict[str, Any]:
    adapters = (f"{prefix}custom", f"{prefix}stable")
    for adapter in adapters:
        be.create_adapter(adapter_spec(adapter, rank=4, seed=2))
    results = [
        ok(r) for r in be.forward_backward([_custom_work(adapters[0]), _stable_work(adapters[1])])
    ]
    norms = [be.optim_step(a, adam(1e-2))["grad_norm"] for a in adapters]
    weights = {}
    for adapter in adapters:
        be.save_state(adapter, out / adapter, optimizer=False)
        weights[adapter] = read_factors(out / adapter)
    return {
        "metrics": [r.metrics for r in results],
        "norms": norms,
        "weights": list(weights.values()),
    }


def test_losses_in_a_worker_group_equal_single_process(group: Any, tmp_path: Path) -> None:
    from tuneloop.server.engine.torch_backend import TorchBackend

    single = TorchBackend([TINY], cache_dir=tmp_path / "cache", device="cpu")
    try:
        want = _run(single, "s-", tmp_path / "single")
    finally:
        single.close()
    got = _run(group, "g-", tmp_path / "group")
    assert set(got["metrics"][0]) == set(want["metrics"][0]) >= {"custom/reward:mean"}
    for g_metrics, w_metrics in zip(got["metrics"], want["metrics"], strict=True):
        for key in w_metrics:
            assert_near(g_metrics[key], w_metrics[key], TOL, key, relative=True)
    assert min(want["norms"]) > 0
    assert_near(got["norms"], want["norms"], TOL, "grad norms", relative=True)
    for g_weights, w_weights in zip(got["weights"], want["weights"], strict=True):
        assert_near(g_weights, w_weights, WEIGHT_TOL, "weights")
