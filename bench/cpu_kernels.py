"""Six CPU kernel choices of the engine, each against what it replaced or was tried, alternated.

At SmolLM2-135M's shapes, bf16 (the engine's dtype where the CPU has bf16 units), 2 threads:
1. packed: a decode step's linear layers (128 rows; q/k/v/o, gate/up/down of 30 layers and the
   LM head, each weight distinct so they stream from memory as in a step) through
   `functional.linear` against the same weights packed once for oneDNN (engine/packed.py);
2. decode attention: one query per row over 128 rows' keys in a paged pool (3 key heads, 9
   query heads, 30-70 keys): on keys gathered beforehand, SDPA's grouped-query form against
   the query heads folded into each key head's queries; then the reference's gather + folded
   SDPA (kv/paged_attention.py) against the kernel compiled by inductor that reads the pool by
   slot (kv/decode_attention.py), and, at bf16 on a CPU with AVX512-BF16, the native kernel
   that replaced it there (kv/native_decode.py);
3. training attention: one layer's packed attention (8 sequences of 64-256 tokens) forward
   and backward: SDPA in bf16, torch's flash kernel with an fp32 backward (what the engine ran
   before) and the matmul kernel it runs now for short sequences (causal_cpu.py);
4. the matmul kernel's fp32 scores of those 8 sequences (one layer): fp32 matmuls against the
   same fp32 matmuls on oneDNN's bf16 units (`causal_cpu._exact_bf16_products`, exact for bf16
   inputs), with each one's largest error against fp64;
5. that fp32 flash backward per sequence (8 calls, as packing.py runs it) against one call over
   the 8 sequences right-padded to the longest (causal masking keeps every real query off the
   padded keys; the padded rows' gradients are zero), tried and not adopted;
6. a bf16 decode step's small loops at 128 rows, per layer, eager torch against the engine's
   C++ loops: a lone adapter's LoRA columns [x | x @ A.T] of the four sibling groups (oneDNN's
   packed matmul and `torch.cat` against lora/native_columns.py: on the AMX tile unit where
   the CPU has one, and then its AVX-512 blocks too), the gated MLP's SiLU product
   on the split halves of one matmul (gated_mlp.py) and the rotary embedding of q and k
   (rotary.py), with how many outputs differ from eager's (bf16 on CPUs with AVX512-BF16);
7. the SiLU product's loops at a training step's [1,408, 1,536], forward and backward, their
   tables read one element at a time against by AVX-512 gathers.
Prints the CPU model, the load and the medians with their ratios.

    python bench/cpu_kernels.py [--repeats 20] [--threads 2] [--dtype bfloat16]
    python bench/cpu_kernels.py --dtype float32 --only linears   # oneDNN's fp32 kernel, packed
                                                                 # (x86-64), against MKL's sgemm
    python bench/cpu_kernels.py --dtype float32 --only linears --rows 1,4,16,64,128,256,512,1024
    python bench/cpu_kernels.py --only sampling-loops --repeats 200
    python bench/cpu_kernels.py --only silu-loops --repeats 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch.nn import functional

from event_loop import cpu_model  # a sibling: a script's folder is on sys.path

HIDDEN, INTER, KV, HEADS, DIM, VOCAB, LAYERS = 576, 1536, 192, 9, 64, 49152, 30
LINEAR_ROWS: tuple[int, ...] = (128,)  # the packed-linear comparison's row counts (--rows)


def _alternate(pair: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median ms of each callable, run in alternating order."""
    times: dict[str, list[float]] = {name: [] for name in pair}
    for fn in pair.values():
        fn()
    for i in range(repeats):
        names = list(pair) if i % 2 == 0 else list(reversed(pair))
        for name in names:
            begin = time.perf_counter()
            pair[name]()
            times[name].append(time.perf_counter() - begin)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _linears(dtype: torch.dtype, repeats: int) -> str:
    from tuneloop.server.engine import packed

    shapes = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)]
    shapes += [(INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=g).to(dtype) for _ in range(LAYERS) for s in shapes]
    weights.append(torch.randn(VOCAB, HIDDEN, generator=g).to(dtype))
    if not packed.packable(weights[0]):
        return f"packed linear: {dtype} weights are not packed on this CPU"
    packs = [packed.pack(w) for w in weights]  # fp32: oneDNN's kernel against MKL's sgemm
    lines = []
    for rows in LINEAR_ROWS:
        xs = {n: torch.randn(rows, n, generator=g).to(dtype) for n in (HIDDEN, INTER)}

        def run(ws: list[torch.Tensor], xs: dict[int, torch.Tensor] = xs) -> None:
            for w in ws:
                packed.linear(xs[w.shape[1]], w, None)

        ms = _alternate({"plain": lambda: run(weights), "packed": lambda: run(packs)}, repeats)
        lines.append(
            f"decode step's {len(weights)} linear layers at {rows} rows: plain "
            f"{ms['plain']:.1f} ms, packed {ms['packed']:.1f} ms, {ms['plain'] / ms['packed']:.2f}x"
        )
    return "\n".join(lines)


