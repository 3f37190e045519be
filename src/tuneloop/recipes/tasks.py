"""The demo's task: short arithmetic from reasoning-gym's `chain_sum`, with a local verifier.

Why this task: SmolLM2-135M-Instruct answers single-digit `a + b` / `a - b` right 12-18 % of
the time when greedy (it often just says "1"), so it starts low but not at zero, most groups of
samples hold right and wrong answers (RL needs that spread), and a reply is a few tokens, so a
step of 64 samples trains in seconds on a CPU. Harder variants start lower (two-digit terms 7 %,
three terms 7-12 %, leg counting 0 %, 40 problems each).

The prompt ends with the assistant's "Answer:" already written: a 135M model ignores format
instructions ("Reply as Answer: N" was followed 0 times in 40), and forcing the prefix makes
the reply the number itself. The verifier is reasoning-gym's own `score_answer`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# ChatML, written out rather than taken from the tokenizer's chat template: SmolLM2's template
# adds a 20-token default system prompt that would double the tokens trained per sample.
PROMPT = "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\nAnswer:"
_NUMBER = re.compile(r"-?\d+")
# A reply that is just the number (what "Answer:" asks for) earns a little extra reward, so the
# model also learns to stop instead of rambling on after the answer.
_CLEAN = re.compile(r"\s*-?\d+\s*\.?\s*")
FORMAT_BONUS = 0.1
SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    # The generator's record, which its verifier needs back.
    entry: dict[str, Any] = field(repr=False, compare=False, hash=False)


@dataclass(frozen=True)
class Score:
    reward: float
    correct: bool
    clean: bool


class Task:
    """A reasoning-gym generator with its settings, the prompt, and the verifier."""

    def __init__(
        self,
        generator: str = "chain_sum",
        settings: dict[str, Any] | None = None,
        max_tokens: int = 8,
    ) -> None:
        self.generator = generator
        self.settings = (
            {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
            if settings is None
            else settings
        )
        # The answer is at most 3 tokens; a few more leave room to ramble and be marked down.
        self.max_tokens = max_tokens
        self._verifier: Any = None

    @property
    def name(self) -> str:
        return self.generator

    def _dataset(self, size: int, seed: int) -> Any:
        try:
            import reasoning_gym
        except ImportError as exc:  # the SDK alone does not bring the recipes' dependencies
            raise ImportError(
                "the demo needs reasoning-gym: pip install 'tuneloop[recipes]'"
            ) from exc
        return reasoning_gym.create_dataset(self.generator, size=size, seed=seed, **self.settings)

    def splits(self, n_train: int, n_eval: int, seed: int) -> tuple[list[Problem], list[Problem]]:
        """Disjoint training and held-out problems: no held-out question is ever trained on.

        Single-digit sums have only ~200 distinct questions, so the split is by question text;
        training repeats its pool when it needs more problems than are left.
        """
        size = 4 * (n_train + n_eval) + 400
        # reasoning-gym draws item i from Random(seed + i): seeds 0 and 1 would share all but
        # one item. Spreading the seeds apart gives each seed its own problems.
        dataset = self._dataset(size=size, seed=seed * SEED_STRIDE)
        self._verifier = dataset
        unique: dict[str, Problem] = {}
        for entry in dataset:
            question = str(entry["question"]).strip()
            unique.setdefault(question, Problem(question, str(entry["answer"]), dict(entry)))
        problems = list(unique.values())
        if len(problems) <= n_eval:
            raise ValueError(
                f"{self.name} has {len(problems)} distinct problems, too few for {n_eval} "
                "held out and some to train on"
            )
        held_out, pool = problems[:n_eval], problems[n_eval:]
        return [pool[i % len(pool)] for i in range(n_train)], held_out

    def prompt(self, problem: Problem) -> str:
        return PROMPT.format(question=problem.question)

    def score(self, reply: str, problem: Problem) -> Score:
        """Correct if the first number of the reply is the answer; clean if that is all it says."""
        match = _NUMBER.search(reply)
        correct = match is not None and self._check(match.group(0), problem)
        clean = _CLEAN.fullmatch(reply) is not None
        return Score(float(correct) + (FORMAT_BONUS if clean else 0.0), correct, clean)

    def _check(self, answer: str, problem: Problem) -> bool:
        if self._verifier is None:
            self._verifier = self._dataset(size=1, seed=0)
        return bool(self._verifier.score_answer(answer, problem.entry) >= 1.0)
