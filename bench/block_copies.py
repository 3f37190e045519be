"""A step's copies-on-write in the paged KV pool: block by block against one batched copy.

When the samples of a prompt start decoding, every sample but the last copies the prompt's
partly filled last block before writing into it (kv/block_manager.py). `KVPool.copy_blocks`
makes all of a step's copies in one gather and one write per pool tensor; before, each block
was copied on its own, two slice operations per block and pool tensor. Here: a pool shaped as
SmolLM2-135M's (30 layers, keys and values of 3 heads x 64, bf16, 16-slot blocks, 2,048
blocks), the copies of 32 prompts x 4 samples (96 blocks), both ways alternated, with their
results compared. Prints the CPU model and the medians.

    python bench/block_copies.py [--repeats 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from event_loop import cpu_model  # a sibling: a script's folder is on sys.path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tuneloop.server.engine.kv.paged_attention import KVPool

    blocks, size, layers = 2048, 16, 30
    pool = KVPool(blocks, size, torch.device("cpu"), torch.bfloat16)
    like = torch.empty((1, 3, 64), dtype=torch.bfloat16)
    for layer in range(layers):
        pool.layer(layer, like, like)
        for t in (pool.keys[layer], pool.values[layer]):
            t.normal_()  # every page touched: the copies, not first faults, are timed
    # 32 prompts' last blocks (0-31), each copied for 3 of its 4 samples into fresh blocks
    pairs = [(p, 32 + 3 * p + s) for p in range(32) for s in range(3)]

    def block_by_block() -> None:
        for source, target in pairs:
            src = slice(source * size, (source + 1) * size)
            dst = slice(target * size, (target + 1) * size)
            for tensors in (pool.keys, pool.values):
                for t in tensors.values():
                    t[dst] = t[src]

    def batched() -> None:
        pool.copy_blocks(pairs)

    times: dict[str, list[float]] = {"block by block": [], "batched": []}
    ways = {"block by block": block_by_block, "batched": batched}
    for i in range(args.repeats):
        for name in list(ways) if i % 2 == 0 else list(reversed(ways)):
            begin = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - begin)
    before = [t.clone() for t in pool.keys.values()]
    block_by_block()
    assert all(torch.equal(a, b) for a, b in zip(before, pool.keys.values(), strict=True))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"cpu: {cpu_model()}  threads {args.threads}  load {os.getloadavg()}")
    print(
        f"{len(pairs)} block copies x {2 * layers} pool tensors: block by block "
        f"{ms['block by block']:.2f} ms, batched {ms['batched']:.2f} ms, "
        f"{ms['block by block'] / ms['batched']:.1f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