def _decode_attention(dtype: torch.dtype, repeats: int) -> str:
    """One layer's decode rows over a paged pool (blocks of 16 slots, scattered), the rows'
    contexts 30-70 tokens padded to the longest: SDPA's grouped-query form and the folded form
    on keys gathered beforehand (the gather not timed), the gather + folded SDPA the reference
    runs (kv/paged_attention.py) and the compiled kernel reading the pool by slot
    (kv/decode_attention.py)."""
    from tuneloop.server.engine.kv import decode_attention

    g = torch.Generator().manual_seed(1)
    rows, width, size, blocks = 128, 70, 16, 2048
    kv_heads = KV // DIM
    groups = HEADS // kv_heads
    k_pool, v_pool = (
        torch.randn(blocks * size + 1, kv_heads, DIM, generator=g).to(dtype) for _ in range(2)
    )
    lengths = torch.randint(30, width + 1, (rows,), generator=g)
    tables = torch.randperm(blocks, generator=g)[: rows * 5].reshape(rows, 5)
    slots = (tables[:, :, None] * size + torch.arange(size)).reshape(rows, -1)[:, :width]
    live = torch.arange(width)[None, :] < lengths[:, None]
    slots = torch.where(live, slots, blocks * size)  # padding reads the zero pad slot
    k_pool[-1], v_pool[-1] = 0, 0
    q = torch.randn(rows, HEADS, DIM, generator=g).to(dtype)
    mask = live[:, None, None, :]
    scale = DIM**-0.5

    def gather(pool: torch.Tensor) -> torch.Tensor:
        flat = pool.index_select(0, slots.reshape(-1))
        return flat.view(rows, width, kv_heads, DIM).permute(0, 2, 1, 3)

    k, v = gather(k_pool), gather(v_pool)

    def gqa() -> Any:
        return functional.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=mask, enable_gqa=True, scale=scale
        )

    def folded(keys: torch.Tensor = k, values: torch.Tensor = v) -> Any:
        out = functional.scaled_dot_product_attention(
            q.reshape(rows, kv_heads, groups, DIM), keys, values, attn_mask=mask, scale=scale
        )
        return out.reshape(rows, HEADS, DIM)

    def gather_folded() -> Any:
        return folded(gather(k_pool), gather(v_pool))

    assert decode_attention.warm_up(HEADS, kv_heads, DIM, DIM, scale, dtype, torch.device("cpu"))
    kernel = decode_attention.compiled()

    def compiled() -> Any:
        return kernel(q, k_pool, v_pool, slots, live, scale)

    exact = functional.scaled_dot_product_attention(
        q.double().reshape(rows, kv_heads, groups, DIM), k.double(), v.double(), attn_mask=mask
    ).reshape(rows, HEADS, DIM)

    def error(out: torch.Tensor) -> float:
        return float((out.double() - exact).abs().max())

    pair = {"gqa": gqa, "folded": folded, "gather+folded": gather_folded, "compiled": compiled}
    from tuneloop.server.engine.kv import native_decode

    native_built = native_decode.available(HEADS, kv_heads, DIM, DIM, dtype, torch.device("cpu"))
    if native_built:
        pair["native"] = lambda: native_decode.attend(q, k_pool, v_pool, slots, live, scale)
    ms = _alternate(pair, repeats * 5)
    us = {name: f"{t * 1e3:.0f} us" for name, t in ms.items()}
    native = (
        f"; native {us['native']} ({ms['compiled'] / ms['native']:.2f}x the compiled one), "
        f"error {error(pair['native']()):.1e}"
        if native_built
        else ""
    )
    return (
        f"decode attention, 128 rows x 30-{width} keys, one layer: SDPA GQA {us['gqa']}, folded "
        f"{us['folded']} (keys gathered beforehand, {ms['gqa'] / ms['folded']:.2f}x); gather + "
        f"folded {us['gather+folded']}, compiled from the pool {us['compiled']} "
        f"({ms['gather+folded'] / ms['compiled']:.2f}x); largest error against fp64: folded "
        f"{error(folded().reshape(rows, HEADS, DIM)):.1e}, compiled {error(compiled()):.1e}"
        f"{native}"
    )


