"""The RL recipes on the tiny model: math_rl (synchronous) and code_rl (two turns, sampling
overlapping training, the sandbox), each 2 steps then resumed once; and the RL pieces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.recipes.conftest import TINY
from tuneloop._local_server import LiveServer
from tuneloop.recipes import rl
from tuneloop.recipes.code_rl import CodeEnv, CodeRLConfig, run_code_rl
from tuneloop.recipes.datasets import CodeProblem, MathProblem
from tuneloop.recipes.math_rl import MathEnv, MathRLConfig, final_answer, run_math_rl
from tuneloop.recipes.rl_train import RLConfig, train_rl
from tuneloop.recipes.run import started

pytestmark = pytest.mark.recipe


def _records(log_dir: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _common(server: LiveServer, log_dir: Path) -> dict[str, object]:
    return {
        "log_dir": str(log_dir),
        "base_url": server.url,
        "api_key": server.key,
        "model": TINY,
        "steps": 2,
        "problems_per_step": 2,
        "group_size": 3,
        "max_tokens": 12,
        "eval_every": 2,
        "save_every": 1,
        "eval_problems": 3,
        "progress": False,
    }


@pytest.mark.integration
def test_math_rl_runs_logs_and_resumes(tiny_server: LiveServer, tmp_path: Path) -> None:
    config = MathRLConfig(**_common(tiny_server, tmp_path / "math"), train_problems=6, kl_coef=0.1)  # type: ignore[arg-type]
    result = run_math_rl(config)
    assert result["steps"] == 2
    steps = [r for r in _records(tmp_path / "math") if "train_reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["sampled_tokens"] > 0
        assert r["staleness"] == 0  # synchronous
        assert "kl_to_base" in r
    evals = [r for r in _records(tmp_path / "math") if "eval_correct" in r]
    assert [r["step"] for r in evals] == [0, 2]
    config.steps = 3
    assert run_math_rl(config)["steps"] == 3  # resumed from step 2's checkpoint
    lines = (tmp_path / "math" / "checkpoints.jsonl").read_text().splitlines()
    assert [json.loads(x)["position"]["batch_index"] for x in lines] == [1, 2, 3]


@pytest.mark.integration
def test_code_rl_overlaps_sampling_and_runs_two_turns(
    tiny_server: LiveServer, tmp_path: Path
) -> None:
    config = CodeRLConfig(**_common(tiny_server, tmp_path / "code"), max_staleness=1, sub_batch=2)  # type: ignore[arg-type]
    assert run_code_rl(config)["steps"] == 2
    steps = [r for r in _records(tmp_path / "code") if "train_reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0 <= r["staleness"] <= 1 for r in steps)
    assert all(r["train_reward"] >= -0.1 for r in steps)
    config.steps = 3
    assert run_code_rl(config)["steps"] == 3  # resumed from step 2's checkpoint
    lines = (tmp_path / "code" / "checkpoints.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]


class _TwoTurnEnv:
    """Two turns whose reward the tiny random model varies (an even-length reply scores 1), so
    groups carry signal; the recipes' real tasks would all score alike on it."""

    def __init__(self, problem: str) -> None:
        self.problem = problem

    def initial(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.problem}]

    def judge(self, reply: str, turn: int) -> rl.Judgement:
        reward = float(len(reply) % 2 == 0)
        return rl.Judgement(reward, done=turn > 0, follow_up=[{"role": "user", "content": "?"}])


@pytest.mark.integration
def test_rl_recipe_trains_with_stable_reinforce_off_policy_over_two_turns(
    tiny_server: LiveServer, tmp_path: Path
) -> None:
    # Samples one step stale, two turns per episode: every turn's datum names its own sampled
    # sequence, recorded by the sampler of the weights it came from.
    common = {
        **_common(tiny_server, tmp_path / "stable"),
        "group_size": 6,
        "eval_every": 0,
        "save_every": 0,
    }
    config = RLConfig(**common, loss="stable_reinforce", max_staleness=1, max_turns=2, sub_batch=2)  # type: ignore[arg-type]
    problems = ["count to three", "name a colour", "say hello"]
    with started(config) as session:
        result = train_rl(config, session, problems, [], lambda p, n: [_TwoTurnEnv(p)] * n)
    assert result["steps"] == 2
    steps = [r for r in _records(tmp_path / "stable") if "train_reward" in r]
    # (which weights sampled step 2's batch depends on timing: staleness 0 or 1)
    assert all(0 <= int(r["staleness"]) <= 1 for r in steps)
    assert sum(int(r["datums"]) for r in steps) > 0, steps
    assert all((r["loss_sum"] != 0.0) == (int(r["datums"]) > 0) for r in steps), steps
    assert MathRLConfig().loss == "stable_reinforce"  # the tinker-cookbook's math_rl default


