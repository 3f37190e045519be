"""`kto`: the loss against a hand computation, and a run on the tiny model that resumes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.recipes.conftest import TINY
from tuneloop._local_server import LiveServer
from tuneloop.recipes.kto import Feedback, KTOConfig, kto_loss, run_kto, to_datum

pytestmark = pytest.mark.recipe
torch = pytest.importorskip("torch")


def test_kto_loss_matches_the_formula_and_its_gradient_signs() -> None:
    examples = [
        Feedback([1, 2], [3, 4], desirable=True, ref_logprob=-3.0),
        Feedback([1, 2], [5], desirable=False, ref_logprob=-1.0),
    ]
    data = [to_datum(e) for e in examples]
    # policy logprobs per target position (prompt position first, masked out by weights)
    lps = [
        torch.tensor([-9.0, -1.0, -1.0], requires_grad=True),
        torch.tensor([-9.0, -0.5], requires_grad=True),
    ]
    loss, metrics = kto_loss(data, lps, beta=0.5, weight_d=1.0, weight_u=2.0)
    r_d, r_u = (-2.0) - (-3.0), (-0.5) - (-1.0)  # 1.0, 0.5
    z0 = max(0.0, (r_d + r_u) / 2)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = (1.0 * (1 - sig(0.5 * (r_d - z0))) + 2.0 * (1 - sig(0.5 * (z0 - r_u)))) / 2
    assert float(loss.detach()) == pytest.approx(expected)
    assert metrics["kto_z0"] == pytest.approx(z0)
    loss.backward()
    assert lps[0].grad is not None
    assert lps[1].grad is not None
    assert lps[0].grad[0] == 0  # the prompt position does not train
    assert float(lps[0].grad[1]) < 0  # minimising raises a desirable reply's logprob
    assert float(lps[1].grad[1]) > 0  # and lowers an undesirable one's
    inputs = data[0].loss_fn_inputs
    assert np.asarray(inputs["weights"].to_numpy()).tolist() == [0.0, 1.0, 1.0]


@pytest.mark.integration
def test_kto_runs_and_resumes_on_the_tiny_model(tiny_server: LiveServer, tmp_path: Path) -> None:
    config = KTOConfig(
        log_dir=str(tmp_path / "kto"),
        base_url=tiny_server.url,
        api_key=tiny_server.key,
        model=TINY,
        steps=2,
        train_problems=12,
        eval_problems=4,
        samples=4,
        batch_size=4,
        eval_every=2,
        save_every=1,
        progress=False,
    )
    result = run_kto(config)
    assert result["steps"] == 2
    lines = [json.loads(x) for x in (tmp_path / "kto" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "kto_loss" in r] == [1, 2]
    assert [r["step"] for r in lines if "eval_accuracy" in r] == [0, 2]
    feedback = (tmp_path / "kto" / "feedback.jsonl").read_text()
    config.steps = 3
    assert run_kto(config)["steps"] == 3
    assert (tmp_path / "kto" / "feedback.jsonl").read_text() == feedback  # the same examples