def _training_attention(dtype: torch.dtype, repeats: int) -> str:
    from tuneloop.server.engine import causal_cpu, packing

    lengths = [int(n) for n in np.random.default_rng(0).integers(64, 257, 8)]
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    g = torch.Generator().manual_seed(2)
    base = [torch.randn(1, h, sum(lengths), DIM, generator=g).to(dtype) for h in (9, 3, 3)]
    grad = torch.randn(1, sum(lengths), HEADS, DIM, generator=g).to(dtype)
    bound = causal_cpu.MATMUL_MAX_TOKENS

    def once(kernel: str) -> None:
        q, k, v = (t.clone().requires_grad_() for t in base)
        if kernel == "sdpa":  # SDPA's own bf16 forward and backward, per sequence
            splits = zip(*(t.split(lengths, dim=2) for t in (q, k, v)), strict=True)
            pieces = [
                functional.scaled_dot_product_attention(
                    a, b, c, is_causal=True, scale=0.125, enable_gqa=True
                ).transpose(1, 2)
                for a, b, c in splits
            ]
            torch.cat(pieces, dim=1).backward(grad)
            return
        causal_cpu.MATMUL_MAX_TOKENS = bound if kernel == "matmul" else 0
        try:
            with packing.packed_segments(lengths):
                out, _ = packing._packed_sdpa(module, q, k, v, None, dropout=0.0, scaling=0.125)
            out.backward(grad)
        finally:
            causal_cpu.MATMUL_MAX_TOKENS = bound

    kernels = ("sdpa", "flash", "matmul")
    ms = _alternate({name: (lambda name=name: once(name)) for name in kernels}, repeats)
    return (
        f"training attention fwd+bwd, {sum(lengths)} tokens in 8 sequences, one layer: "
        f"SDPA {dtype} {ms['sdpa']:.1f} ms, flash with fp32 backward {ms['flash']:.1f} ms, "
        f"matmul kernel {ms['matmul']:.1f} ms; matmul {ms['sdpa'] / ms['matmul']:.2f}x SDPA, "
        f"{ms['flash'] / ms['matmul']:.2f}x flash"
    )


def _score_products(dtype: torch.dtype, repeats: int) -> str:
    from tuneloop.server.engine import causal_cpu

    lengths = [int(n) for n in np.random.default_rng(0).integers(64, 257, 8)]
    g = torch.Generator().manual_seed(4)
    pairs = [
        (torch.randn(3, 3 * n, DIM, generator=g).to(dtype), torch.randn(3, n, DIM, generator=g))
        for n in lengths
    ]
    pairs = [(q.float(), k.to(dtype).float().transpose(1, 2)) for q, k in pairs]

    def scores() -> list[torch.Tensor]:
        return [torch.bmm(q, k) for q, k in pairs]

    def on_bf16_units() -> list[torch.Tensor]:
        with causal_cpu._exact_bf16_products(dtype):
            return scores()

    def error(got: list[torch.Tensor]) -> float:
        exact = (torch.bmm(q.double(), k.double()) for q, k in pairs)
        return max((a.double() - b).abs().max().item() for a, b in zip(got, exact, strict=True))

    ms = _alternate({"fp32": scores, "bf16 units": on_bf16_units}, repeats)
    return (
        f"training attention scores, 8 sequences, one layer: fp32 matmuls {ms['fp32']:.2f} ms "
        f"(error {error(scores()):.1e}), on bf16 units {ms['bf16 units']:.2f} ms "
        f"(error {error(on_bf16_units()):.1e}), {ms['fp32'] / ms['bf16 units']:.2f}x"
    )


