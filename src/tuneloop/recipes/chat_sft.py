"""`chat_sft`: supervised fine-tuning on chat conversations with `cross_entropy`.

Only the assistant's tokens train (renderers.py). Data: a JSONL file of conversations, the
ShareGPT dump shipped offline (`--data sharegpt`), or Tulu 3 / UltraChat from the hub
(`--data tulu3|ultrachat`, needs `datasets` and network). A share of the conversations is held
out by hash; the held-out loss is measured with forward-only passes every `eval_every` steps.
The data order is a seeded permutation per epoch and the run records its cursor with every
checkpoint, so a resumed run sees exactly the batches an uninterrupted one would.

    tuneloop recipe chat-sft --data sharegpt --steps 20 --log-dir runs/sft
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from tuneloop import AdamParams, TrainingClient
from tuneloop.recipes.datasets import conversations, split
from tuneloop.recipes.renderers import Rendered, renderer_for
from tuneloop.recipes.run import RecipeConfig, started


@dataclass
class ChatSFTConfig(RecipeConfig):
    log_dir: str = "runs/chat_sft"
    learning_rate: float = 2e-4
    data: str = "sharegpt"  # sharegpt | tulu3 | ultrachat | path/to/conversations.jsonl
    limit: int = 2000  # conversations read
    eval_fraction: float = 0.05
    eval_batches: int = 4  # held-out batches per validation
    batch_size: int = 8
    max_length: int = 512  # tokens per conversation (longer ones are cut)


def truncate(rendered: Rendered, max_length: int) -> Rendered:
    return Rendered(rendered.tokens[:max_length], rendered.weights[:max_length])


def batch_at(data: list[Rendered], cursor: int, size: int, seed: int) -> list[Rendered]:
    """Items cursor .. cursor+size-1 of the endless stream of seeded per-epoch permutations."""
    out = []
    for i in range(cursor, cursor + size):
        epoch, offset = divmod(i, len(data))
        order = np.random.default_rng([seed, epoch]).permutation(len(data))
        out.append(data[int(order[offset])])
    return out


def mean_loss(training: TrainingClient, batch: list[Rendered], train: bool) -> float:
    """Loss per trained token of `batch` (forward_backward when `train`, else forward only)."""
    data = [r.datum() for r in batch]
    call = training.forward_backward if train else training.forward
    out = call(data, "cross_entropy").result()
    return float(out.metrics["loss:sum"]) / max(sum(r.trained_tokens for r in batch), 1)


def run_chat_sft(config: ChatSFTConfig) -> dict[str, Any]:
    with started(config) as session:
        run, training, step = session.run, session.training, session.step
        renderer = renderer_for(training.get_tokenizer())
        convs = conversations(config.data, config.limit)
        train_convs, held_convs = split(
            convs, config.eval_fraction, key=lambda c: json.dumps(c[:2]), salt=str(config.seed)
        )
        prepare = [truncate(renderer.supervised(c), config.max_length) for c in train_convs]
        train = [r for r in prepare if r.trained_tokens > 0]
        held = [
            r
            for r in (truncate(renderer.supervised(c), config.max_length) for c in held_convs)
            if r.trained_tokens > 0
        ][: config.eval_batches * config.batch_size]
        if not train:
            raise ValueError(f"no conversation of {config.data!r} has an assistant token to train")
        run.console.print(
            f"chat_sft: {len(train)} training / {len(held)} held-out conversations, "
            f"{config.steps} steps of {config.batch_size}"
        )
        cursor = int(session.position.get("cursor", 0))

        def validate(at: int) -> None:
            if held:
                size = config.batch_size
                batches = [held[i : i + size] for i in range(0, len(held), size)]
                losses = [mean_loss(training, b, train=False) for b in batches]
                run.log(at, {"eval_loss": float(np.mean(losses))})

        if step == 0 and config.eval_every > 0:
            validate(0)
        with run.progress() as bars:
            bar = bars.add_task("training", total=config.steps, completed=step)
            while step < config.steps:
                batch = batch_at(train, cursor, config.batch_size, config.seed)
                loss = mean_loss(training, batch, train=True)
                training.optim_step(AdamParams(learning_rate=config.learning_rate)).result()
                cursor += config.batch_size
                step += 1
                run.log(
                    step,
                    {
                        "train_loss": loss,
                        "trained_tokens": sum(r.trained_tokens for r in batch),
                        "tokens": sum(len(r.tokens) for r in batch),
                    },
                )
                run.end_step(training, step, {"cursor": cursor}, validate)
                bars.advance(bar)
        return {"steps": step, "metrics": run.metrics(), "log_dir": str(run.dir)}
