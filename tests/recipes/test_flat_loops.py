"""The flat loops compute what the full recipes compute on the same settings (tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.recipes.conftest import TINY
from tests.recipes.test_chat_sft import _conversations
from tuneloop._local_server import LiveServer
from tuneloop.recipes import rl
from tuneloop.recipes import rl_loop as rl_loop_module
from tuneloop.recipes.chat_sft import ChatSFTConfig, run_chat_sft
from tuneloop.recipes.math_rl import MathEnv, MathRLConfig, run_math_rl
from tuneloop.recipes.rl_loop import rl_loop
from tuneloop.recipes.sl_loop import sl_loop

pytestmark = [pytest.mark.recipe, pytest.mark.integration]


def _steps(log_dir: Path, key: str) -> list[dict[str, float]]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if key in r]


def test_sl_loop_agrees_with_chat_sft(tiny_server: LiveServer, tmp_path: Path) -> None:
    data = _conversations(tmp_path / "chats.jsonl")
    common = {"steps": 3, "batch_size": 4, "learning_rate": 1e-2, "eval_fraction": 0.2}
    flat = sl_loop(
        data=str(data),
        model=TINY,
        base_url=tiny_server.url,
        api_key=tiny_server.key,
        **common,  # type: ignore[arg-type]
    )
    run_chat_sft(
        ChatSFTConfig(
            log_dir=str(tmp_path / "sft"),
            base_url=tiny_server.url,
            api_key=tiny_server.key,
            model=TINY,
            data=str(data),
            eval_every=0,
            save_every=0,
            progress=False,
            **common,  # type: ignore[arg-type]
        )
    )
    full = [r["train_loss"] for r in _steps(tmp_path / "sft", "train_loss")]
    assert flat == pytest.approx(full, rel=1e-4)


def test_rl_loop_agrees_with_math_rl(tiny_server: LiveServer, tmp_path: Path) -> None:
    common = {
        "steps": 2,
        "problems_per_step": 2,
        "group_size": 3,
        "max_tokens": 12,
        "learning_rate": 1e-3,
        "train_problems": 6,
    }
    flat = rl_loop(model=TINY, base_url=tiny_server.url, api_key=tiny_server.key, **common)  # type: ignore[arg-type]
    run_math_rl(
        MathRLConfig(
            log_dir=str(tmp_path / "rl"),
            base_url=tiny_server.url,
            api_key=tiny_server.key,
            model=TINY,
            eval_every=0,
            save_every=0,
            progress=False,
            **common,  # type: ignore[arg-type]
        )
    )
    full = _steps(tmp_path / "rl", "train_reward")
    assert [f["sampled_tokens"] for f in flat] == [r["sampled_tokens"] for r in full]
    assert [f["reward"] for f in flat] == pytest.approx([r["train_reward"] for r in full])
    assert [f["loss"] for f in flat] == pytest.approx(
        [r["loss_sum"] for r in full], rel=1e-4, abs=1e-6
    )


class _LengthEnv(MathEnv):
    """A reward the tiny random model varies (an even-length reply scores 1), so groups carry
    signal and every step trains; the math answers it never gets right would all score 0."""

    def judge(self, reply: str, turn: int) -> rl.Judgement:
        return rl.Judgement(float(len(reply) % 2 == 0))


def test_rl_loop_trains_with_stable_reinforce(
    tiny_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rl_loop_module, "MathEnv", _LengthEnv)
    common = {
        "model": TINY,
        "base_url": tiny_server.url,
        "api_key": tiny_server.key,
        "steps": 2,
        "problems_per_step": 2,
        "group_size": 4,
        "max_tokens": 8,
        "learning_rate": 1e-3,
        "train_problems": 4,
    }
    stable = rl_loop(loss_fn="stable_reinforce", **common)  # type: ignore[arg-type]
    assert all(step["datums"] > 0 for step in stable), stable
    assert all(step["loss"] != 0.0 for step in stable)
    # On policy (the sampler and the learner score alike, r ~ 1) stable_reinforce's gradient is
    # importance_sampling's, -A grad(lp): the same updates, so the same samples and rewards.
    plain = rl_loop(loss_fn="importance_sampling", **common)  # type: ignore[arg-type]
    assert [s["sampled_tokens"] for s in stable] == [s["sampled_tokens"] for s in plain]
    assert [s["reward"] for s in stable] == [s["reward"] for s in plain]
    assert [s["datums"] for s in stable] == [s["datums"] for s in plain]
