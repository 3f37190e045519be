"""`kto`: preference alignment from binary feedback (Kahneman-Tversky Optimization).

Feedback is a set of (prompt, reply, desirable?) examples. Offline, it is the model's own
samples labelled by a verifier: the base model answers each training problem `samples` times
(reasoning-gym's `chain_sum`, the demo's task, whose verifier is exact) and right answers are
desirable, wrong ones undesirable. The feedback is written to the run folder once, so a resumed
run trains on the same examples.

The loss (Ethayarajh et al., 2024) compares the policy with a frozen reference, the base model,
whose logprobs come from a base-model sampling client (`compute_logprobs`) once per example:

    r   = log pi(reply | prompt) - log pi_ref(reply | prompt)       (summed over reply tokens)
    z0  = max(0, mean of r over the batch), not differentiated       (the KL reference point)
    loss = lambda_D * (1 - sigmoid(beta * (r - z0)))   for desirable replies
         + lambda_U * (1 - sigmoid(beta * (z0 - r)))   for undesirable ones        (batch mean)

It runs through `forward_backward_custom`: the server returns the policy's logprobs, the loss
and its gradient are computed here with torch, and the server applies that gradient. Held-out
greedy accuracy is measured before training and every `eval_every` steps.

    tuneloop recipe kto --steps 10 --log-dir runs/kto
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tuneloop import AdamParams, Datum, ModelInput, SamplingParams, TensorData
from tuneloop.recipes import grpo
from tuneloop.recipes.run import RecipeConfig, started
from tuneloop.recipes.tasks import Task


@dataclass
class KTOConfig(RecipeConfig):
    log_dir: str = "runs/kto"
    learning_rate: float = 5e-5
    train_problems: int = 64
    eval_problems: int = 50
    samples: int = 4  # base-model answers per training problem, each labelled by the verifier
    batch_size: int = 16
    beta: float = 0.1
    desirable_weight: float = 1.0  # lambda_D
    undesirable_weight: float = 1.0  # lambda_U


@dataclass
class Feedback:
    prompt: list[int]
    reply: list[int]
    desirable: bool
    ref_logprob: float  # the base model's log-probability of the reply


def kto_loss(
    data: list[Datum], logprobs: list[Any], beta: float, weight_d: float, weight_u: float
) -> tuple[Any, dict[str, float]]:
    """The KTO loss on the policy's per-token logprobs (torch tensors) of a batch.

    Written with tensor methods only, so the recipe itself never imports torch (the SDK hands
    the tensors in; recipes use the public SDK alone)."""
    rewards = []
    for datum, lp in zip(data, logprobs, strict=True):
        mask = lp.new_tensor(datum.loss_fn_inputs["weights"].to_numpy())
        ref = float(datum.loss_fn_inputs["ref_logprob"].to_numpy()[0])
        rewards.append((lp * mask).sum() - ref)
    desirable = [bool(d.loss_fn_inputs["desirable"].to_numpy()[0]) for d in data]
    seen = [float(r.detach()) for r in rewards]
    z0 = max(0.0, sum(seen) / len(seen))  # not differentiated
    terms = [
        weight_d * (1 - (beta * (r - z0)).sigmoid())
        if good
        else weight_u * (1 - (beta * (z0 - r)).sigmoid())
        for r, good in zip(rewards, desirable, strict=True)
    ]
    loss = sum(terms[1:], terms[0]) / len(terms)
    chosen = [x for x, good in zip(seen, desirable, strict=True) if good]
    rejected = [x for x, good in zip(seen, desirable, strict=True) if not good]
    metrics = {
        "kto_z0": z0,
        "reward_desirable": sum(chosen) / len(chosen) if chosen else 0.0,
        "reward_undesirable": sum(rejected) / len(rejected) if rejected else 0.0,
    }
    return loss, metrics


def to_datum(example: Feedback) -> Datum:
    tokens = example.prompt + example.reply
    n_prompt = len(example.prompt) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)),
            "weights": TensorData.from_numpy(
                np.array([0.0] * n_prompt + [1.0] * len(example.reply), dtype=np.float32)
            ),
            # Client-side only: forward_backward_custom sends target_tokens and weights.
            "ref_logprob": TensorData.from_numpy(np.array([example.ref_logprob], dtype=np.float32)),
            "desirable": TensorData.from_numpy(
                np.array([float(example.desirable)], dtype=np.float32)
            ),
        },
    )


def collect_feedback(
    config: KTOConfig, service: Any, tokenizer: Any, task: Task, problems: list[Any]
) -> list[Feedback]:
    """The base model's own answers, labelled right (desirable) or wrong by the verifier."""
    base = service.create_sampling_client(base_model=config.model)
    params = SamplingParams(max_tokens=task.max_tokens, temperature=1.0, seed=config.seed)
    groups = grpo.sample_groups(base, tokenizer, task, problems, config.samples, lambda _: params)
    rollouts = [r for g in groups for r in g if r.completion]
    futures = [
        base.compute_logprobs(ModelInput.from_ints(r.prompt + r.completion)) for r in rollouts
    ]
    out = []
    for r, future in zip(rollouts, futures, strict=True):
        scores = future.result()[len(r.prompt) :]
        out.append(
            Feedback(r.prompt, r.completion, r.score.correct, float(sum(x or 0.0 for x in scores)))
        )
    return out


