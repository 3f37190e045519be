"""How far the sampler's logprobs are from the forward pass's, per weight dtype (measured).

The RL property: the logprob the sampler reports for a token it drew is the logprob a
forward (training) pass gives the same token in the same context. In fp32 the two agree to
float rounding; with bf16 weights (bf16 LoRA products and LM head, fp32 log-softmax) the decode
step and the training pass run different kernels on differently shaped batches (one token per
row against the whole sequence, paged against packed attention), so they agree only to bf16
rounding. This measures the bound on SmolLM2-135M with a trained (non-zero) rank-32 adapter:
`--prompts` prompts (of `--prompt-tokens` min,max tokens) x `--samples` samples x
`--new-tokens` tokens at temperature 1, per dtype, the max and mean |sampler - forward| over
every sampled token.

`--merged-sampling on|off` samples the adapter snapshot on its merged weights or not (default:
the engine's, not; `serve --[no-]merged-sampling`); `--fused-sampling on|off` on its fused
weights, the delta in extra columns (lora/fused.py), or with the base layers and the LoRA
products (default: the engine's, fused where the CPU packs the weights). Also reported:
how much of the adapter's delta merging keeps, per adapted layer, |round(W + d) - (W + d)| /
|d| (Frobenius norms; d = scale * B @ A of the trained factors, rounded to the weights' dtype
as `AdapterBank.lone_weights(merge=True)` does), median and max, with |d| / |W|. The adapter is
trained `--train-steps` AdamW steps at `--lr` (2 at 1e-3 by default) on random tokens first.

    python bench/logprob_agreement.py [--dtypes float32 bfloat16] [--merged-sampling on|off]
                                      [--prompt-tokens 8,32] [--new-tokens 16]
                                      [--fused-sampling on|off]
                                      [--train-steps 2] [--lr 1e-3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tuneloop.server.engine import types as t
from tuneloop.server.engine.torch_backend import TorchBackend

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def measure(dtype: torch.dtype, args: argparse.Namespace) -> dict[str, Any]:
    merge = {"auto": None, "on": True, "off": False}[args.merged_sampling]
    fuse = {"auto": None, "on": True, "off": False}[args.fused_sampling]
    backend = TorchBackend(
        [MODEL],
        cache_dir=args.cache_dir,
        device="cpu",
        dtype=dtype,
        merge_lone_adapter=merge,
        fuse_lone_key=fuse,
    )
    backend.create_adapter(t.AdapterSpec("a", MODEL, rank=32, seed=0, alpha=32.0))
    rng = np.random.default_rng(0)
    rows = [rng.integers(100, 40000, size=96) for _ in range(4)]
    examples = tuple(t.Example(r[:-1], {"target_tokens": r[1:]}) for r in rows)
    for _ in range(args.train_steps):  # a trained adapter: B != 0, so the LoRA path counts
        work = t.ForwardBackwardWork("a", examples, "cross_entropy", {}, False)
        backend.forward_backward([work])
        backend.optim_step("a", t.AdamStep(args.lr, 0.9, 0.95, 1e-8, 0.0, 0.0))
    kept = _merge_rounding(backend, "a")
    backend.create_sampler("s", MODEL, adapter_id="a")
    low, high = (int(n) for n in args.prompt_tokens.split(","))
    prompts = [
        rng.integers(100, 40000, size=int(rng.integers(low, high + 1))) for _ in range(args.prompts)
    ]
    works = [
        t.SampleWork("s", p, args.samples, args.new_tokens, 1.0, -1, 1.0, i, (), ())
        for i, p in enumerate(prompts)
    ]
    diffs: list[np.ndarray] = []
    for prompt, result in zip(prompts, backend.sample(works), strict=True):
        if isinstance(result, Exception):
            raise result
        for s in result.sequences:
            full = np.concatenate([prompt, np.asarray(s.tokens)])
            example = t.Example(full[:-1], {"target_tokens": full[1:]})
            work = t.ForwardBackwardWork("a", (example,), "cross_entropy", {}, True)
            [forward] = backend.forward_backward([work])
            if isinstance(forward, Exception):
                raise forward
            lp = np.asarray(forward.logprobs[0])[len(prompt) - 1 :]
            diffs.append(np.abs(np.asarray(s.logprobs) - lp))
    backend.close()
    every = np.concatenate(diffs)
    return {
        "tokens": int(every.size),
        "max_abs": float(every.max()),
        "mean_abs": float(every.mean()),
        "p99_abs": float(np.quantile(every, 0.99)),
        **kept,
    }


def _merge_rounding(backend: TorchBackend, key: str) -> dict[str, float]:
    """Per adapted layer, the error of the merged weight against W + d, relative to d."""
    from tuneloop.server.engine.lora.linear import LoRALinear

    [runtime] = backend._runtimes.values()
    errors, sizes = [], []
    for module in runtime.model.modules():
        found = module.lookup(key) if isinstance(module, LoRALinear) else None
        if found is None:
            continue
        a, b, scale = found
        weight = module.base.weight
        exact = weight.double() + scale * (b.double() @ a.double())
        delta = (exact - weight.double()).norm().item()
        merged = exact.to(weight.dtype).double()
        errors.append((merged - exact).norm().item() / delta)
        sizes.append(delta / weight.double().norm().item())
    return {
        "merge_error_over_delta_median": float(np.median(errors)),
        "merge_error_over_delta_max": float(np.max(errors)),
        "delta_over_weight_median": float(np.median(sizes)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", default="8,32", help="prompt lengths: min,max")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/tuneloop").expanduser())
    parser.add_argument("--merged-sampling", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--fused-sampling", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--train-steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {name: measure(getattr(torch, name), args) for name in args.dtypes}
    report["load_average"] = [round(x, 2) for x in os.getloadavg()]
    report["sampling"] = {"merged": args.merged_sampling, "fused": args.fused_sampling}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