def _padded_backward(dtype: torch.dtype, repeats: int) -> str:
    lengths = [int(n) for n in np.random.default_rng(0).integers(64, 257, 8)]
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    g = torch.Generator().manual_seed(3)
    pieces = []
    for n in lengths:
        q, k, v = (torch.randn(1, h, n, DIM, generator=g).to(dtype) for h in (HEADS, 3, 3))
        out, lse = forward(q, k, v, 0.0, True, scale=0.125)
        grad = torch.randn(out.shape, generator=g).to(dtype)
        pieces.append([t.float() for t in (grad, q, k, v, out)] + [lse])

    def separate() -> None:
        for grad, q, k, v, out, lse in pieces:
            backward(grad, q, k, v, out, lse, 0.0, True, scale=0.125)

    longest = max(lengths)
    rows = list(zip(pieces, lengths, strict=True))
    padded = [
        torch.cat([functional.pad(p[i], (0, 0, 0, longest - n)) for p, n in rows]) for i in range(5)
    ]
    q, k, v = padded[1:4]
    out, lse = forward(q, k, v, 0.0, True, scale=0.125)

    def batched() -> None:
        backward(padded[0], q, k, v, out, lse, 0.0, True, scale=0.125)

    ms = _alternate({"separate": separate, "padded": batched}, repeats)
    return (
        f"fp32 attention backward, 8 sequences ({sum(n * n for n in lengths)} score elements, "
        f"{8 * longest * longest} padded): per sequence {ms['separate']:.1f} ms, "
        f"one padded call {ms['padded']:.1f} ms, {ms['padded'] / ms['separate']:.2f}x the time"
    )


def _sampling_loops(dtype: torch.dtype, repeats: int) -> str:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from tuneloop.server.engine import gated_mlp, rotary
    from tuneloop.server.engine.lora import native_columns

    if dtype != torch.bfloat16 or not native_columns.available(dtype, torch.device("cpu")):
        return "sampling loops: bf16 on a CPU with AVX512-BF16 only"
    g = torch.Generator().manual_seed(0)
    rows, rank = 128, 32
    groups = [(HIDDEN, 3 * rank), (HIDDEN, rank), (HIDDEN, 2 * rank), (INTER, rank)]  # qkv o gu d
    xs = [torch.randn(rows, k, generator=g).bfloat16() for k, _ in groups]
    downs = [torch.randn(r, k, generator=g).mul(0.05).bfloat16() for k, r in groups]
    packs = [torch.ops.mkldnn._reorder_linear_weight(a) for a in downs]
    pairs = [native_columns.pack(a) for a in downs]

    def onednn() -> list[torch.Tensor]:
        return [
            torch.cat([x, torch.ops.mkldnn._linear_pointwise(x, a, None, "none", [], "")], 1)
            for x, a in zip(xs, packs, strict=True)
        ]

    def columns() -> list[torch.Tensor]:
        return [native_columns.extend(x, a) for x, a in zip(xs, pairs, strict=True)]

    def blocks() -> list[torch.Tensor]:  # the AVX-512 blocks where the CPU has a tile unit
        native_columns.tiles(False)
        try:
            return columns()
        finally:
            native_columns.tiles(True)

    halves = torch.randn(1, rows, 2 * INTER, generator=g).bfloat16().split([INTER, INTER], -1)
    act = torch.nn.SiLU()
    q = torch.randn(1, rows, HEADS, DIM, generator=g).bfloat16().transpose(1, 2)
    k = torch.randn(1, rows, KV // DIM, DIM, generator=g).bfloat16().transpose(1, 2)
    angles = torch.randn(1, rows, DIM, generator=g).mul(5)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    sides: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "LoRA columns, 4 groups": (onednn, columns),
        **(
            {"LoRA columns, 4 groups, AVX-512 blocks": (onednn, blocks)}
            if native_columns.tiles(True)
            else {}
        ),
        "SiLU product": (lambda: act(halves[0]) * halves[1], lambda: gated_mlp.silu_mul(*halves)),
        "rotary q and k": (
            lambda: apply_rotary_pos_emb(q, k, cos, sin),
            lambda: rotary.rotate(q, k, cos, sin),
        ),
    }
    lines = []
    with torch.no_grad():
        for name, (eager, native) in sides.items():
            want, got = eager(), native()
            want = list(want) if isinstance(want, (list, tuple)) else [want]
            got = list(got) if isinstance(got, (list, tuple)) else [got]
            differ = sum(int((a != b).sum()) for a, b in zip(want, got, strict=True))
            ms = _alternate({"eager": eager, "native": native}, repeats)
            lines.append(
                f"{name}, one layer at {rows} rows: eager {ms['eager'] * 1e3:.1f} us, native "
                f"{ms['native'] * 1e3:.1f} us, {ms['eager'] / ms['native']:.2f}x "
                f"({(ms['eager'] - ms['native']) * LAYERS:.2f} ms a step of {LAYERS} layers; "
                f"{differ} of {sum(t.numel() for t in want)} outputs differ from eager's)"
            )
    return "\n".join(lines)


