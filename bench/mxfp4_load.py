"""Loading a GPT-OSS folder whose experts are MXFP4 against the same model saved plain (bf16).

A random-weight GPT-OSS (`--hidden`, `--layers`, `--experts`; intermediate = hidden, vocab 4096)
is saved twice: as plain bf16 safetensors, and as the released checkpoints are, its expert
matrices as MXFP4 blocks + scales (quantised here in torch: per block of 32 values an E8M0
exponent floor(log2 amax) - 2, each value rounded to the nearest FP4 E2M1 value) with
`quant_method: mxfp4` in config.json. Each load runs in a fresh child process through the
engine's loader (`models.load_model`, CPU, bf16; the MXFP4 one dequantises through
transformers), the two kinds alternating; a child reports its wall time to the weights in
memory (every parameter read once after the load, since a plain folder's stay mmapped file
pages until then), its peak RSS above what it held after imports, and the resident bytes of
the model's parameters. The parent checks
the disk sizes against `mxfp4.footprint` of the config.

    python bench/mxfp4_load.py [--hidden 1024] [--layers 8] [--experts 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch

_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def quantise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] -> blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32]."""
    rows = weight.float().transpose(1, 2)
    e, out, inner = rows.shape
    x = rows.reshape(e, out, inner // 32, 32)
    amax = x.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, -127.0).clamp(-127, 127)
    y = x / torch.exp2(exponent)[..., None]
    codes = torch.bucketize(y.abs().contiguous(), (_FP4[1:] + _FP4[:-1]) / 2)  # nearest magnitude
    codes = (codes + 8 * torch.signbit(y)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def build(args: argparse.Namespace, root: Path) -> tuple[Path, Path, Any]:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, num_local_experts=args.experts, num_experts_per_tok=4,
        tie_word_embeddings=False, eos_token_id=258, pad_token_id=256, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tokenizer = Path(str(resources.files("tuneloop") / "assets" / "tokenizers" / "byte-level"))
    plain, packed = root / "plain", root / "mxfp4"
    model.save_pretrained(plain)
    model.config.save_pretrained(packed)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(_EXPERTS):
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantise(tensor)
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(packed / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((packed / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(raw))
    for folder in (plain, packed):
        for item in tokenizer.iterdir():
            shutil.copy2(item, folder / item.name)
    return plain, packed, config


def child(folder: str) -> None:
    # Everything both kinds import, imported before the baseline, so the growth is the load's.
    import transformers.integrations.mxfp4
    import transformers.models.gpt_oss.modeling_gpt_oss
    import transformers.quantizers.auto
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneloop.server.engine.models import load_model

    del AutoModelForCausalLM, AutoTokenizer, transformers

    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        return 0

    # The peak (VmHWM) from here on: ru_maxrss would count the parent's RSS at fork.
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS:")
    start = time.perf_counter()
    loaded = load_model(
        folder, cache_dir=Path(folder), device=torch.device("cpu"), dtype=torch.bfloat16
    )
    # A plain folder's parameters may stay mmapped pages of its file until first read: read
    # every one (as the first forward would), so both kinds end with the weights in memory.
    with torch.no_grad():
        for p in loaded.model.parameters():
            p.float().sum()
    wall = time.perf_counter() - start
    peak = status("VmHWM:")
    params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    print(json.dumps({"wall_s": wall, "peak_growth": peak - before, "param_bytes": params}))


def disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0
    from tuneloop.server.engine import mxfp4

    print(f"CPU: {cpu_model()}  ({os.cpu_count()} cores)\n{uptime()}")
    with tempfile.TemporaryDirectory() as tmp:
        plain, packed, config = build(args, Path(tmp))
        estimate = mxfp4.footprint(config, torch.bfloat16)
        print(
            f"model: {estimate.parameters / 1e6:.1f}M parameters, experts "
            f"{estimate.expert_values / 1e6:.1f}M; disk plain {disk(plain) / 1e6:.1f} MB, "
            f"mxfp4 {disk(packed) / 1e6:.1f} MB (footprint: {estimate.disk_bytes / 1e6:.1f} MB)"
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        runs: dict[str, list[dict[str, float]]] = {"plain": [], "mxfp4": []}
        for _ in range(args.rounds):
            for kind, folder in (("plain", plain), ("mxfp4", packed)):
                done = subprocess.run(
                    [sys.executable, __file__, "--child", str(folder)],
                    capture_output=True, text=True, env=env, check=True,
                )  # fmt: skip
                runs[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
        for kind, results in runs.items():
            for r in results:
                print(
                    f"{kind:6s} wall {r['wall_s']:.2f} s, peak RSS growth "
                    f"{r['peak_growth'] / 1e6:.0f} MB, parameters resident "
                    f"{r['param_bytes'] / 1e6:.0f} MB"
                )
        best = {k: min(r["wall_s"] for r in v) for k, v in runs.items()}
        peak = {k: min(r["peak_growth"] for r in v) for k, v in runs.items()}
        print(
            f"mxfp4 / plain: wall {best['mxfp4'] / best['plain']:.2f}x (fastest), "
            f"peak RSS growth {peak['mxfp4'] / peak['plain']:.2f}x (lowest)\n{uptime()}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
