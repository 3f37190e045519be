"""`distill`: on-policy distillation from a teacher with reverse-KL per-token advantages.

The student (the training client) samples answers to math questions; the teacher — a base model
or a checkpoint (`tinker://…`) of the same tokenizer — scores every sampled token with
`compute_logprobs`. Each token's advantage is

    A_t = kl_coef * (log p_teacher(x_t | x_<t) - log p_student(x_t | x_<t))

so the `importance_sampling` loss lowers the per-token reverse KL(student || teacher) on the
student's own samples (Agarwal et al., 2024; Thinking Machines' "on-policy distillation").
The student's logprobs are the sampler's, as in the RL recipes. No reward is needed. The
reported `reverse_kl` is the mean of log p_student - log p_teacher over sampled tokens, an
estimate of the per-token KL; held-out prompts give `eval_reverse_kl` (sampled with a fixed seed).

    tuneloop recipe distill --teacher tinker://RUN/sampler_weights/NAME --steps 10
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tuneloop import AdamParams, SamplingClient, SamplingParams, ServiceClient
from tuneloop.recipes import rl
from tuneloop.recipes.datasets import MathProblem
from tuneloop.recipes.math_rl import INSTRUCTION, MathRLConfig, problems
from tuneloop.recipes.renderers import Renderer, renderer_for
from tuneloop.recipes.run import RecipeConfig, started

EVAL_SEED = 999_983  # the held-out samples of every validation share one seed


@dataclass
class DistillConfig(RecipeConfig):
    log_dir: str = "runs/distill"
    teacher: str = ""  # a base model id or a tinker:// checkpoint, same tokenizer as the student
    learning_rate: float = 1e-4
    prompts_per_step: int = 4
    group_size: int = 4  # student samples per prompt
    max_tokens: int = 128
    temperature: float = 1.0
    kl_coef: float = 1.0
    loss: str = "importance_sampling"
    sub_batch: int = 64  # datums per forward_backward request
    train_prompts: int = 64
    eval_prompts: int = 16
    eval_samples: int = 4  # student samples per held-out prompt (the KL estimate's noise)


class PromptEnv:
    """One question, one turn, no reward: the teacher's logprobs are the signal."""

    def __init__(self, problem: MathProblem) -> None:
        self.problem = problem

    def initial(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{self.problem.question}\n\n{INSTRUCTION}"}]

    def judge(self, reply: str, turn: int) -> rl.Judgement:
        return rl.Judgement(0.0)


def teacher_client(service: ServiceClient, teacher: str) -> SamplingClient:
    if not teacher:
        raise ValueError("--teacher: required (a base model id or a tinker:// checkpoint)")
    if teacher.startswith("tinker://"):
        return service.create_sampling_client(model_path=teacher)
    return service.create_sampling_client(base_model=teacher)


def reverse_kl(groups: Sequence[Sequence[rl.Trajectory]]) -> float:
    """Mean log p_student - log p_teacher over every sampled token."""
    terms = [
        np.asarray(turn.logprobs) - np.asarray(turn.ref_logprobs)
        for group in groups
        for trajectory in group
        for turn in trajectory.turns
        if turn.ref_logprobs is not None and turn.completion
    ]
    return float(np.concatenate(terms).mean()) if terms else 0.0


def scored_rollouts(
    student: SamplingClient,
    teacher: SamplingClient,
    renderer: Renderer,
    prompts: Sequence[MathProblem],
    config: DistillConfig,
    group_size: int,
    seed: int,
) -> list[list[rl.Trajectory]]:
    """The student's samples for each prompt (all in flight), then the teacher's logprobs."""

    def group(j: int) -> list[rl.Trajectory]:
        params = SamplingParams(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            seed=seed * 1000 + j,
            stop=renderer.stop or None,
        )
        envs = [PromptEnv(prompts[j]) for _ in range(group_size)]
        return rl.rollout_group(student, renderer, envs, params)

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(prompts)))) as pool:
        groups = list(pool.map(group, range(len(prompts))))
    rl.add_reference_logprobs(teacher, groups)
    return groups


def run_distill(config: DistillConfig) -> dict[str, Any]:
    with started(config) as session:
        run, service, training = session.run, session.service, session.training
        step, position = session.step, session.position
        teacher = teacher_client(service, config.teacher)
        renderer = renderer_for(training.get_tokenizer())
        train, held = problems(
            MathRLConfig(
                train_problems=config.train_prompts,
                eval_problems=config.eval_prompts,
                seed=config.seed,
            )
        )
        run.console.print(
            f"distill: {len(train)} training prompts, {len(held)} held-out, "
            f"teacher {config.teacher}"
        )
        student = training.save_weights_and_get_sampling_client()

        def validate(at: int) -> None:
            if held:
                groups = scored_rollouts(
                    student, teacher, renderer, held, config, config.eval_samples, EVAL_SEED
                )
                run.log(at, {"eval_reverse_kl": reverse_kl(groups)})

        if step == 0 and config.eval_every > 0:
            validate(0)
        with run.progress() as bars:
            bar = bars.add_task("distilling", total=config.steps, completed=step)
            while step < config.steps:
                index = int(position.get("batch_index", 0))
                prompts = [
                    train[(index * config.prompts_per_step + j) % len(train)]
                    for j in range(config.prompts_per_step)
                ]
                seed = config.seed * 1_000_003 + index
                groups = scored_rollouts(
                    student, teacher, renderer, prompts, config, config.group_size, seed
                )
                data = [
                    rl.datum(turn, 0.0, config.kl_coef)
                    for group in groups
                    for trajectory in group
                    for turn in trajectory.turns
                    if turn.completion
                ]
                futures = [
                    training.forward_backward(part, config.loss)
                    for part in rl.sub_batches(data, config.sub_batch)
                ]
                optim = training.optim_step(AdamParams(learning_rate=config.learning_rate))
                loss = sum(float(f.result().metrics.get("loss:sum", 0.0)) for f in futures)
                optim.result()
                step += 1
                position = {"batch_index": index + 1}
                student = training.save_weights_and_get_sampling_client()
                run.log(
                    step,
                    {
                        "train_reverse_kl": reverse_kl(groups),
                        "loss_sum": loss,
                        "datums": len(data),
                        "sampled_tokens": sum(
                            len(turn.completion) for g in groups for t in g for turn in t.turns
                        ),
                    },
                )
                run.end_step(training, step, position, validate)
                bars.advance(bar)
    return {"steps": step, "metrics": run.metrics(), "log_dir": str(run.dir)}
