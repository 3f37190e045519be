"""GRPO-style RL pieces on the public SDK: sample groups, score, advantages, datums, evaluation.

Each problem is sampled `group_size` times; a sample's advantage is its reward minus its group's
mean, so the model is pushed towards the better answers to the same question and no value model
or reward scale is needed. Groups whose samples all scored the same teach nothing and are left
out. The loss is `importance_sampling` with the sampler's own logprobs as `logprobs`, so the
update stays correct even though the server's training pass differs numerically from sampling;
`rl_step(loss_fn="stable_reinforce")` instead has the server take the weights against what its
sampler recorded (the datums name their sampled sequences).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tuneloop import (
    AdamParams,
    Datum,
    ModelInput,
    SamplingClient,
    SamplingParams,
    TrainingClient,
)
from tuneloop.recipes import rl
from tuneloop.recipes.tasks import Problem, Score, Task


@dataclass(frozen=True)
class Rollout:
    problem: Problem
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    reply: str
    score: Score
    sequence_id: str | None = None


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    clean: float  # share of replies that were only the number
    tokens_sampled: int
    prompt_tokens: int


def encode(tokenizer: Any, text: str) -> list[int]:
    # The prompt text already holds the chat markers; the tokenizer must not add a BOS of its own.
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def decode(tokenizer: Any, tokens: list[int]) -> str:
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


def sample_groups(
    sampler: SamplingClient,
    tokenizer: Any,
    task: Task,
    problems: list[Problem],
    group_size: int,
    params: Callable[[int], SamplingParams],
    on_done: Callable[[], None] | None = None,
) -> list[list[Rollout]]:
    """`group_size` samples of every problem; all requests go out at once so the server batches
    them. `params(i)` gives problem i its sampling parameters (its own seed)."""
    prompts = [encode(tokenizer, task.prompt(p)) for p in problems]
    futures = [
        sampler.sample(ModelInput.from_ints(prompt), group_size, params(i))
        for i, prompt in enumerate(prompts)
    ]
    groups: list[list[Rollout]] = []
    for problem, prompt, future in zip(problems, prompts, futures, strict=True):
        group = []
        for seq in future.result().sequences:
            reply = decode(tokenizer, seq.tokens)
            group.append(
                Rollout(
                    problem=problem,
                    prompt=prompt,
                    completion=list(seq.tokens),
                    logprobs=list(seq.logprobs or []),
                    reply=reply,
                    score=task.score(reply, problem),
                    sequence_id=seq.sequence_id,
                )
            )
        groups.append(group)
        if on_done is not None:
            on_done()
    return groups


def advantages(rewards: list[float]) -> list[float]:
    """Reward minus the group mean (no division by the spread: a group that is nearly all right
    or all wrong should move the model less, not as much as any other)."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def rl_datum(rollout: Rollout, advantage: float, provenance: bool = False) -> Datum:
    """Tinker-cookbook layout: input = all tokens but the last, targets = all but the first.

    Targets inside the prompt get advantage 0 (and logprob 0), so only the reply is trained.
    With `provenance`, the datum names the rollout's sampled sequence (stable_reinforce).
    """
    turn = rl.Turn(
        rollout.prompt,
        rollout.completion,
        rollout.logprobs,
        rollout.reply,
        sequence_id=rollout.sequence_id,
    )
    return rl.datum(turn, advantage, provenance=provenance)


def training_data(groups: list[list[Rollout]], provenance: bool = False) -> list[Datum]:
    data = []
    for group in groups:
        group_advantages = advantages([r.score.reward for r in group])
        if all(abs(a) < 1e-9 for a in group_advantages):
            continue  # every sample scored the same: no signal, only cost
        data += [rl_datum(r, a, provenance) for r, a in zip(group, group_advantages, strict=True)]
    return data


def evaluate(
    sampler: SamplingClient,
    tokenizer: Any,
    task: Task,
    problems: list[Problem],
    on_done: Callable[[], None] | None = None,
) -> EvalResult:
    """Greedy (temperature 0) accuracy: one answer per held-out problem."""
    greedy = SamplingParams(max_tokens=task.max_tokens, temperature=0.0, seed=0)
    groups = sample_groups(sampler, tokenizer, task, problems, 1, lambda _: greedy, on_done)
    rollouts = [g[0] for g in groups]
    n = max(len(rollouts), 1)
    return EvalResult(
        accuracy=sum(r.score.correct for r in rollouts) / n,
        clean=sum(r.score.clean for r in rollouts) / n,
        tokens_sampled=sum(len(r.completion) for r in rollouts),
        prompt_tokens=sum(len(r.prompt) for r in rollouts),
    )


@dataclass(frozen=True)
class StepOutcome:
    rollouts: list[Rollout]
    datums: int  # samples trained on
    tokens_trained: int
    loss: float
    sampler: SamplingClient  # samples the weights after this step


def rl_step(
    training: TrainingClient,
    sampler: SamplingClient,
    tokenizer: Any,
    task: Task,
    problems: list[Problem],
    group_size: int,
    params: Callable[[int], SamplingParams],
    learning_rate: float,
    on_sampled: Callable[[], None] | None = None,
    loss_fn: str = "importance_sampling",
) -> StepOutcome:
    """One on-policy step: sample groups, score, train on the advantages, refresh the sampler.

    With `loss_fn="stable_reinforce"`, `sampler` must record stability info (and the returned
    one does)."""
    provenance = rl.needs_provenance(loss_fn)
    groups = sample_groups(sampler, tokenizer, task, problems, group_size, params, on_sampled)
    data = training_data(groups, provenance)
    loss = 0.0
    if data:
        # Both go out at once; the server runs them in order.
        fwd = training.forward_backward(data, loss_fn)
        opt = training.optim_step(AdamParams(learning_rate=learning_rate))
        loss = fwd.result().metrics.get("loss:sum", 0.0)
        opt.result()
    return StepOutcome(
        rollouts=[r for g in groups for r in g],
        datums=len(data),
        tokens_trained=sum(d.model_input.length for d in data),
        loss=loss,
        # The next samples must come from the weights just updated.
        sampler=training.save_weights_and_get_sampling_client(record_stability_info=provenance),
    )