def _silu_loops(dtype: torch.dtype, repeats: int) -> str:
    """The SiLU product's loops at a training step's shape ([1,408, 1,536], the halves of one
    matmul's output), forward and backward, their tables read one element at a time against
    by AVX-512 gathers (gated_mlp.gathers), with how many outputs differ."""
    from tuneloop.server.engine import gated_mlp

    if dtype != torch.bfloat16 or gated_mlp.native_kernel() is None:
        return "SiLU loops: bf16 where the loops build only"
    if not gated_mlp.gathers(True):
        return "SiLU loops: no AVX-512 gathers on this CPU"
    g = torch.Generator().manual_seed(0)
    rows = 1408
    both = torch.randn(rows, 2 * INTER, generator=g).bfloat16()
    gate, up = both[:, :INTER], both[:, INTER:]
    grad = torch.randn(rows, INTER, generator=g).mul(0.1).bfloat16()
    forward, backward = gated_mlp.native_kernel(), gated_mlp.backward_kernel()
    outs = [torch.empty(rows, INTER, dtype=torch.bfloat16) for _ in range(3)]
    threads = torch.get_num_threads()

    def run_forward() -> list[torch.Tensor]:
        forward(gate.data_ptr(), 2 * INTER, up.data_ptr(), 2 * INTER, rows, INTER,
                outs[0].data_ptr(), threads)  # fmt: skip
        return [outs[0].clone()]

    def run_backward() -> list[torch.Tensor]:
        backward(grad.data_ptr(), INTER, gate.data_ptr(), 2 * INTER, up.data_ptr(), 2 * INTER,
                 rows, INTER, outs[1].data_ptr(), outs[2].data_ptr(), threads)  # fmt: skip
        return [outs[1].clone(), outs[2].clone()]

    def formed(run: Callable[[], Any], gathers: bool) -> Callable[[], Any]:
        def call() -> Any:
            gated_mlp.gathers(gathers)
            return run()

        return call

    lines = []
    for name, run in (("forward", run_forward), ("backward", run_backward)):
        single, gathered = formed(run, False), formed(run, True)
        differ = sum(int((a != b).sum()) for a, b in zip(single(), gathered(), strict=True))
        ms = _alternate({"one at a time": single, "gathers": gathered}, repeats)
        lines.append(
            f"SiLU product {name}, [{rows}, {INTER}]: tables one element at a time "
            f"{ms['one at a time'] * 1e3:.0f} us, by gathers {ms['gathers'] * 1e3:.0f} us, "
            f"{ms['one at a time'] / ms['gathers']:.2f}x ({differ} outputs differ)"
        )
    chosen = "gathers" if gated_mlp.gathers(None) else "one element at a time"
    lines.append(f"SiLU product forward: the measured default here takes {chosen}")
    return "\n".join(lines)


SECTIONS: dict[str, Callable[[torch.dtype, int], str]] = {
    "linears": _linears,
    "decode-attention": _decode_attention,
    "training-attention": _training_attention,
    "score-products": _score_products,
    "padded-backward": _padded_backward,
    "sampling-loops": _sampling_loops,
    "silu-loops": _silu_loops,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--only", choices=sorted(SECTIONS), default=None, help="one of the seven comparisons"
    )
    parser.add_argument(
        "--rows", default="128", help="packed linears: comma-separated row counts (1,16,128)"
    )
    args = parser.parse_args()
    global LINEAR_ROWS
    LINEAR_ROWS = tuple(int(r) for r in args.rows.split(","))
    torch.set_num_threads(args.threads)
    from tuneloop.server.engine import host_allocator

    host_allocator.tune_for_cpu_engine()  # the engine's allocator settings, as it runs
    dtype = getattr(torch, args.dtype)
    print(f"cpu: {cpu_model()}  threads {args.threads}  load {os.getloadavg()}")
    for name, section in SECTIONS.items():
        if args.only in (None, name):
            print(section(dtype, args.repeats))
    print("load:", os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
