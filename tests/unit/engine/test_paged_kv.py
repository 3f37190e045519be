"""The paged KV cache: block accounting, prefix caching, copy-on-write, and paged decoding
equal to decoding with HF's dense cache."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import (  # noqa: E402
    TINY,
    adapter_spec,
    assert_near,
    example,
    ok,
    seq,
    train,
)
from tests.unit.engine.test_sampler import sw  # noqa: E402
from tuneloop.server.engine.kv.block_manager import BlockManager  # noqa: E402
from tuneloop.server.engine.types import EngineError, SampleWork  # noqa: E402


@pytest.fixture
def be(backend) -> Any:
    return with_samplers(backend)


def with_samplers(backend: Any) -> Any:
    """A trained adapter's snapshot `sA` and a base-model sampler, blocks of 4 tokens (prompts
    of a few blocks, partly filled last blocks shared by samples)."""
    backend.create_adapter(adapter_spec("A", rank=4, seed=1))
    train(backend, "A", [example(seq(16, 11)), example(seq(10, 12))], 3, lr=2e-2)
    backend.create_sampler("sA", TINY, adapter_id="A")
    backend.create_sampler("base", TINY)
    backend.kv_block_size = 4
    return backend


def usage(be: Any) -> Any:
    return be.kv_usage()[TINY]


def idle(be: Any) -> None:
    u = usage(be)
    assert (u.blocks_used, u.blocks_reserved) == (0, 0), u


def dense_reference(be: Any, work: SampleWork) -> list[tuple[list[int], list[float]]]:
    """Each sample decoded alone with HF's DynamicCache, through the same sampling step."""
    from transformers import DynamicCache

    from tuneloop.server.engine import sampler

    runtime = be._samplers[work.sampler_id]
    key, _ = be._route(work.sampler_id, runtime)
    out: list[tuple[list[int], list[float]]] = []
    for index in range(work.num_samples):
        row = sampler.Row(work, sampler.row_seed(work.seed, index), index=index)
        cache = DynamicCache()
        tokens = torch.as_tensor(work.prompt, dtype=torch.long)[None]
        with torch.no_grad(), runtime.bank.routed([key]):
            while True:
                logits = runtime.model(input_ids=tokens, cache=cache, use_cache=True).logits
                [going] = sampler.sample_rows(logits[:, -1].float(), [row], runtime.decode)
                if not going:
                    break
                tokens = torch.tensor([[row.tokens[-1]]])
        out.append((row.tokens, row.logprobs))
    return out


def check_dense(be: Any, works: list[SampleWork], results: list[Any]) -> None:
    for work, result in zip(works, results, strict=True):
        reference = dense_reference(be, work)
        assert [s.tokens for s in ok(result).sequences] == [t for t, _ in reference]
        assert_near(
            [s.logprobs for s in result.sequences],
            [lp for _, lp in reference],
            1e-5,
            "paged",
            relative=True,  # float32 rounding grows with |logprob| (up to ~9 here)
        )


# ---- paged decoding = dense decoding ---------------------------------------------------------


def test_samples_that_diverge_copy_their_shared_last_block(be) -> None:
    """8 samples fork a 10-token prompt: 2 full blocks shared, the third (2 of 4 slots) copied
    by every sample that writes into it but the last."""
    work = sw("sA", seq(10, 1), num_samples=8, max_tokens=12, seed=3)
    [result] = be.sample([work])
    assert len({tuple(s.tokens) for s in ok(result).sequences}) == 8  # they diverged
    check_dense(be, [work], [result])
    idle(be)


def test_shared_prefixes_across_requests_and_adapters_equal_the_dense_reference(be) -> None:
    prefix = seq(12, 2)
    works = [
        sw("sA", np.concatenate([prefix, seq(5, 3)]), num_samples=2, seed=1),
        sw("sA", np.concatenate([prefix, seq(3, 4)]), seed=2, temperature=0.7),
        # the same tokens through the base model: keys of other weights, never shared with sA
        sw("base", np.concatenate([prefix, seq(5, 3)]), num_samples=2, seed=1),
    ]
    first = be.sample(works)
    check_dense(be, works, first)
    hits = usage(be).prefix_hits
    assert hits == 0  # admitted in one step: nothing was cached yet
    again = be.sample(works)  # now every full block is cached, per adapter
    # 17 tokens: 4 full blocks (the last token is always computed); 15 tokens: 3
    assert usage(be).prefix_hits - hits == 4 + 3 + 4
    assert [[s.tokens for s in r.sequences] for r in again] == [
        [s.tokens for s in r.sequences] for r in first
    ]
    assert_near(
        [[s.logprobs for s in r.sequences] for r in again],
        [[s.logprobs for s in r.sequences] for r in first],
        1e-5,
        "cached prefix",
    )
    idle(be)


