"""`distill` on the tiny model: a teacher that differs from the student (an adapter trained
toward a set of tokens), the student's reverse KL to it falls on held-out prompts, and a run
resumes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.recipes.conftest import TINY
from tuneloop import (
    AdamParams,
    Datum,
    ModelInput,
    SamplingParams,
    ServiceClient,
    TensorData,
    TrainingClient,
)
from tuneloop._local_server import LiveServer
from tuneloop.recipes import rl
from tuneloop.recipes.distill import DistillConfig, PromptEnv, reverse_kl, run_distill
from tuneloop.recipes.math_rl import MathRLConfig, problems
from tuneloop.recipes.renderers import renderer_for

pytestmark = pytest.mark.recipe


# The teacher's tokens: a set the student draws ~6 % of the time (16 of 259), so that every step's
# samples hold some; toward one token (drawn 1 time in 259), the few steps here saw two or three
# of it, and what the student learned, measured exactly, ranged from nothing to a 19 % lower KL.
TEACHER_TOKENS = tuple(range(40, 56))
VOCAB = 259  # the tiny model's


def _teacher(service: ServiceClient) -> tuple[str, TrainingClient]:
    """An adapter trained for a few steps toward a set of tokens: a teacher the student is not.
    Its sampler weights' path and its training client."""
    training = service.create_lora_training_client(TINY, rank=8, seed=0)
    data = []
    for i in range(4):
        targets = [TEACHER_TOKENS[(i + k) % len(TEACHER_TOKENS)] for k in range(12)]
        data.append(
            Datum(
                model_input=ModelInput.from_ints([3 + i, *targets[:-1]]),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_numpy(np.array(targets, dtype=np.int64))
                },
            )
        )
    for _ in range(3):
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(AdamParams(learning_rate=1e-2)).result()
    path = training.save_weights_for_sampler("teacher").result().path
    assert path is not None
    return path, training


def _exact_reverse_kl(
    student: TrainingClient, teacher: TrainingClient, sequences: list[tuple[list[int], int]]
) -> float:
    """KL(student || teacher) over the whole vocabulary, averaged over the positions from
    `start` on of each (tokens, start): computed from forward passes that score every token
    (cross_entropy takes [N, V] targets), so no sampling noise enters it."""

    def logprobs(training: TrainingClient) -> list[np.ndarray]:
        data = [
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_numpy(
                        np.tile(np.arange(VOCAB, dtype=np.int64), (len(tokens) - 1, 1))
                    )
                },
            )
            for tokens, _ in sequences
        ]
        outputs = training.forward(data, "cross_entropy").result().loss_fn_outputs
        return [
            np.asarray(out["logprobs"].to_numpy())[start - 1 :]
            for (_, start), out in zip(sequences, outputs, strict=True)
        ]

    terms = [
        (np.exp(s) * (s - t)).sum(-1)
        for s, t in zip(logprobs(student), logprobs(teacher), strict=True)
    ]
    return float(np.concatenate(terms).mean())


def _held_out_replies(service: ServiceClient, tokenizer: object) -> list[tuple[list[int], int]]:
    """The held-out prompts, each with the base model's greedy reply of 10 tokens: sequences
    that depend on no random draw."""
    renderer = renderer_for(tokenizer)
    _, held = problems(MathRLConfig(train_problems=8, eval_problems=8))
    base = service.create_sampling_client(base_model=TINY)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    out = []
    for problem in held:
        prompt = renderer.prompt(PromptEnv(problem).initial())
        reply = base.sample(ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
        out.append(([*prompt, *reply.tokens], len(prompt)))
    return out


def test_reverse_kl_is_the_mean_log_ratio_over_sampled_tokens() -> None:
    turn = rl.Turn([1], [2, 3], [-1.0, -2.0], "", ref_logprobs=[-1.5, -4.0])
    empty = rl.Turn([1], [], [], "", ref_logprobs=[])
    groups = [[rl.Trajectory([turn], 0.0, {}), rl.Trajectory([empty], 0.0, {})]]
    assert reverse_kl(groups) == pytest.approx((0.5 + 2.0) / 2)
    datum = rl.datum(turn, 0.0, kl_coef=1.0)  # advantage = teacher - student per token
    assert datum.loss_fn_inputs["advantages"].to_numpy().tolist() == [-0.5, -2.0]


@pytest.mark.slow
@pytest.mark.integration
def test_distill_lowers_the_reverse_kl_to_the_teacher_and_resumes(
    tiny_server: LiveServer, tmp_path: Path
) -> None:
    service = ServiceClient(base_url=tiny_server.url, api_key=tiny_server.key)
    try:
        teacher_path, teacher = _teacher(service)
        config = DistillConfig(
            log_dir=str(tmp_path / "distill"),
            base_url=tiny_server.url,
            api_key=tiny_server.key,
            model=TINY,
            teacher=teacher_path,
            learning_rate=5e-3,
            steps=4,
            prompts_per_step=2,
            group_size=8,
            max_tokens=10,
            train_prompts=8,
            eval_prompts=8,
            eval_samples=4,
            eval_every=2,
            save_every=2,
            progress=False,
        )
        assert run_distill(config)["steps"] == 4
        lines = (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(x) for x in lines]
        evals = [r["eval_reverse_kl"] for r in records if "eval_reverse_kl" in r]
        assert len(evals) == 3  # before step 1, after steps 2 and 4
        # The recipe's validation estimates the KL from 32 samples drawn with one fixed seed, so
        # its first value is one draw that every run at that seed shares: 0.056-0.152 (mean
        # 0.105, sd 0.022-0.026) over 16 seeds with either sampler; after training the
        # estimates came to 0.024 / 0.040 on average (sd 0.008-0.009) over 8 seeds with the
        # batched draw / the previous sampler (bench/recipe_sampler_ab.py, docs/benchmarks.md).
        # Below the first value, then, not a fixed share of it.
        assert evals[0] > 0
        assert float(np.mean(evals[1:])) < evals[0]
        assert all(r["datums"] == 16 for r in records if "train_reverse_kl" in r)
        # What the student learned, without sampling noise: the exact KL on fixed sequences,
        # 0.105 before and 0.027-0.038 after (16 runs: 8 seeds x 2 samplers).
        sequences = _held_out_replies(service, teacher.get_tokenizer())
        untrained = service.create_lora_training_client(TINY, rank=16, seed=0)  # B = 0: the base
        checkpoints = (tmp_path / "distill" / "checkpoints.jsonl").read_text().splitlines()
        trained = service.create_training_client_from_state(
            json.loads(checkpoints[-1])["state_path"]
        )
        before = _exact_reverse_kl(untrained, teacher, sequences)
        after = _exact_reverse_kl(trained, teacher, sequences)
        assert before > 0.05  # the teacher is far from the untrained student
        assert after < 0.6 * before, (before, after)
    finally:
        service.close()
    config.steps = 5
    assert run_distill(config)["steps"] == 5  # resumed from step 4's checkpoint
    lines = (tmp_path / "distill" / "checkpoints.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [2, 4, 5]


def test_a_teacher_is_required() -> None:
    from tuneloop.recipes.distill import teacher_client

    with pytest.raises(ValueError, match="--teacher"):
        teacher_client(None, "")  # type: ignore[arg-type]
