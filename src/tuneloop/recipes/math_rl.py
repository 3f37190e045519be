"""`math_rl`: GRPO on grade-school math; held-out accuracy on GSM8K before and after.

Reward 1 for the right final number (`#### N`, else the last number of the reply), plus an
optional format bonus for writing the `#### N` line. Offline, training problems come from
reasoning-gym's `gsm_symbolic` generator (`--train-source gsm_symbolic`, default) or from the
part of the GSM8K test split that is never evaluated (`--train-source gsm8k`); evaluation is
always on held-out GSM8K test problems, split by a hash of the question.

The defaults follow the shape of AWS's published run (10 steps over 40 problems: 4 problems x 16
samples per step) and run as they are on a GPU server; on a CPU, SmolLM2-135M is far too small to
gain at GSM8K, so the note in docs/recipes.md gives a CPU-sized command.

    tuneloop recipe math-rl --steps 10 --log-dir runs/math
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tuneloop.recipes import rl
from tuneloop.recipes.datasets import MathProblem, gsm8k_test, gsm_symbolic, normalise_number, split
from tuneloop.recipes.rl_train import RLConfig, train_rl
from tuneloop.recipes.run import started

INSTRUCTION = (
    "Solve the problem step by step. End with the final answer on its own line as #### <number>."
)
_FINAL = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


@dataclass
class MathRLConfig(RLConfig):
    log_dir: str = "runs/math_rl"
    loss: str = "stable_reinforce"  # the tinker-cookbook's math_rl default
    group_size: int = 16
    max_tokens: int = 384
    train_source: str = "gsm_symbolic"  # or gsm8k (the never-evaluated part of its test split)
    train_problems: int = 40
    format_bonus: float = 0.0  # added for a reply that writes the "#### N" line


def final_answer(reply: str) -> tuple[str | None, bool]:
    """(the reply's final number, whether it used the #### format)."""
    marked = _FINAL.findall(reply)
    if marked:
        return normalise_number(marked[-1]), True
    numbers = _NUMBER.findall(reply)
    return (normalise_number(numbers[-1]) if numbers else None), False


class MathEnv:
    def __init__(self, problem: MathProblem, format_bonus: float) -> None:
        self.problem, self.format_bonus = problem, format_bonus

    def initial(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{self.problem.question}\n\n{INSTRUCTION}"}]

    def judge(self, reply: str, turn: int) -> rl.Judgement:
        answer, formatted = final_answer(reply)
        correct = answer is not None and answer == self.problem.answer
        reward = float(correct) + (self.format_bonus if formatted else 0.0)
        return rl.Judgement(
            reward, metrics={"correct": float(correct), "formatted": float(formatted)}
        )


def problems(config: MathRLConfig) -> tuple[list[MathProblem], list[MathProblem]]:
    gsm8k = gsm8k_test()
    rest, held = split(gsm8k, 0.2, key=lambda p: p.question, salt="math_rl")
    evaluation = held[: config.eval_problems]
    if config.train_source == "gsm8k":
        train = rest[: config.train_problems]
    elif config.train_source == "gsm_symbolic":
        held_questions = {p.question for p in evaluation}
        train = [
            p
            for p in gsm_symbolic(config.train_problems, config.seed)
            if p.question not in held_questions
        ]
    else:
        raise ValueError(f"--train-source: {config.train_source!r} (gsm_symbolic or gsm8k)")
    return train, evaluation


def run_math_rl(config: MathRLConfig) -> dict[str, Any]:
    with started(config) as session:
        train, evaluation = problems(config)
        session.run.console.print(
            f"math_rl: {len(train)} training problems ({config.train_source}), "
            f"{len(evaluation)} held-out GSM8K problems"
        )
        return train_rl(
            config,
            session,
            train,
            evaluation,
            lambda p, n: [MathEnv(p, config.format_bonus) for _ in range(n)],
        )