def test_decode_rows_are_grouped_by_adapter(be, monkeypatch) -> None:
    """Requests of two adapters, interleaved: every decode step routes one LoRA segment per
    adapter (not one per request), and each sample equals its dense reference."""
    from tuneloop.server.engine import model_runner

    segments: list[int] = []
    original = model_runner.Routing.from_lengths

    def counting(keys: list[str | None], lengths: list[int]) -> Any:
        routing = original(keys, lengths)
        if len(lengths) == 8 and set(lengths) == {1}:  # the 8 decode rows (body or head)
            segments.append(len(routing.runs))
        return routing

    monkeypatch.setattr(model_runner.Routing, "from_lengths", staticmethod(counting))
    works = [
        sw("sA" if i % 2 == 0 else "base", seq(6 + i, 20 + i), num_samples=2, max_tokens=5, seed=i)
        for i in range(4)
    ]
    results = be.sample(works)
    assert segments
    assert max(segments) == 2, segments
    check_dense(be, works, results)
    idle(be)


def test_chunked_prefill_next_to_decoding_rows_equals_the_dense_reference(be) -> None:
    be.prefill_chunk = 3
    running = sw("base", seq(5, 5), max_tokens=20, seed=4)
    joiners = [sw("sA", seq(17, 6), num_samples=3, max_tokens=6, seed=5), sw("base", seq(9, 7))]
    steps = iter([[], [], joiners])
    got: dict[int, Any] = {}
    be.sample_continuous([running], lambda: next(steps, []), lambda w, r: got.update({id(w): r}))
    works = [running, *joiners]
    check_dense(be, works, [got[id(w)] for w in works])
    idle(be)


# ---- prefill once, blocks accounted --------------------------------------------------------------


def test_a_prompt_is_prefilled_once_for_eight_samples(be) -> None:
    prompt, new = seq(23, 8), 10
    runner_tokens: list[int] = []
    decoder = be._runtimes[TINY].model.get_decoder()
    hook = decoder.register_forward_pre_hook(
        lambda _m, _a, kw: runner_tokens.append(int(kw["input_ids"].shape[1])), with_kwargs=True
    )
    try:
        [result] = be.sample([sw("sA", prompt, num_samples=8, max_tokens=new, seed=9)])
    finally:
        hook.remove()
    assert len(ok(result).sequences) == 8
    assert runner_tokens[0] == 23  # the prompt once, not 8 times
    # then one token per sample per step; the last sampled token is never fed back
    assert runner_tokens[1:] == [8] * (new - 1)
    idle(be)


def test_blocks_come_back_after_finished_cancelled_and_failed_requests(be) -> None:
    be.prefill_chunk = 2
    long = sw("sA", seq(30, 9), num_samples=3, max_tokens=30, seed=1, cancel_key="k")
    short = sw("base", seq(6, 10), num_samples=2, max_tokens=3, seed=2)
    cancelled: set[str] = set()
    steps = 0

    def admit() -> list[SampleWork]:
        nonlocal steps
        steps += 1
        if steps == 4:
            assert usage(be).blocks_used > 0
            cancelled.add("k")
        return []

    got: dict[int, Any] = {}
    be.sample_continuous(
        [long, short], admit, lambda w, r: got.update({id(w): r}), lambda: cancelled
    )
    assert isinstance(got[id(long)], EngineError)
    ok(got[id(short)])
    idle(be)


