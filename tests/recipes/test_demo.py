"""`tuneloop demo`: its GRPO pieces, and a whole run on the tiny built-in model that leaves every
output it promises."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from tuneloop.recipes import demo, grpo
from tuneloop.recipes.demo import DemoConfig, run_demo
from tuneloop.recipes.tasks import Score, Task

pytestmark = pytest.mark.recipe

TINY = "tuneloop/tiny-qwen3"


@pytest.fixture
def embedded_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The SDK's embedded server, serving only the tiny random model, with its data in tmp."""
    monkeypatch.delenv("TUNELOOP_BASE_URL", raising=False)
    monkeypatch.delenv("TUNELOOP_API_KEY", raising=False)
    monkeypatch.setenv("TUNELOOP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TUNELOOP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TUNELOOP_SERVE_ARGS", f"--model {TINY} --device cpu")
    return tmp_path


@pytest.mark.slow
@pytest.mark.integration
def test_demo_runs_and_leaves_every_output(
    embedded_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = embedded_tiny / "demo"
    screen = io.StringIO()
    # --keep-serving: the server (and its console) stays up after the run until Ctrl-C.
    served: list[int] = []

    def ctrl_c_once_the_console_answered() -> None:
        url = re.search(r"stays up at (\S+)/console", screen.getvalue())
        assert url is not None, screen.getvalue()
        served.append(httpx.get(f"{url.group(1)}/console/sign-in", timeout=10).status_code)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_wait_for_ctrl_c", ctrl_c_once_the_console_answered)
    # The tiny random model almost never answers a sum: 1-3 % of its samples earn a reward
    # (measured over 64 groups of 4, bench/recipe_sampler_ab.py), so with the task's own scores
    # no group of this run differs, and nothing trains, at about half of all seeds, whichever
    # the sampler. This test is about the loop and what it leaves, not the model's arithmetic
    # (the verifier has its own test below): a reward that differs within most groups of four
    # (the parity of the reply's bytes) makes every run train, at any seed.
    monkeypatch.setattr(Task, "score", _parity_score)
    config = DemoConfig(
        seed=3,
        steps=2,
        group_size=4,
        problems=3,
        eval_problems=5,
        model=TINY,
        out=out,
        eval_every=1,
        keep_serving=True,
    )

    result = run_demo(config, Console(file=screen, width=120))
    assert served == [200]

    lines = [json.loads(x) for x in result.metrics_path.read_text().splitlines()]
    assert [x["event"] for x in lines] == ["eval", "step", "step", "eval"]
    steps = [x for x in lines if x["event"] == "step"]
    assert [x["step"] for x in steps] == [1, 2]
    for record in steps:
        assert 0.0 <= record["accuracy"] <= 1.0
        assert record["tokens_sampled"] > 0
        assert record["seconds"] > 0
    trained = sum(record["tokens_trained"] for record in steps)
    assert trained > 0  # no group of 4 in 6 differing in parity: p = 8**-6
    assert steps[0]["held_out_accuracy"] is not None  # eval_every=1 measured it

    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.state_path.startswith("tinker://")
    assert "/weights/" in result.state_path
    assert result.sampler_path.startswith("tinker://")
    assert "/sampler_weights/" in result.sampler_path
    assert 0.0 <= result.before.accuracy <= 1.0
    assert 0.0 <= result.after.accuracy <= 1.0
    assert result.usage  # the server's metering, or this loop's own counts
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state_path"] == result.state_path

    text = screen.getvalue()
    assert "step  1/2" in text
    # The usage table: operations by token class, not flattened report keys.
    assert "by_operation" not in text
    assert "tokens by class" in text
    # The server metered the datums' input tokens the loop counted.
    assert result.usage["by_operation"]["forward_backward"]["trained_tokens"] == trained
    for word in ("before", "after", "accuracy"):
        assert word in text
    assert str(result.plot_path) in text
    assert result.state_path in text
    # Where to watch the run: the console's URL and the file holding the key to sign in with.
    assert "/console (sign in with the key in" in text
    assert str(embedded_tiny / "home" / "embedded" / "local-api-key") in text
    assert "stopping the server" in text


def _parity_score(self: Task, reply: str, problem: object) -> Score:
    odd = sum(reply.encode()) % 2 == 1
    return Score(float(odd), correct=odd, clean=False)


def test_held_out_problems_are_never_trained_on() -> None:
    train, held_out = Task().splits(n_train=300, n_eval=50, seed=1)
    assert len(held_out) == 50
    assert len(train) == 300  # the pool repeats
    assert not {p.question for p in train} & {p.question for p in held_out}


def test_the_verifier_reads_the_first_number_and_rewards_a_bare_answer() -> None:
    task = Task()
    _, (problem, *_) = task.splits(n_train=1, n_eval=1, seed=0)
    right, wrong = problem.answer, str(int(problem.answer) + 1)
    assert task.score(f" {right}", problem) == Score(1.1, correct=True, clean=True)
    assert task.score(f" {right} because", problem) == Score(1.0, correct=True, clean=False)
    assert task.score(f" {wrong}", problem) == Score(0.1, correct=False, clean=True)
    assert task.score(" none", problem) == Score(0.0, correct=False, clean=False)


def _rollout(reward: float) -> grpo.Rollout:
    problem = Task().splits(n_train=1, n_eval=1, seed=0)[1][0]
    return grpo.Rollout(
        problem, [1, 2, 3], [4, 5], [-0.1, -0.2], "", Score(reward, reward > 0.5, True)
    )


def test_datum_trains_only_the_reply_with_the_group_relative_advantage() -> None:
    assert grpo.advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    datum = grpo.rl_datum(_rollout(1.0), 0.5)
    inputs = {k: v.to_numpy().tolist() for k, v in datum.loss_fn_inputs.items()}
    assert datum.model_input.to_ints() == [1, 2, 3, 4]
    assert inputs["target_tokens"] == [2, 3, 4, 5]
    assert inputs["logprobs"] == pytest.approx([0.0, 0.0, -0.1, -0.2])
    assert inputs["advantages"] == [0.0, 0.0, 0.5, 0.5]


def test_groups_that_all_scored_the_same_are_left_out() -> None:
    same = [_rollout(1.0), _rollout(1.0)]
    mixed = [_rollout(1.0), _rollout(0.0)]
    assert len(grpo.training_data([same, mixed])) == 2


def test_outputs_go_beside_the_local_server_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TUNELOOP_HOME", str(tmp_path))
    assert DemoConfig().out == tmp_path / "demo"