def test_math_answers_are_read_from_the_marked_line_or_the_last_number() -> None:
    assert final_answer("3 + 4 = 7\n#### 7") == ("7", True)
    assert final_answer("so it costs $1,200.") == ("1200", False)
    assert final_answer("no idea") == (None, False)
    env = MathEnv(MathProblem("q", "7"), format_bonus=0.1)
    assert env.judge("#### 7", 0).reward == pytest.approx(1.1)
    assert env.judge("it is 7", 0).reward == 1.0
    assert env.judge("#### 8", 0).reward == pytest.approx(0.1)


def test_code_env_runs_the_tests_and_offers_one_revision() -> None:
    problem = CodeProblem(
        "t/0", "def add(a, b):\n", "add", "def check(f):\n    assert f(2, 3) == 5\n\ncheck(add)\n"
    )
    env = CodeEnv(problem, rl_runner(), CodeRLConfig())
    good = env.judge("```python\ndef add(a, b):\n    return a + b\n```", 0)
    assert (good.reward, good.done) == (1.0, True)
    bad = env.judge("```python\ndef add(a, b):\n    return a - b\n```", 0)
    assert (bad.reward, bad.done) == (0.0, False)
    assert bad.follow_up[0]["role"] == "tool"
    assert "check_solution" in bad.follow_up[0]["content"]
    none = env.judge("I cannot.", 1)
    assert (none.reward, none.done) == (-0.1, True)


def test_code_env_in_model_mode_checks_only_when_the_reply_calls_the_tool() -> None:
    problem = CodeProblem(
        "t/0", "def add(a, b):\n", "add", "def check(f):\n    assert f(2, 3) == 5\n\ncheck(add)\n"
    )
    env = CodeEnv(problem, rl_runner(), CodeRLConfig(tool_mode="model"))
    assert "check_solution" in env.initial()[0]["content"]
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    final = env.judge(wrong, 0)  # no call: this answer is final
    assert (final.reward, final.done, final.follow_up) == (0.0, True, [])
    called = env.judge(wrong + '\n<tool_call>{"name": "check_solution"}</tool_call>', 0)
    assert (called.reward, called.done) == (0.0, False)
    assert "check_solution" in called.follow_up[0]["content"]
    bare = env.judge(wrong + "\ncheck_solution()\n", 0)
    assert not bare.done
    other_tool = env.judge(wrong + '\n<tool_call>{"name": "search"}</tool_call>', 0)
    assert other_tool.done
    last_turn = env.judge(wrong + "\ncheck_solution()\n", 1)  # max_turns 2: no third turn
    assert last_turn.done
    right = env.judge("```python\ndef add(a, b):\n    return a + b\n```\ncheck_solution()", 0)
    assert (right.reward, right.done) == (1.0, True)
    assert (
        "check_solution"
        not in CodeEnv(problem, rl_runner(), CodeRLConfig()).initial()[0]["content"]
    )


def rl_runner():  # type: ignore[no-untyped-def]
    from tuneloop.recipes.sandbox import run_python

    return run_python


def test_grpo_advantages_skip_groups_without_signal() -> None:
    def traj(reward: float) -> rl.Trajectory:
        return rl.Trajectory([rl.Turn([1, 2], [3, 4], [-0.5, -0.25], "")], reward, {})

    out = rl.assemble([[traj(1.0), traj(1.0)], [traj(1.0), traj(0.0)]])
    assert out.skipped_groups == 1
    assert len(out.data) == 2
    first = {k: v.to_numpy().tolist() for k, v in out.data[0].loss_fn_inputs.items()}
    assert out.data[0].model_input.to_ints() == [1, 2, 3]
    assert first["target_tokens"] == [2, 3, 4]
    assert first["advantages"] == [0.0, 0.5, 0.5]
    assert first["logprobs"] == [0.0, -0.5, -0.25]
    turn = rl.Turn([1, 2], [3, 4], [-0.5, -0.25], "", ref_logprobs=[-0.5, -1.25])
    penalised = rl.datum(turn, 0.5, kl_coef=0.1).loss_fn_inputs["advantages"].to_numpy()
    assert penalised.tolist() == pytest.approx([0.0, 0.5, 0.5 - 0.1])