def test_requests_beyond_the_pool_run_alone_and_fail_only_if_they_outgrow_it(be) -> None:
    be.sample_token_budget = 64  # 16 blocks of 4
    every_token = tuple(range(259))
    too_long = sw("sA", seq(70, 11))  # 18 prompt blocks: refused at the door
    # worst case 2 + 4 x 25 blocks, but every sample stops at its first token: it fits
    stops = sw("sA", seq(6, 12), num_samples=4, max_tokens=100, stop_token_ids=every_token)
    outgrows = sw("sA", seq(40, 13), num_samples=4, max_tokens=20)  # 10 + 4 x 5 > 16
    small = sw("base", seq(6, 14), max_tokens=4)  # waits behind `outgrows`, then runs
    results = be.sample([too_long, stops, outgrows, small])
    assert isinstance(results[0], EngineError)
    assert results[0].category == "user"
    assert "at least 19 KV-cache blocks" in str(results[0])
    assert [len(s.tokens) for s in ok(results[1]).sequences] == [1] * 4
    assert isinstance(results[2], EngineError)
    assert results[2].category == "user"
    assert "outgrew the KV cache" in str(results[2])
    check_dense(be, [small], [results[3]])
    assert usage(be).blocks_total == 16
    idle(be)


def test_a_recreated_sampler_never_reads_keys_of_its_old_weights(be) -> None:
    prompt = seq(20, 13)
    work = sw("sA", prompt, max_tokens=4, seed=1, prompt_logprobs=True)
    [before] = be.sample([work])
    train(be, "A", [example(seq(16, 11))], 3, lr=5e-2)
    be.create_sampler("sA", TINY, adapter_id="A")  # same id, new factors
    hits = usage(be).prefix_hits
    [after] = be.sample([work])
    assert usage(be).prefix_hits == hits  # the old blocks are not found
    check_dense(be, [work], [after])
    assert after.prompt_logprobs != before.prompt_logprobs  # the weights did change


# ---- the block manager on its own ------------------------------------------------------------


def test_stale_nans_in_the_pool_never_reach_a_decode_row(be) -> None:
    """What a failed request left in its blocks (NaN, as a poisoned sampler writes) sits in
    every slot nobody wrote since: decode rows of unequal lengths, padded to the longest, still
    give exactly what they give alone."""
    works = [sw("sA", seq(3, 21), max_tokens=6), sw("base", seq(11, 22), max_tokens=6, seed=3)]
    alone = [ok(be.sample([w])[0]) for w in works]
    [runtime] = be._runtimes.values()
    runtime.decoder = None  # a fresh pool: no prompt above is cached in it
    ok(be.sample([sw("base", seq(5, 23))])[0])  # its layers exist once written
    pool = runtime.decoder.pool
    for tensors in (pool.keys, pool.values):
        for t in tensors.values():
            t[: pool.pad_slot] = float("nan")
    together = [ok(r) for r in be.sample(works)]
    for mine, ref in zip(together, alone, strict=True):
        assert mine.sequences[0].tokens == ref.sequences[0].tokens
        assert_near(mine.sequences[0].logprobs, ref.sequences[0].logprobs, 1e-5, "lp")
    idle(be)


def test_block_manager_shares_copies_and_frees() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.reserve(5)
    table = [bm.allocate(), bm.allocate()]  # a prompt of 6 tokens
    samples = [bm.fork(table) for _ in range(3)]
    bm.free(table)
    assert bm.usage().blocks_used == 2
    assert bm.shared(samples[0][0])
    assert bm.shared(samples[0][1])  # 3 references each
    source, copy = bm.copy_on_write(samples[0], 1)
    assert (source, samples[0][1]) == (table[1], copy)
    source, copy = bm.copy_on_write(samples[1], 1)
    assert not bm.shared(samples[2][1])  # the last holder keeps the original
    assert bm.usage().blocks_used == 4
    assert bm.reserved == 1
    bm.unreserve(1)
    for s in samples:
        bm.free(s)
    assert bm.usage().blocks_used == 0
    assert bm.available() == 6


