"""A flat, synchronous RL loop: the whole of `math_rl` (GRPO, one turn, no KL, no overlap) in
one function to read.

Each step: take the next problems, sample a group of answers to each with the current weights,
score them here, advantage = reward - group mean (groups that all scored the same are skipped),
`forward_backward` with the loss (`stable_reinforce` by default, as in the tinker-cookbook's
rl_loop: the sampler records what it drew and each datum names its sampled sequence, so the
server takes the importance weights against its own records; or `importance_sampling`, `ppo`,
`cispo` with the sampler's logprobs), `optim_step`, and a sampler of the new weights. On the same
settings it samples and trains exactly what `math_rl --max-staleness 0` does (tested).

    python -m tuneloop.recipes.rl_loop --steps 10 [--loss-fn importance_sampling]
"""

from __future__ import annotations

import argparse

import numpy as np

import tuneloop
from tuneloop import AdamParams, Datum, ModelInput, SamplingParams, TensorData
from tuneloop.recipes.math_rl import MathEnv, MathRLConfig, problems
from tuneloop.recipes.renderers import renderer_for
from tuneloop.recipes.rl import needs_provenance, with_sampled_provenance


def rl_loop(
    *,
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
    base_url: str | None = None,
    api_key: str | None = None,
    steps: int = 10,
    problems_per_step: int = 4,
    group_size: int = 16,
    max_tokens: int = 384,
    learning_rate: float = 4e-5,
    lora_rank: int = 16,
    train_problems: int = 40,
    seed: int = 0,
    loss_fn: str = "stable_reinforce",
) -> list[dict[str, float]]:
    """Train; per step: the samples' mean reward, the tokens sampled, the datums trained on,
    the loss (summed)."""
    config = MathRLConfig(train_problems=train_problems, seed=seed)
    train, _ = problems(config)  # the same problems as math_rl
    service = tuneloop.ServiceClient(base_url=base_url, api_key=api_key)
    try:
        training = service.create_lora_training_client(model, rank=lora_rank, seed=seed)
        renderer = renderer_for(training.get_tokenizer())
        provenance = needs_provenance(loss_fn)  # stable_reinforce: record, then name, samples
        sampler = training.save_weights_and_get_sampling_client(record_stability_info=provenance)
        history: list[dict[str, float]] = []
        for step in range(steps):
            chosen = [
                train[(step * problems_per_step + j) % len(train)] for j in range(problems_per_step)
            ]
            # All groups in flight at once, so the server batches them.
            prompts, futures = [], []
            for j, problem in enumerate(chosen):
                prompt = renderer.prompt(MathEnv(problem, 0.0).initial())
                params = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=1.0,
                    seed=(seed * 1_000_003 + step) * 1000 + j,
                    stop=renderer.stop or None,
                )
                prompts.append(prompt)
                futures.append(sampler.sample(ModelInput.from_ints(prompt), group_size, params))

            data: list[Datum] = []
            rewards: list[float] = []
            sampled = 0
            for problem, prompt, future in zip(chosen, prompts, futures, strict=True):
                sequences = future.result().sequences
                sampled += sum(len(s.tokens) for s in sequences)
                env = MathEnv(problem, 0.0)
                group = [env.judge(renderer.parse(s.tokens), 0).reward for s in sequences]
                rewards += group
                advantages = [r - float(np.mean(group)) for r in group]
                if all(abs(a) < 1e-9 for a in advantages):
                    continue  # no signal in this group
                for seq, advantage in zip(sequences, advantages, strict=True):
                    tokens = prompt + list(seq.tokens)
                    n_prompt = len(prompt) - 1
                    n_reply = len(seq.tokens)
                    datum = Datum(
                        model_input=ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": TensorData.from_numpy(
                                np.array(tokens[1:], dtype=np.int64)
                            ),
                            "logprobs": TensorData.from_numpy(
                                np.array(
                                    [0.0] * n_prompt + list(seq.logprobs or []),
                                    dtype=np.float32,
                                )
                            ),
                            "advantages": TensorData.from_numpy(
                                np.array([0.0] * n_prompt + [advantage] * n_reply, dtype=np.float32)
                            ),
                        },
                    )
                    if provenance:
                        assert seq.sequence_id is not None, "the server names every sample"
                        datum = with_sampled_provenance(
                            datum, len(prompt), n_reply, seq.sequence_id
                        )
                    data.append(datum)

            loss = 0.0
            if data:
                out = training.forward_backward(data, loss_fn).result()
                training.optim_step(AdamParams(learning_rate=learning_rate)).result()
                loss = float(out.metrics.get("loss:sum", 0.0))
            sampler = training.save_weights_and_get_sampling_client(
                record_stability_info=provenance
            )
            history.append(
                {
                    "reward": float(np.mean(rewards)),
                    "sampled_tokens": sampled,
                    "datums": len(data),
                    "loss": loss,
                }
            )
            print(f"step {step + 1}/{steps}  mean reward {history[-1]['reward']:.3f}", flush=True)
        return history
    finally:
        service.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--base-url")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--loss-fn",
        default="stable_reinforce",
        choices=["stable_reinforce", "importance_sampling", "ppo", "cispo"],
        help="the policy loss (default: stable_reinforce, as the tinker-cookbook's rl_loop)",
    )
    args = parser.parse_args()
    rl_loop(model=args.model, base_url=args.base_url, steps=args.steps, loss_fn=args.loss_fn)


if __name__ == "__main__":
    main()