def run_kto(config: KTOConfig) -> dict[str, Any]:
    with started(config) as session:
        run, service, training, step = session.run, session.service, session.training, session.step
        position = session.position
        tokenizer = training.get_tokenizer()
        task = Task()
        train_problems, held_out = task.splits(
            config.train_problems, config.eval_problems, config.seed
        )
        feedback_file = run.dir / "feedback.jsonl"
        if feedback_file.is_file() and run.resumed_from is not None:
            feedback = [Feedback(**json.loads(x)) for x in feedback_file.read_text().splitlines()]
        else:
            feedback = collect_feedback(config, service, tokenizer, task, train_problems)
            feedback_file.write_text("".join(json.dumps(asdict(f)) + "\n" for f in feedback))
        good = sum(f.desirable for f in feedback)
        run.console.print(f"kto: {len(feedback)} labelled answers, {good} desirable")
        if not feedback:
            raise ValueError("the base model gave no answers to label")
        if good in (0, len(feedback)):
            # KTO still trains on one kind alone (it pulls towards or away from the reference),
            # but the run is then worth a look.
            run.console.print("[yellow]warning[/]: every labelled answer has the same label")

        def evaluate(at: int) -> None:
            sampler = training.save_weights_and_get_sampling_client()
            result = grpo.evaluate(sampler, tokenizer, task, held_out)
            run.log(at, {"eval_accuracy": result.accuracy})

        if step == 0 and config.eval_every > 0:
            evaluate(0)
        cursor = int(position.get("cursor", 0))
        with run.progress() as bars:
            bar = bars.add_task("training", total=config.steps, completed=step)
            while step < config.steps:
                batch = []
                for i in range(cursor, cursor + config.batch_size):
                    epoch, offset = divmod(i, len(feedback))
                    order = np.random.default_rng([config.seed, epoch]).permutation(len(feedback))
                    batch.append(to_datum(feedback[int(order[offset])]))
                out = training.forward_backward_custom(
                    batch,
                    lambda data, lps: kto_loss(
                        data, lps, config.beta, config.desirable_weight, config.undesirable_weight
                    ),
                ).result()
                training.optim_step(AdamParams(learning_rate=config.learning_rate)).result()
                cursor += config.batch_size
                step += 1
                metrics = {k: v for k, v in out.metrics.items() if not k.startswith("surrogate")}
                run.log(step, {"kto_loss": metrics.pop("loss:sum"), **metrics})
                run.end_step(training, step, {"cursor": cursor}, evaluate)
                bars.advance(bar)
        return {"steps": step, "metrics": run.metrics(), "log_dir": str(run.dir)}