def test_a_steps_block_copies_equal_copying_block_by_block() -> None:
    from tuneloop.server.engine.kv.paged_attention import KVPool

    def pool() -> KVPool:
        p = KVPool(num_blocks=8, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
        g = torch.Generator().manual_seed(0)
        for layer, heads in ((0, 2), (1, 3)):  # layers may differ in key heads
            p.layer(layer, torch.empty(1, heads, 5), torch.empty(1, heads, 7))
            for t in (p.keys[layer], p.values[layer]):
                t[: p.pad_slot] = torch.randn(t[: p.pad_slot].shape, generator=g)
        return p

    pairs = [(1, 5), (1, 6), (3, 0)]
    one_by_one, batched = pool(), pool()
    for source, target in pairs:  # each block's slots copied on its own, by slices
        for tensors in (one_by_one.keys, one_by_one.values):
            for t in tensors.values():
                t[target * 4 : (target + 1) * 4] = t[source * 4 : (source + 1) * 4]
    batched.copy_blocks(pairs)
    for a, b in ((one_by_one.keys, batched.keys), (one_by_one.values, batched.values)):
        for layer in a:
            assert torch.equal(a[layer], b[layer])
            assert torch.equal(a[layer][20:24], a[layer][4:8])  # block 5 is block 1's copy
            assert a[layer][one_by_one.pad_slot].abs().sum() == 0  # the pad slot stays zero
    batched.copy_blocks([])
    with pytest.raises(ValueError, match="target"):
        batched.copy_blocks([(1, 2), (2, 3)])  # a chain would depend on the order


def test_prefix_digests_depend_on_the_namespace_and_every_token_before() -> None:
    tokens = list(range(10))
    a = BlockManager.chain("x#1", tokens, 4)
    assert len(a) == 2  # full blocks only
    assert BlockManager.chain("x#1", tokens, 4) == a
    assert BlockManager.chain("x#2", tokens, 4)[0] != a[0]
    changed = BlockManager.chain("x#1", [99, *tokens[1:]], 4)
    assert changed[1] != a[1]  # the second block's digest covers the first block's tokens


def test_freed_prefix_blocks_stay_findable_until_reused() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    tokens = [1, 2, 3, 4]
    digests = BlockManager.chain("", tokens, 2)
    bm.reserve(2)
    table = [bm.allocate(), bm.allocate()]
    for i, (block, digest) in enumerate(zip(table, digests, strict=True)):
        bm.seal(block, digest, tokens[2 * i : 2 * i + 2])
    bm.free(table)
    assert bm.usage().blocks_cached == 2
    found = bm.cached_prefix(digests, tokens)
    assert found == table
    assert bm.cost(found) == 2  # both are free: reusing them takes them from the pool
    assert bm.cached_prefix(digests, [1, 2, 3, 5]) == table[:1]
    bm.reserve(3)
    for _ in range(3):  # the free block first, then the oldest freed cached ones
        bm.allocate()
    assert bm.cached_prefix(digests, tokens) == []
    assert bm.usage().blocks_cached == 0


def test_new_blocks_reuse_the_most_recently_freed_memory_and_cached_blocks_last() -> None:
    """A new block is the most recently freed one holding nothing findable (its memory warm,
    on a CPU its pages faulted in), so steps keep landing on the same blocks instead of
    cycling through the pool; cached prefix blocks are taken only when no other is free,
    oldest freed first."""
    bm = BlockManager(num_blocks=6, block_size=2)

    def take(count: int) -> list[int]:
        assert bm.reserve(count)
        return [bm.allocate() for _ in range(count)]

    first = take(2)
    assert first == [0, 1]  # a new pool from its first block on
    bm.free(first)
    assert take(2) == [0, 1]  # again, not blocks 2 and 3
    tokens = [1, 2, 3, 4]
    cached = take(2)  # 2 and 3, sealed: a findable prefix
    assert cached == [2, 3]
    for i, (block, digest) in enumerate(
        zip(cached, BlockManager.chain("", tokens, 2), strict=True)
    ):
        bm.seal(block, digest, tokens[2 * i : 2 * i + 2])
    bm.free(cached)
    bm.free(first)
    assert sorted(take(4)) == [0, 1, 4, 5]  # the plain ones, then never-used ones
    assert bm.usage().blocks_cached == 2  # the prefix is still findable
    # at last, oldest freed first (a table is freed from its end: a prefix's head lasts longest)
    assert take(2) == cached[::-1]
    assert bm.usage().blocks_cached == 0


def test_paged_decoding_needs_no_per_architecture_code(tmp_path) -> None:
    """Llama's attention (no q/k norms, other rotary code) goes through the same paged path."""
    from tuneloop.server.engine.models import TINY_LLAMA
    from tuneloop.server.engine.torch_backend import TorchBackend

    llama = TorchBackend([TINY_LLAMA], cache_dir=tmp_path, device="cpu", kv_block_size=4)
    try:
        llama.create_sampler("base", TINY_LLAMA)
        works = [
            sw("base", seq(9, 14), num_samples=3, max_tokens=6, seed=2),
            sw("base", seq(4, 15)),
        ]
        check_dense(llama, works, llama.sample(works))
    finally:
        llama.close()


@pytest.mark.parametrize("kernel", ["gather", "compiled"])
@pytest.mark.parametrize(
    ("window", "softcap", "sinks"),
    [(None, None, False), (5, None, False), (None, 30.0, False), (5, 30.0, False), (5, None, True)],
)
def test_reference_attention_equals_dense_attention(
    window: Any, softcap: Any, sinks: bool, kernel: str
) -> None:
    """Decode rows and prefill chunks over scattered blocks, against eager attention on each
    sequence's dense keys (sliding windows and logit softcapping, as Gemma uses; attention
    sinks, as gpt-oss uses). Decode rows either gathered for SDPA or through the compiled
    kernel (kv/decode_attention.py; soft-capped and sink steps keep the gather)."""
    from tuneloop.server.engine.kv import decode_attention
    from tuneloop.server.engine.kv import paged_attention as pa

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, size = 4, 2, 8, 4
    pool = pa.KVPool(
        num_blocks=12, block_size=size, device=torch.device("cpu"), dtype=torch.float32
    )
    # (past tokens, new tokens, blocks): two decode rows, then a chunk with a past, then a fresh one
    layout = [(6, 1, [7, 2]), (2, 1, [5]), (5, 3, [0, 9]), (0, 6, [3, 11])]
    keys = [torch.randn(p + n, kv_heads, dim, generator=gen) for p, n, _ in layout]
    values = [torch.randn(p + n, kv_heads, dim, generator=gen) for p, n, _ in layout]
    k_pool, v_pool = pool.layer(0, keys[0], values[0])
    # Stale memory (a poisoned request's NaNs) in every slot nobody writes below: the padding
    # of the decode rows reads the pad slot, and nothing masked reaches a result.
    k_pool[: pool.pad_slot], v_pool[: pool.pad_slot] = float("nan"), float("nan")

    def slots(blocks: list[int], start: int, end: int) -> torch.Tensor:
        return torch.tensor(
            [blocks[i // size] * size + i % size for i in range(start, end)], dtype=torch.long
        )

    for (past, _, blocks), k, v in zip(layout, keys, values, strict=True):  # the cached past
        k_pool[slots(blocks, 0, past)], v_pool[slots(blocks, 0, past)] = k[:past], v[:past]
    new_k = torch.cat([k[p:] for (p, _, _), k in zip(layout, keys, strict=True)])
    new_v = torch.cat([v[p:] for (p, _, _), v in zip(layout, values, strict=True)])
    n = new_k.shape[0]
    width = max(p + m for p, m, _ in layout[:2])
    decode_slots = torch.full((2, width), pool.pad_slot, dtype=torch.long)
    decode_mask = torch.zeros((2, 1, 1, width), dtype=torch.bool)
    for row, (p, m, blocks) in enumerate(layout[:2]):
        decode_slots[row, : p + m] = slots(blocks, 0, p + m)
        decode_mask[row, 0, 0, : p + m] = True
    prefills = [
        pa.Prefill(2, 3, slots(layout[2][2], 0, 8), 8),
        pa.Prefill(5, 6, slots(layout[3][2], 0, 6), 6),
    ]
    step = pa.PagedStep(
        pool,
        torch.cat([slots(b, p, p + m) for p, m, b in layout]),
        2,
        decode_slots,
        decode_mask,
        prefills,
        decode_kernel=decode_attention.compiled() if kernel == "compiled" else None,
    )
    if kernel == "compiled":  # as the engine does: warmed up first (silences its warnings)
        assert decode_attention.warm_up(heads, kv_heads, dim, dim, 0.3, torch.float32, pool.device)
    query = torch.randn(1, heads, n, dim, generator=gen)
    s_aux = torch.randn(heads, generator=gen) if sinks else None
    module = torch.nn.Module()
    out, _ = pa.paged_attention_forward(
        module,
        query,
        new_k.transpose(0, 1)[None],
        new_v.transpose(0, 1)[None],
        None,
        scaling=0.3,
        paged_step=step,
        sliding_window=window,
        softcap=softcap,
        s_aux=s_aux,
    )
    start = 0
    for (past, new, _), k, v in zip(layout, keys, values, strict=True):
        q = query[0, :, start : start + new]  # [heads, new, d]
        kk = k.transpose(0, 1).repeat_interleave(2, 0)  # [heads, ctx, d]
        vv = v.transpose(0, 1).repeat_interleave(2, 0)
        scores = q @ kk.transpose(1, 2) * 0.3
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(past, past + new)[:, None]
        key_pos = torch.arange(past + new)[None, :]
        allowed = (key_pos <= pos) & ((pos - key_pos < window) if window else True)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if s_aux is not None:  # a per-head logit in every softmax, with no value
            sink = s_aux[:, None, None].expand(heads, new, 1)
            expected = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ vv
        else:
            expected = torch.softmax(scores, -1) @ vv
        assert_near(out[0, start : start + new].transpose(0, 1), expected, 1e-5, "attention")
        start += new


def test_the_cpu_path_never_imports_a_kernel_library_and_sizes_the_pool_by_its_budget() -> None:
    import sys

    from transformers import Qwen3Config

    from tuneloop.server.engine.kv.paged_attention import kernel_available
    from tuneloop.server.engine.memory import kv_bytes_per_token, kv_cache_blocks

    cpu = torch.device("cpu")
    assert not kernel_available(cpu, torch.bfloat16)
    assert "flash_attn" not in sys.modules
    config = Qwen3Config(num_hidden_layers=3, num_key_value_heads=2, head_dim=16)
    assert kv_bytes_per_token(config, torch.float32) == 2 * 3 * 2 * 16 * 4
    assert kv_cache_blocks(config, torch.float32, cpu, 16, 1000) == 62


def test_a_cpu_pool_without_a_configured_budget_takes_a_share_of_free_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """None: CPU_KV_SHARE of MemAvailable over the bytes a token keeps, clamped to
    [CPU_MIN_KV_TOKENS, CPU_MAX_KV_TOKENS]; the floor where free memory cannot be read; a
    configured budget exactly."""
    from transformers import Qwen3Config

    from tuneloop.server.engine import memory

    cpu = torch.device("cpu")
    config = Qwen3Config(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)
    per_token = memory.kv_bytes_per_token(config, torch.bfloat16)
    assert per_token == 2 * 30 * 3 * 64 * 2  # SmolLM2-135M's shape: 23 KB a token
    free = {"bytes": 20 * 2**30}
    monkeypatch.setattr(memory, "free_bytes", lambda device: free["bytes"])
    tokens = memory.kv_cache_tokens(config, torch.bfloat16, cpu, None)
    assert tokens == int(free["bytes"] * memory.CPU_KV_SHARE) // per_token
    assert memory.CPU_MIN_KV_TOKENS < tokens < memory.CPU_MAX_KV_TOKENS
    assert memory.kv_cache_blocks(config, torch.bfloat16, cpu, 16, None) == tokens // 16
    free["bytes"] = 2**30  # a small host: the floor every CPU had before
    assert memory.kv_cache_tokens(config, torch.bfloat16, cpu, None) == memory.CPU_MIN_KV_TOKENS
    free["bytes"] = 2**40  # a tiny model or a huge host: bounded
    assert memory.kv_cache_tokens(config, torch.bfloat16, cpu, None) == memory.CPU_MAX_KV_TOKENS
    assert memory.kv_cache_tokens(config, torch.bfloat16, cpu, 1000) == 1000
    free["bytes"] = None
    assert memory.kv_cache_tokens(config, torch.bfloat16, cpu, None) == memory.CPU_MIN_KV_TOKENS
