"""Expert LoRA benchmark: forward_backward throughput on a small MoE, and adapter memory of
rank-32 adapters on GPT-OSS-20B and Qwen3-30B-A3B shapes.

Throughput: a random-weight Qwen3-MoE (4 layers, hidden 256, 8 experts top-2, expert width
512, vocab 2048; fp32, CPU, `--threads` torch threads), batches of 8 sequences x 128 tokens,
forward_backward + optim_step, calls interleaved over four columns in one run:
  1. engine_all: the engine (`TorchBackend`, in-process) with the default targets: attention,
     expert LoRA on the fused experts, LM head;
  2. engine_attn: the engine, attention-only LoRA (what tuneloop trained on MoE models before);
  3. peft_all: transformers + PEFT 0.21, the same targets, the experts through PEFT's
     `target_parameters` (`ParamWrapper`: W + B@A materialised per expert, every step);
  4. peft_attn: transformers + PEFT, attention only.
Rank 32, alpha 32, AdamW, one seed. tokens/s counts target tokens; mean over the timed
rounds and, less sensitive to other load on a shared machine, from the fastest round.

Memory (no weights: the models are built on the meta device from their published shapes):
trainable parameters of a rank-32 adapter with every group on and attention-only, and the
bytes they take with their gradients and AdamW's two moments, all fp32 (16 bytes/parameter).

    python bench/moe_lora.py [--threads 2] [--rounds 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

RANK, ALPHA, LR, SEED = 32, 32.0, 1e-4, 0
ROWS, LENGTH = 8, 128


def moe_config() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=1024,
        moe_intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=2,
        pad_token_id=0,
    )


def save_model(folder: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    AutoModelForCausalLM.from_config(moe_config()).save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(2048)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
        eos_token="t2",
        pad_token="t0",
    )
    tokenizer.save_pretrained(folder)


class Engine:
    def __init__(self, name: str, folder: Path, cache: Path, attention_only: bool) -> None:
        from tuneloop.server.engine import types as t
        from tuneloop.server.engine.torch_backend import TorchBackend

        self.name, self.t = name, t
        self.backend = TorchBackend(
            [str(folder)], cache_dir=cache, device="cpu", dtype=torch.float32
        )
        flags = {"train_mlp": False, "train_unembed": False} if attention_only else {}
        spec = t.AdapterSpec("a", str(folder), rank=RANK, seed=SEED, alpha=ALPHA, **flags)
        self.backend.create_adapter(spec)
        self.trainable = sum(
            p.numel() for p in self.backend._adapter("a").runtime.bank.parameters("a")
        )
        self.step = t.AdamStep(LR, 0.9, 0.999, 1e-8, 0.0, 0.0)

    def train_step(self, rows: list[list[int]]) -> None:
        t = self.t
        examples = tuple(
            t.Example(np.asarray(r[:-1]), {"target_tokens": np.asarray(r[1:])}) for r in rows
        )
        (result,) = self.backend.forward_backward(
            [t.ForwardBackwardWork("a", examples, "cross_entropy", {}, False)]
        )
        if isinstance(result, Exception):
            raise result
        self.backend.optim_step("a", self.step)


class Peft:
    def __init__(self, name: str, folder: Path, attention_only: bool) -> None:
        import warnings

        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.name = name
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        extra: dict[str, Any] = {}
        if not attention_only:
            targets.append("lm_head")
            extra["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        config = LoraConfig(
            r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets, **extra
        )
        torch.manual_seed(SEED)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model: Any = get_peft_model(base, config)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)

    def train_step(self, rows: list[list[int]]) -> None:
        ids = torch.tensor(rows)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def throughput(rounds: int) -> dict[str, Any]:
    rng = np.random.default_rng(SEED)
    batches = [rng.integers(3, 2048, size=(ROWS, LENGTH)).tolist() for _ in range(rounds + 1)]
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "moe"
        save_model(folder)
        cache = Path(scratch) / "cache"
        columns: list[Any] = [
            Engine("engine_all", folder, cache, attention_only=False),
            Engine("engine_attn", folder, cache, attention_only=True),
            Peft("peft_all", folder, attention_only=False),
            Peft("peft_attn", folder, attention_only=True),
        ]
        times: dict[str, list[float]] = {c.name: [] for c in columns}
        for i, batch in enumerate(batches):
            for column in columns:
                start = time.perf_counter()
                column.train_step(batch)
                elapsed = time.perf_counter() - start
                print(
                    f"{column.name} {'warm-up' if i == 0 else 'timed'} {elapsed:.2f} s",
                    file=sys.stderr,
                )
                if i:
                    times[column.name].append(elapsed)
    tokens = ROWS * (LENGTH - 1)
    out = {
        c.name: {
            "trainable": c.trainable,
            "tok_per_s": round(tokens * rounds / sum(times[c.name]), 1),
            # The fastest step: on a shared machine the least disturbed one.
            "best_tok_per_s": round(tokens / min(times[c.name]), 1),
            "p50_step_s": round(statistics.median(times[c.name]), 3),
        }
        for c in columns
    }
    pairs = (
        ("engine_all", "peft_all"),
        ("engine_attn", "peft_attn"),
        ("engine_all", "engine_attn"),
    )
    for stat in ("tok_per_s", "best_tok_per_s"):
        out[f"ratios_{stat}"] = {
            f"{a} / {b}": round(out[a][stat] / out[b][stat], 2) for a, b in pairs
        }
    return out


def big_configs() -> dict[str, Any]:
    """The published shapes (config.json of openai/gpt-oss-20b and Qwen/Qwen3-30B-A3B)."""
    from transformers import GptOssConfig, Qwen3MoeConfig

    return {
        "gpt-oss-20b": GptOssConfig(
            vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
            num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
            num_experts_per_tok=4, tie_word_embeddings=False,
        ),
        "qwen3-30b-a3b": Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
            tie_word_embeddings=False,
        ),
    }  # fmt: skip


def memory() -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from tuneloop.server.engine.lora import AdapterBank, inject
    from tuneloop.server.engine.types import AdapterSpec

    out: dict[str, Any] = {}
    for name, config in big_configs().items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        injected = inject(model)
        bank = AdapterBank(injected)
        coverage = injected.describe(model)
        row: dict[str, Any] = {
            "base_parameters_B": round(coverage.parameters / 1e9, 2),
            "lora_share_of_body": coverage.share,
        }
        for label, flags in (
            ("all", {}),
            ("attention_only", {"train_mlp": False, "train_unembed": False}),
        ):
            n = bank.trainable_parameters(AdapterSpec("x", name, RANK, 0, **flags))
            row[label] = {
                "trainable_M": round(n / 1e6, 1),
                "with_adam_GiB": round(16 * n / 2**30, 2),
            }
        out[name] = row
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "memory_rank32": memory(),
        "throughput": throughput(args.rounds),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
