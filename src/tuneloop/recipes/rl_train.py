"""The RL recipes' shared loop: rollouts (async or not) -> advantages -> sub-batched
forward_backward -> optim_step -> a sampler of the new weights; validation, checkpoints, resume.

A recipe supplies its problems and an `Env` factory (rl.py). Greedy validation runs one episode
per held-out problem and reports the mean reward and the mean of each metric the env reports
(e.g. `correct`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from tuneloop import AdamParams, SamplingClient, SamplingParams
from tuneloop.recipes import rl
from tuneloop.recipes.renderers import Renderer, renderer_for
from tuneloop.recipes.run import RecipeConfig, Started

P = TypeVar("P")


@dataclass
class RLConfig(RecipeConfig):
    learning_rate: float = 4e-5
    problems_per_step: int = 4
    group_size: int = 8
    max_tokens: int = 256
    temperature: float = 1.0
    loss: str = "importance_sampling"  # or stable_reinforce, ppo, cispo
    kl_coef: float = 0.0  # KL penalty against the base model (0: off, no reference pass)
    max_staleness: int = 0  # >0: sample step k+1 while step k trains; drop older samples
    sub_batch: int = 64  # datums per forward_backward request
    max_turns: int = 1
    eval_problems: int = 50


def _mean_metrics(trajectories: Sequence[rl.Trajectory]) -> dict[str, float]:
    keys = sorted({k for t in trajectories for k in t.metrics})
    out = {"reward": float(np.mean([t.reward for t in trajectories])) if trajectories else 0.0}
    for key in keys:
        out[key] = float(np.mean([t.metrics.get(key, 0.0) for t in trajectories]))
    return out


def evaluate(
    sampler: SamplingClient,
    renderer: Renderer,
    problems: Sequence[P],
    make_envs: Callable[[P, int], list[rl.Env]],
    config: RLConfig,
) -> dict[str, float]:
    """Greedy: one episode per problem, all in flight at once."""
    greedy = SamplingParams(
        max_tokens=config.max_tokens, temperature=0.0, seed=0, stop=renderer.stop or None
    )
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(problems)))) as pool:
        groups = list(
            pool.map(
                lambda p: rl.rollout_group(
                    sampler, renderer, make_envs(p, 1), greedy, config.max_turns
                ),
                problems,
            )
        )
    return _mean_metrics([g[0] for g in groups])


def train_rl(
    config: RLConfig,
    session: Started,
    train_problems: Sequence[P],
    eval_problems: Sequence[P],
    make_envs: Callable[[P, int], list[rl.Env]],
) -> dict[str, Any]:
    """Train `steps` RL steps on the problems with the envs `make_envs(problem, n)` builds."""
    if not train_problems:
        raise ValueError("no training problems")
    run, service, training = session.run, session.service, session.training
    step, position = session.step, session.position
    renderer = renderer_for(training.get_tokenizer())
    base = service.create_sampling_client(base_model=config.model) if config.kl_coef > 0 else None
    # stable_reinforce: the samplers record what they draw and the datums name their sequences.
    provenance = rl.needs_provenance(config.loss)

    def make_batch(sampler: SamplingClient, version: int, index: int) -> rl.Batch:
        problems = [
            train_problems[(index * config.problems_per_step + j) % len(train_problems)]
            for j in range(config.problems_per_step)
        ]

        def group(j: int) -> list[rl.Trajectory]:
            params = SamplingParams(
                max_tokens=config.max_tokens,
                temperature=config.temperature,
                seed=(config.seed * 1_000_003 + index) * 1000 + j,
                stop=renderer.stop or None,
            )
            envs = make_envs(problems[j], config.group_size)
            return rl.rollout_group(sampler, renderer, envs, params, config.max_turns)

        with ThreadPoolExecutor(max_workers=len(problems)) as pool:
            groups = list(pool.map(group, range(len(problems))))
        return rl.Batch(version, index, groups)

    sampler = training.save_weights_and_get_sampling_client(record_stability_info=provenance)
    box = rl.SamplerBox(sampler, step)
    stream = rl.RolloutStream(
        box, make_batch, int(position.get("batch_index", 0)), config.max_staleness
    )

    def validate(at: int) -> None:
        if eval_problems:
            metrics = evaluate(box.get()[0], renderer, eval_problems, make_envs, config)
            run.log(at, {f"eval_{k}": v for k, v in metrics.items()})

    try:
        if step == 0 and config.eval_every > 0:
            validate(0)
        with run.progress() as bars:
            bar = bars.add_task("training", total=config.steps, completed=step)
            while step < config.steps:
                batch = stream.next(step)
                if base is not None:
                    rl.add_reference_logprobs(base, batch.groups)
                assembled = rl.assemble(batch.groups, config.kl_coef, provenance)
                loss = 0.0
                if assembled.data:
                    futures = [
                        training.forward_backward(part, config.loss)
                        for part in rl.sub_batches(assembled.data, config.sub_batch)
                    ]
                    optim = training.optim_step(AdamParams(learning_rate=config.learning_rate))
                    loss = sum(float(f.result().metrics.get("loss:sum", 0.0)) for f in futures)
                    optim.result()
                step += 1
                sampler = training.save_weights_and_get_sampling_client(
                    record_stability_info=provenance
                )
                box.set(sampler, step)
                trajectories = [t for g in batch.groups for t in g]
                record = {
                    **{f"train_{k}": v for k, v in _mean_metrics(trajectories).items()},
                    "loss_sum": loss,
                    "datums": len(assembled.data),
                    "skipped_groups": assembled.skipped_groups,
                    "sampled_tokens": sum(
                        len(turn.completion) for t in trajectories for turn in t.turns
                    ),
                    **rl.staleness_metrics(batch, step - 1, stream.dropped),
                }
                if base is not None:
                    record["kl_to_base"] = assembled.kl
                run.log(step, record)
                run.end_step(training, step, {"batch_index": batch.index + 1}, validate)
                bars.advance(bar)
    finally:
        stream.close()
    return {"steps": step, "metrics": run.metrics(), "log_dir": str(run.dir)}
