"""A flat, synchronous supervised loop: the whole of `chat_sft` in one function to read.

No resume, no validation, no MLflow: load conversations, render them (only assistant tokens
train), and for each step take the next batch of a seeded per-epoch permutation,
`forward_backward` with `cross_entropy`, `optim_step`. On the same settings it computes exactly
the losses `chat_sft` does (tested), so it is the place to start reading or copying.

    python -m tuneloop.recipes.sl_loop --data chats.jsonl --steps 20
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import tuneloop
from tuneloop import AdamParams
from tuneloop.recipes.datasets import conversations, split
from tuneloop.recipes.renderers import Rendered, renderer_for


def sl_loop(
    *,
    data: str,
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
    base_url: str | None = None,
    api_key: str | None = None,
    steps: int = 10,
    batch_size: int = 8,
    learning_rate: float = 2e-4,
    lora_rank: int = 16,
    max_length: int = 512,
    limit: int = 2000,
    eval_fraction: float = 0.05,
    seed: int = 0,
) -> list[float]:
    """Train and return the loss per trained token of every step."""
    service = tuneloop.ServiceClient(base_url=base_url, api_key=api_key)
    try:
        training = service.create_lora_training_client(model, rank=lora_rank, seed=seed)
        renderer = renderer_for(training.get_tokenizer())

        # The same conversations, split and cut as chat_sft's (its held-out part is not used).
        convs = conversations(data, limit)
        train_convs, _ = split(
            convs, eval_fraction, key=lambda c: json.dumps(c[:2]), salt=str(seed)
        )
        train: list[Rendered] = []
        for conv in train_convs:
            rendered = renderer.supervised(conv)
            cut = Rendered(rendered.tokens[:max_length], rendered.weights[:max_length])
            if cut.trained_tokens > 0:
                train.append(cut)

        losses = []
        for step in range(steps):
            # Items step*B .. step*B+B-1 of the endless stream of seeded permutations.
            batch = []
            for i in range(step * batch_size, (step + 1) * batch_size):
                epoch, offset = divmod(i, len(train))
                order = np.random.default_rng([seed, epoch]).permutation(len(train))
                batch.append(train[int(order[offset])])

            out = training.forward_backward([r.datum() for r in batch], "cross_entropy").result()
            training.optim_step(AdamParams(learning_rate=learning_rate)).result()
            loss = float(out.metrics["loss:sum"]) / max(sum(r.trained_tokens for r in batch), 1)
            losses.append(loss)
            print(f"step {step + 1}/{steps}  loss {loss:.4f}", flush=True)
        return losses
    finally:
        service.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="sharegpt, tulu3, ultrachat or a JSONL path")
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--base-url")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    args = parser.parse_args()
    sl_loop(
        data=args.data,
        model=args.model,
        base_url=args.base_url,
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
    )


if __name__ == "__main__":
    main()
