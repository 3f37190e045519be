"""The LM head fused over vocabulary tiles against the head module, alone, in one process.

SmolLM2-135M's head shape (vocab 49152, width 576) with a rank-32 LoRA on it, random weights:
  - training: target logprobs forward + backward of `--tokens` packed tokens, the previous path
    (the head module's output, base matmul + LoRA product + sum, then the fused log-softmax over
    position chunks, checkpointed past `LOGIT_ELEMENTS_UNCHUNKED` as logprobs.py runs a head it
    cannot fuse) against `fused_head.fused_target_logprobs`, with the logits kept for the
    backward pass and recomputed there;
  - decoding: the logits of `--rows` rows, the head module's against `chunked_logits`.
Calls alternate, so machine noise hits every variant alike; medians of `--rounds`.

    python bench/fused_head.py [--tokens 1408] [--rows 128] [--rounds 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from engine import cpu_model  # siblings: a script's folder is on sys.path

VOCAB, WIDTH, RANK = 49152, 576, 32


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1408, help="a bench/engine.py batch")
    parser.add_argument("--rows", type=int, default=128, help="decode rows")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tuneloop.server.engine import fused_head
    from tuneloop.server.engine import logprobs as lp

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(VOCAB, WIDTH, generator=gen) * 0.02).to(dtype)
    a = (torch.randn(RANK, WIDTH, generator=gen) * 0.02).to(dtype).requires_grad_()
    b = (torch.randn(VOCAB, RANK, generator=gen) * 0.02).to(dtype).requires_grad_()
    hidden = torch.randn(1, args.tokens, WIDTH, generator=gen).to(dtype)
    targets = torch.randint(0, VOCAB, (1, args.tokens, 1), generator=gen)

    def module(x: torch.Tensor) -> torch.Tensor:  # LoRALinear's forward: base, then + delta
        return torch.nn.functional.linear(x, weight) + (x @ a.t()) @ b.t()

    def head_piece(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return lp._TargetLogprobs.apply(module(x), t, None)

    def previous() -> None:
        h = hidden.clone().requires_grad_()
        if args.tokens * VOCAB <= lp.LOGIT_ELEMENTS_UNCHUNKED:
            out = head_piece(h, targets)
        else:
            chunk = max(1, lp.LOGIT_ELEMENTS_PER_CHUNK // VOCAB)
            out = torch.cat(
                [
                    checkpoint(
                        head_piece,
                        h[:, s : s + chunk].contiguous(),
                        targets[:, s : s + chunk],
                        use_reentrant=False,
                    )
                    for s in range(0, args.tokens, chunk)
                ],
                1,
            )
        out.sum().backward()

    def fused(keep: bool) -> Callable[[], None]:
        def run() -> None:
            flat = hidden.clone().requires_grad_().reshape(-1, WIDTH)
            seg = fused_head.Segment(0, args.tokens, flat @ a.t(), b)
            parts = fused_head.HeadParts(weight, None, [seg])
            saved = fused_head.SAVED_LOGITS_BYTES
            fused_head.SAVED_LOGITS_BYTES = saved if keep else 0
            try:
                out = fused_head.fused_target_logprobs(parts, flat, targets.reshape(-1, 1), None)
            finally:
                fused_head.SAVED_LOGITS_BYTES = saved
            out.sum().backward()

        return run

    rows = torch.randn(args.rows, WIDTH, generator=gen).to(dtype)

    @torch.no_grad()
    def decode_module() -> None:
        module(rows).float()

    @torch.no_grad()
    def decode_fused() -> None:
        seg = fused_head.Segment(0, args.rows, rows @ a.t(), b)
        fused_head.chunked_logits(fused_head.HeadParts(weight, None, [seg]), rows)

    variants: dict[str, Callable[[], None]] = {
        "training, head module": previous,
        "training, fused, logits kept": fused(True),
        "training, fused, recomputed": fused(False),
        "decode, head module": decode_module,
        "decode, fused": decode_fused,
    }
    for fn in variants.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            begin = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - begin)
    print(f"cpu: {cpu_model()}  threads {args.threads}  dtype {args.dtype}  load {os.getloadavg()}")
    print(
        f"head {VOCAB} x {WIDTH}, LoRA r{RANK}; training {args.tokens} tokens, decode {args.rows}"
    )
    base = {"training": "training, head module", "decode": "decode, head module"}
    for name, values in times.items():
        ms = statistics.median(values) * 1e3
        ref = statistics.median(times[base[name.split(",")[0]]]) * 1e3
        print(f"  {name:32s} {ms:8.1f} ms  ({ref / ms:.2f}x the head module)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
