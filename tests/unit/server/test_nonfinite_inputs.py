"""Non-finite training state is the user's error, refused where it starts; and one tenant's
poisoned sampler never fails another tenant's sampling (issue: a NaN adapter of tenant B failed
57 of tenant A's 60 concurrent samples)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.unit.server.harness import (
    Api,
    datum,
    expect_error,
    optim_step,
    post_raw,
    sample,
    sample_body,
    sampler,
)
from tuneloop.server.scheduler.futures import Outcome
from tuneloop.types.codec import decode_sample_response

TOKENS = [5, 17, 33, 90, 120, 7, 64, 200]
INF = float("inf")


@pytest.mark.parametrize(
    ("adam", "field"),
    [
        ({"learning_rate": 1e308}, "adam_params.learning_rate"),
        ({"learning_rate": INF}, "adam_params.learning_rate"),
        ({"learning_rate": float("nan")}, "adam_params.learning_rate"),
        ({"learning_rate": 2.0}, "adam_params.learning_rate"),
        ({"beta1": float("nan")}, "adam_params.beta1"),
        ({"eps": 1e-40}, "adam_params.eps"),
        ({"eps": INF}, "adam_params.eps"),
        ({"weight_decay": 5.0}, "adam_params.weight_decay"),
        ({"grad_clip_norm": INF}, "adam_params.grad_clip_norm"),
    ],
)
async def test_out_of_range_adam_params_are_400_naming_the_field(
    api: Api, adam: dict[str, float], field: str
) -> None:
    model_id = await api.model(await api.session())
    await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    # Python's json writes inf / nan as the literals Infinity / NaN, as a careless client would.
    raw = json.dumps({"model_id": model_id, "seq_id": 2, "adam_params": adam}).encode()
    bad = await post_raw(api, "optim_step", raw, {"content-type": "application/json"})
    body = expect_error(bad, 400, field)
    assert body["detail"].startswith(field)
    # The adapter is untouched and trains on; its results are plain JSON.
    step = await optim_step(api, model_id, 3)
    assert "Infinity" not in step.text
    assert "NaN" not in step.text
    assert math.isfinite(step.json()["metrics"]["grad_norm"])


async def test_the_other_optimizer_param_names_are_checked_too(api: Api) -> None:
    model_id = await api.model(await api.session())
    bad = await api.post(
        "optim_step",
        {"model_id": model_id, "seq_id": 1, "optim_params": {"learning_rate": 1e308}},
    )
    expect_error(bad, 400, "optim_params.learning_rate")


def test_json_outcomes_never_hold_non_json_literals() -> None:
    outcome = Outcome.json(
        {"metrics": {"a": INF, "b": -INF, "c": float("nan"), "d": 1.5}, "n": [INF, 2, "x"]}
    )
    text = outcome.body.decode()
    assert "Infinity" not in text
    assert "NaN" not in text
    assert json.loads(text) == {
        "metrics": {"a": None, "b": None, "c": None, "d": 1.5},
        "n": [None, 2, "x"],
    }


def scale_weights(data_dir: Path, name: str, factor: float) -> None:
    """Multiply the fake backend's weights of checkpoint `name` on disk by `factor`."""
    [weights] = [p for p in data_dir.rglob("weights.npz") if p.parent.name == name]
    with np.load(weights) as data:
        arrays = {k: data[k] * factor for k in data.files}
    np.savez(weights, **arrays)


async def _poisoned_sampler(api: Api, data_dir: Path) -> str:
    """A sampler over weights whose logits overflow: the tenant's own saved sampler weights,
    scaled on disk (weights written by an earlier, unchecked version, or bit rot)."""
    session_id = await api.session()
    model_id = await api.model(session_id)
    await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    await optim_step(api, model_id, 2, lr=0.1)
    saved = await api.result(
        await api.post(
            "save_weights_for_sampler", {"model_id": model_id, "path": "poison", "seq_id": 3}
        )
    )
    scale_weights(data_dir, "poison", 1e200)
    return await sampler(api, session_id, seq=0, model_path=saved.json()["path"])


async def test_a_poisoned_sampler_of_one_tenant_never_fails_anothers_samples(
    api: Api, other_tenant: Api, tmp_path: Path
) -> None:
    """Tenant B samples from its poisoned sampler at the same moment as tenant A's 20 samples
    on the base model: every one of A's gets what it gets alone; B's fails as a user error."""
    poisoned = await _poisoned_sampler(other_tenant, tmp_path)
    base = await sampler(api, await api.session())
    prompts = [[(7 * i + j) % 256 for j in range(4)] for i in range(20)]
    alone = [await sample(api, base, p, max_tokens=6, seed=i) for i, p in enumerate(prompts)]

    async def a_sample(i: int) -> Any:
        return await api.post("asample", sample_body(base, prompts[i], max_tokens=6, seed=i))

    sent = await asyncio.gather(
        other_tenant.post("asample", sample_body(poisoned, [1, 2, 3], max_tokens=6, seed=0)),
        *(a_sample(i) for i in range(20)),
    )
    bad = await other_tenant.result(sent[0])
    assert bad.json()["category"] == "user", bad.text
    assert "non-finite" in bad.json()["error"]
    for i, pending in enumerate(sent[1:]):
        done = await api.result(pending)
        got = decode_sample_response(done.content)
        assert [s.tokens for s in got.sequences] == [s.tokens for s in alone[i].sequences]
        assert [s.logprobs for s in got.sequences] == [s.logprobs for s in alone[i].sequences]


async def test_loading_a_nan_checkpoint_is_refused_as_the_users_error(
    api: Api, tmp_path: Path
) -> None:
    """A checkpoint whose files hold a NaN is refused where it would enter the engine; the
    adapter keeps its weights and trains on."""
    model_id = await api.model(await api.session())
    saved = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "nan", "seq_id": 1})
    )
    scale_weights(tmp_path, "nan", np.nan)
    body = {"model_id": model_id, "seq_id": 2, "path": saved.json()["path"]}
    loaded = await api.result(await api.post("load_weights", body))
    assert loaded.json()["category"] == "user", loaded.text
    assert "non-finite weights" in loaded.json()["error"]
    await api.result(await api.forward_backward(model_id, 3, [datum(TOKENS)]))
    step = await optim_step(api, model_id, 4)
    assert math.isfinite(step.json()["metrics"]["grad_norm"])
