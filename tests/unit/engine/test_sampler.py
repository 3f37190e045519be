"""TorchBackend sampling: reported logprobs are the forward's; seeding, stops, snapshots."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import (  # noqa: E402
    EOS,
    TINY,
    VOCAB,
    adapter_spec,
    assert_near,
    example,
    forward,
    max_diff,
    ok,
    seq,
    train,
)
from tuneloop.server.engine.types import (  # noqa: E402
    EngineError,
    Example,
    SampleResult,
    SampleWork,
)

TRAIN_DATA = [example(seq(16, 11)), example(seq(10, 12))]
ALL_TOKENS = np.arange(VOCAB, dtype=np.int64)


def prompt(length: int, seed: int) -> np.ndarray:
    return seq(length, 100 + seed)


def sw(sampler_id: str, tokens: np.ndarray, **kw: Any) -> SampleWork:
    args: dict[str, Any] = {
        "num_samples": 1,
        "max_tokens": 8,
        "temperature": 1.0,
        "top_k": -1,
        "top_p": 1.0,
        "seed": 0,
        "stop_token_ids": (),
        "stop_strings": (),
    }
    args.update(kw)
    return SampleWork(sampler_id, np.asarray(tokens, dtype=np.int64), **args)


def sample(be: Any, works: list[SampleWork]) -> list[SampleResult]:
    return [ok(r) for r in be.sample(works)]


def full_logprobs(be: Any, adapter_id: str, tokens: list[int]) -> np.ndarray:
    """log p(. | tokens[: t + 1]) over the whole vocabulary, [len(tokens), V], via the engine."""
    n = len(tokens)
    ex = Example(np.asarray(tokens, dtype=np.int64), {"target_tokens": np.tile(ALL_TOKENS, (n, 1))})
    return forward(be, adapter_id, [ex])[0]


def sequence_logprobs(be: Any, adapter_id: str, prompt_tokens: np.ndarray, sampled: list[int]):
    """Forward logprobs of every token of prompt + sampled after the first: [P - 1 + S]."""
    full = [*map(int, prompt_tokens), *sampled]
    ex = Example(
        np.asarray(full[:-1], dtype=np.int64),
        {"target_tokens": np.asarray(full[1:], dtype=np.int64)},
    )
    return forward(be, adapter_id, [ex])[0]


@pytest.fixture
def trained(backend) -> Any:
    """Adapters A (all targets) and B (rank 8, no unembed) trained a little, with snapshot
    samplers sA and sB; Z is a fresh adapter (B = 0), "base" a base-model sampler."""
    backend.create_adapter(adapter_spec("A", rank=4, seed=1))
    backend.create_adapter(adapter_spec("B", rank=8, seed=2, train_unembed=False))
    backend.create_adapter(adapter_spec("Z", rank=4, seed=3))
    train(backend, "A", TRAIN_DATA, 3, lr=2e-2)
    train(backend, "B", TRAIN_DATA[1:], 3, lr=2e-2)
    backend.create_sampler("sA", TINY, adapter_id="A")
    backend.create_sampler("sB", TINY, adapter_id="B")
    backend.create_sampler("base", TINY)
    return backend


ADAPTER_OF = {"sA": "A", "sB": "B", "base": "Z"}  # the forward that must agree with a sampler

COMPOSITIONS = {
    "single": [sw("sA", prompt(6, 0), seed=1, prompt_logprobs=True)],
    "mixed": [
        sw("sA", prompt(5, 1), num_samples=3, seed=1, prompt_logprobs=True, topk_sample_logprobs=5),
        sw("sB", prompt(11, 2), temperature=0.7, top_k=20, seed=2, topk_prompt_logprobs=4),
        sw("base", prompt(1, 3), temperature=1.3, top_p=0.9, seed=3, max_tokens=12),
        sw("sA", prompt(3, 4), num_samples=2, temperature=0.0, prompt_logprobs=True),
        sw("sB", prompt(8, 5), num_samples=2, seed=None, top_k=1, prompt_logprobs=True),
    ],
}


# ---- the RL property: sampled logprobs are the training forward's ---------------------------


@pytest.mark.parametrize("composition", sorted(COMPOSITIONS))
def test_sampled_and_prompt_logprobs_equal_forward(trained, composition: str) -> None:
    works = COMPOSITIONS[composition]
    results = sample(trained, works)
    worst = 0.0
    for w, result in zip(works, results, strict=True):
        adapter = ADAPTER_OF[w.sampler_id]
        assert len(result.sequences) == w.num_samples
        for s in result.sequences:
            assert len(s.tokens) == len(s.logprobs) == w.max_tokens
            assert s.stop_reason == "length"
            lp = sequence_logprobs(trained, adapter, w.prompt, s.tokens)
            worst = max(worst, assert_near(s.logprobs, lp[len(w.prompt) - 1 :], 1e-4, "sampled"))
        if w.prompt_logprobs:
            assert result.prompt_logprobs is not None
            assert len(result.prompt_logprobs) == len(w.prompt)
            assert result.prompt_logprobs[0] is None
            lp = sequence_logprobs(trained, adapter, w.prompt, [])
            assert_near(result.prompt_logprobs[1:], lp, 1e-4, "prompt")
        else:
            assert result.prompt_logprobs is None
    print(f"[diff] worst sampled-vs-forward ({composition}): {worst:.3g}")


def test_topk_logprobs_are_sorted_and_hold_the_chosen_token(trained) -> None:
    p = prompt(7, 6)
    [result] = sample(
        trained,
        [sw("sA", p, max_tokens=6, seed=4, topk_prompt_logprobs=VOCAB, topk_sample_logprobs=VOCAB)],
    )
    [s] = result.sequences
    assert s.topk is not None
    assert len(s.topk) == len(s.tokens)
    context = [*map(int, p), *s.tokens]
    dist = full_logprobs(trained, "A", context[:-1])  # [P - 1 + S, V]
    for t, (row, token, lp) in enumerate(zip(s.topk, s.tokens, s.logprobs, strict=True)):
        assert row is not None
        values = [v for _, v in row]
        assert values == sorted(values, reverse=True)
        assert len(row) == VOCAB
        assert dict(row)[token] == pytest.approx(lp, abs=1e-6)
        ids = np.array([i for i, _ in row])
        assert_near(np.array(values), dist[len(p) - 1 + t][ids], 1e-4, "topk sample vs forward")
    prompt_topk = result.topk_prompt_logprobs
    assert prompt_topk is not None
    assert len(prompt_topk) == len(p)
    assert prompt_topk[0] is None
    for t, row in enumerate(prompt_topk[1:], start=1):
        assert row is not None
        values = [v for _, v in row]
        assert values == sorted(values, reverse=True)
        assert dict(row)[int(p[t])] == pytest.approx(float(dist[t - 1][p[t]]), abs=1e-4)

    # A small k keeps the k best of the full list.
    [small] = sample(trained, [sw("sA", p, max_tokens=6, seed=4, topk_sample_logprobs=3)])
    assert small.sequences[0].tokens == s.tokens
    for row_small, row_full in zip(small.sequences[0].topk, s.topk, strict=True):
        assert [i for i, _ in row_small] == [i for i, _ in row_full[:3]]


# ---- seeding, greedy ----------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(trained) -> None:
    target = sw("sA", prompt(5, 7), num_samples=3, max_tokens=12, seed=42)
    alone1 = sample(trained, [target])[0]
    alone2 = sample(trained, [target])[0]
    crowd = sample(
        trained,
        [
            sw("sB", prompt(13, 8), num_samples=2, seed=1),
            target,
            sw("base", prompt(2, 9), seed=None, max_tokens=20),
        ],
    )[1]
    tokens = [s.tokens for s in alone1.sequences]
    assert tokens == [s.tokens for s in alone2.sequences]
    assert tokens == [s.tokens for s in crowd.sequences]
    assert len({tuple(t) for t in tokens}) == 3  # each sample has its own stream
    assert_near(
        [s.logprobs for s in crowd.sequences], [s.logprobs for s in alone1.sequences], 1e-5, "crowd"
    )
    other_seed = sample(trained, [sw("sA", prompt(5, 7), num_samples=3, max_tokens=12, seed=43)])
    assert [s.tokens for s in other_seed[0].sequences] != tokens


def step_tokens(be: Any) -> tuple[list[int], Any]:
    """Tokens of each forward pass of the model's transformer body (a hook; remove it after)."""
    decoder = be._runtimes[TINY].model.get_decoder()
    seen: list[int] = []
    hook = decoder.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(int(kw["input_ids"].shape[1])), with_kwargs=True
    )
    return seen, hook


def test_prompts_prefill_once_and_finished_rows_leave_the_batch(trained) -> None:
    """A request's num_samples share one prefill; a row that stops stops costing."""
    p = prompt(5, 11)
    ref = sample(trained, [sw("sA", p, max_tokens=30, seed=8)])[0].sequences[0].tokens
    works = [
        sw("sA", p, num_samples=4, max_tokens=30, seed=8, stop_token_ids=(ref[3],)),
        sw("sB", prompt(9, 12), num_samples=2, max_tokens=20, seed=3),
    ]
    seen, hook = step_tokens(trained)
    try:
        stopped, full = sample(trained, works)
    finally:
        hook.remove()
    assert seen[0] == 5 + 9  # both prompts once, in one packed forward, not once per sample
    decode_rows = seen[1:]
    # sample 0 (seed 8, as `ref`) stops at the first ref[3] it draws
    assert stopped.sequences[0].tokens == ref[: ref.index(ref[3]) + 1]
    lengths = [len(s.tokens) for s in (*stopped.sequences, *full.sequences)]
    assert min(lengths) < 20  # some rows stopped early
    # decode step t feeds exactly the rows still running after t + 1 tokens
    assert decode_rows == [sum(n > t + 1 for n in lengths) for t in range(19)]
    assert all(len(s.tokens) == 20 for s in full.sequences)


def test_temperature_zero_and_top_k_one_are_greedy(trained) -> None:
    p = prompt(4, 10)
    greedy = sample(trained, [sw("sA", p, max_tokens=10, temperature=0.0, seed=None)])[0]
    top1 = sample(trained, [sw("sA", p, max_tokens=10, top_k=1, seed=5)])[0]
    tokens = greedy.sequences[0].tokens
    assert top1.sequences[0].tokens == tokens
    # Dividing fp32 logits by a temperature this small overflows: greedy too, not NaN draws.
    for tiny in (1e-300, 1e-40, 1e-6):
        cold = sample(trained, [sw("sA", p, max_tokens=10, temperature=tiny, top_p=0.9, seed=5)])
        assert cold[0].sequences[0].tokens == tokens
    dist = full_logprobs(trained, "A", [*map(int, p), *tokens][:-1])[len(p) - 1 :]
    for t, token in enumerate(tokens):
        assert dist[t][token] >= dist[t].max() - 1e-5, (t, token, int(dist[t].argmax()))
    assert len(set(tokens)) > 1  # not a degenerate model


# ---- stop conditions --------------------------------------------------------------------------


def test_stop_token_ids_stop_and_include_the_token(trained) -> None:
    p = prompt(5, 11)
    ref = sample(trained, [sw("sA", p, max_tokens=30, seed=8)])[0].sequences[0].tokens
    stop = ref[6]
    first = ref.index(stop)
    [result] = sample(trained, [sw("sA", p, max_tokens=30, seed=8, stop_token_ids=(stop, 999))])
    s = result.sequences[0]
    assert s.stop_reason == "stop"
    assert s.tokens == ref[: first + 1]
    assert len(s.logprobs) == len(s.tokens)


def test_stop_strings_stop_with_the_string_included(trained) -> None:
    decode = trained._runtimes[TINY].decode
    p = prompt(5, 12)
    ref = sample(trained, [sw("sA", p, max_tokens=60, seed=9)])[0].sequences[0].tokens
    printable = [32 <= t < 127 for t in ref]
    start = next(i for i in range(2, len(ref) - 1) if printable[i] and printable[i + 1])
    stop = decode(ref[start : start + 2])
    assert len(stop) == 2
    end = next(n for n in range(1, len(ref) + 1) if stop in decode(ref[:n]))
    [result] = sample(trained, [sw("sA", p, max_tokens=60, seed=9, stop_strings=("\x00zz", stop))])
    s = result.sequences[0]
    assert s.stop_reason == "stop"
    assert s.tokens == ref[:end]
    assert decode(s.tokens).endswith(stop)


def test_eos_stops_only_when_listed(backend) -> None:
    """An adapter trained to emit EOS: with stop_token_ids=() it runs to max_tokens."""
    backend.create_adapter(adapter_spec("E", seed=4))
    eos_data = [example(np.array([*seq(4, 13), *[EOS] * 8]))]
    eos_data[0].inputs["weights"][:3] = 0.0
    train(backend, "E", eos_data, 12, lr=5e-2)
    backend.create_sampler("sE", TINY, adapter_id="E")
    p = prompt(4, 14)
    [no_stop, stop, eos_str] = sample(
        backend,
        [
            sw("sE", p, max_tokens=10, seed=1),
            sw("sE", p, max_tokens=10, seed=1, stop_token_ids=(EOS,)),
            sw("sE", p, max_tokens=10, seed=1, stop_strings=("<|im_end|>",)),
        ],
    )
    tokens = no_stop.sequences[0].tokens
    assert no_stop.sequences[0].stop_reason == "length"
    assert len(tokens) == 10
    assert EOS in tokens
    first = tokens.index(EOS)
    assert stop.sequences[0].stop_reason == "stop"
    assert stop.sequences[0].tokens == tokens[: first + 1]
    assert eos_str.sequences[0].stop_reason == "stop"  # special tokens decode to their text
    assert eos_str.sequences[0].tokens == tokens[: first + 1]


# ---- sampler snapshots ----------------------------------------------------------------------


def test_snapshot_is_frozen_while_the_adapter_trains(trained) -> None:
    works = [sw("sA", prompt(9, 15), num_samples=2, max_tokens=10, seed=7, prompt_logprobs=True)]
    before = sample(trained, works)[0]
    lp_a = forward(trained, "A", TRAIN_DATA)
    train(trained, "A", TRAIN_DATA, 3, lr=2e-2)
    assert max_diff(forward(trained, "A", TRAIN_DATA), lp_a) > 1e-2  # A did move
    after = sample(trained, works)[0]
    assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]
    assert [s.logprobs for s in after.sequences] == [s.logprobs for s in before.sequences]
    assert after.prompt_logprobs == before.prompt_logprobs

    trained.create_sampler("sA2", TINY, adapter_id="A")
    fresh = sample(trained, [sw("sA2", works[0].prompt, max_tokens=1, prompt_logprobs=True)])[0]
    assert max_diff(fresh.prompt_logprobs[1:], before.prompt_logprobs[1:]) > 1e-2
    lp = sequence_logprobs(trained, "A", works[0].prompt, [])
    assert_near(fresh.prompt_logprobs[1:], lp, 1e-4, "new snapshot prompt")

    # The snapshot outlives its adapter.
    trained.delete_adapter("A")
    assert sample(trained, works)[0].prompt_logprobs == before.prompt_logprobs


def test_base_sampler_equals_an_untrained_adapter(trained) -> None:
    trained.create_sampler("sZ", TINY, adapter_id="Z")
    p = prompt(6, 16)
    base, fresh = sample(
        trained,
        [
            sw("base", p, num_samples=2, max_tokens=10, seed=3, prompt_logprobs=True),
            sw("sZ", p, num_samples=2, max_tokens=10, seed=3, prompt_logprobs=True),
        ],
    )
    assert [s.tokens for s in base.sequences] == [s.tokens for s in fresh.sequences]
    assert_near([s.logprobs for s in base.sequences], [s.logprobs for s in fresh.sequences], 1e-6)
    assert_near(base.prompt_logprobs[1:], fresh.prompt_logprobs[1:], 1e-6, "base vs B=0")
    # ... and differs from a trained adapter's.
    trained_lp = sample(trained, [sw("sA", p, max_tokens=1, prompt_logprobs=True)])[0]
    assert max_diff(trained_lp.prompt_logprobs[1:], base.prompt_logprobs[1:]) > 1e-2


def test_deleted_or_unknown_sampler_fails_alone(trained) -> None:
    trained.delete_sampler("sB")
    results = trained.sample(
        [sw("sB", prompt(3, 17)), sw("sA", prompt(3, 17)), sw("never", prompt(3, 17))]
    )
    for bad in (results[0], results[2]):
        assert isinstance(bad, EngineError)
        assert bad.category == "user"
    assert len(ok(results[1]).sequences[0].tokens) == 8
    # The adapter the deleted sampler came from is still there and trains.
    train(trained, "B", TRAIN_DATA[1:], 1)


# ---- continuous batching ----------------------------------------------------------------------


@pytest.mark.parametrize("prefill_chunk", [256, 3])
def test_requests_join_a_running_decode_batch_and_leave_when_done(
    trained, prefill_chunk: int
) -> None:
    """Requests admitted mid-decode get exactly what they get alone; short ones come back first.

    With a 3-token chunk the joiners' prompts are prefilled a column per step (chunked prefill).
    """
    trained.prefill_chunk = prefill_chunk
    long = sw("sA", prompt(5, 20), num_samples=2, max_tokens=40, seed=1)
    joiners = [
        sw("sB", prompt(12, 21), num_samples=3, max_tokens=4, seed=2),  # longer prompt
        sw("base", prompt(2, 22), max_tokens=6, seed=3, prompt_logprobs=True),
        sw("nope", prompt(3, 23), max_tokens=6, seed=4),  # unknown sampler: fails alone
    ]
    alone = {id(w): sample(trained, [w])[0] for w in (long, *joiners[:2])}
    steps = 0
    order: list[Any] = []
    got: dict[int, Any] = {}

    def admit() -> list[SampleWork]:
        nonlocal steps
        steps += 1
        return joiners if steps == 3 else []

    def deliver(work: SampleWork, result: Any) -> None:
        assert id(work) not in got  # exactly once
        order.append(work)
        got[id(work)] = result

    trained.sample_continuous([long], admit, deliver)
    assert len(got) == 4
    assert isinstance(got[id(joiners[2])], EngineError)
    assert order[-1] is long  # the joiners finished while the long request still ran
    for w in (long, *joiners[:2]):
        mine, ref = got[id(w)], alone[id(w)]
        assert [s.tokens for s in mine.sequences] == [s.tokens for s in ref.sequences]
        # fp32 logprobs: oneDNN blocks a matmul's sums by its rows (on AMX hosts 1.07e-5 apart
        # at logprobs of a few nats), so the bound is relative to their size
        assert_near(
            [s.logprobs for s in mine.sequences],
            [s.logprobs for s in ref.sequences],
            1e-5,
            "lp",
            relative=True,
        )
        assert (
            mine.prompt_logprobs == ref.prompt_logprobs
            or max_diff(mine.prompt_logprobs[1:], ref.prompt_logprobs[1:]) < 1e-5
        )


def test_a_request_over_the_kv_budget_waits_for_the_next_decode_batch(trained) -> None:
    trained.sample_token_budget = 40
    first = sw("sA", prompt(5, 30), max_tokens=20, seed=1)
    second = sw("sA", prompt(5, 31), max_tokens=20, seed=2)
    alone = sample(trained, [second])[0]
    order: list[SampleWork] = []
    admitted = iter([[second]])
    trained.sample_continuous([first], lambda: next(admitted, []), lambda w, r: order.append(w))
    assert order == [first, second]  # 25 + 25 KV tokens > 40: run after, not alongside
    again: list[Any] = []
    trained.sample_continuous([second], list, lambda w, r: again.append(r))
    assert [s.tokens for s in again[0].sequences] == [s.tokens for s in alone.sequences]


def _decoder(be: Any, sampler_id: str, chunk: int) -> Any:
    """The paged decoder of the sampler's model, prefilling `chunk` prompt tokens per step."""
    be.prefill_chunk = chunk
    return be._decoder(be._samplers[sampler_id])


def _admit(be: Any, decoder: Any, work: SampleWork) -> Any:
    key, namespace = be._route(work.sampler_id, be._samplers[work.sampler_id])
    return decoder.admit(work, key, namespace)


def _tokens(result: SampleResult) -> list[list[int]]:
    return [s.tokens for s in result.sequences]


def _idle(be: Any) -> None:
    """Every KV block of the model is back in the pool, none reserved."""
    usage = be.kv_usage()[TINY]
    assert (usage.blocks_used, usage.blocks_reserved) == (0, 0), usage


def test_a_long_joining_prompt_is_prefilled_in_chunks_while_rows_keep_decoding(trained) -> None:
    running = sw("sA", prompt(3, 40), max_tokens=30, seed=1)
    joiner = sw("sB", prompt(24, 41), num_samples=2, max_tokens=3, seed=2)
    decoder = _decoder(trained, "sA", chunk=4)
    first = _admit(trained, decoder, running)
    decoder.step()  # the short prompt, whole: nothing else decodes
    second = _admit(trained, decoder, joiner)
    assert decoder.joining
    assert not second.rows[0].tokens
    prefill_steps = 0
    while decoder.joining:
        before = len(first.rows[0].tokens)
        decoder.step()
        assert len(first.rows[0].tokens) == before + 1  # one token per step, never stalled
        prefill_steps += 1
    assert prefill_steps == 6  # 24 prompt tokens, 4 per step, once for both samples
    results = {}
    while len(decoder):
        results.update({id(req): res for req, res in decoder.step()})
    _idle(trained)
    alone = sample(trained, [joiner])[0]
    assert _tokens(results[id(second)]) == _tokens(alone)
    assert_near(
        [s.logprobs for s in results[id(second)].sequences],
        [s.logprobs for s in alone.sequences],
        1e-5,
        "lp",
    )
    assert len(results[id(first)].sequences[0].tokens) == 30


def test_requests_of_cancelled_samplers_leave_the_batch_wherever_they_are(trained) -> None:
    """Dropped from the decoding rows and from a joining prefill; the other requests still get
    exactly what they get alone, and the cancelled ones' blocks go back to the pool."""
    keep = sw("sA", prompt(4, 50), max_tokens=12, seed=1)
    decoding = sw("sB", prompt(4, 51), num_samples=2, max_tokens=40, seed=2)
    mixed = [sw("sA", prompt(9, 52), max_tokens=5, seed=3), sw("sB", prompt(6, 53), seed=4)]
    alone = {id(w): sample(trained, [w])[0] for w in (keep, mixed[0])}
    got: dict[int, Any] = {}
    steps = 0
    cancelled: frozenset[str] = frozenset()
    joining_when_cancelled: list[int] = []

    def admit() -> list[SampleWork]:
        nonlocal steps, cancelled
        steps += 1
        if steps == 2:
            return mixed  # prefilled 2 tokens per step: still joining at step 3
        if steps == 3:
            decoder = trained._runtimes[TINY].decoder
            joining_when_cancelled.append(len(decoder.joining))
            cancelled = frozenset({"sB"})  # mid-prefill for mixed[1], mid-decode for `decoding`
        return []

    def deliver(work: SampleWork, result: Any) -> None:
        assert id(work) not in got
        got[id(work)] = result

    trained.prefill_chunk = 2
    trained.sample_continuous([keep, decoding], admit, deliver, lambda: cancelled)
    assert joining_when_cancelled == [2]
    assert len(got) == 4
    for w in (decoding, mixed[1]):
        assert isinstance(got[id(w)], EngineError)
        assert "cancelled" in str(got[id(w)])
    for w in (keep, mixed[0]):
        assert _tokens(got[id(w)]) == _tokens(alone[id(w)])
    _idle(trained)
    # a cancelled sampler's new requests are refused at the door
    late: list[Any] = []
    trained.sample_continuous(
        [sw("sB", prompt(3, 54))], list, lambda w, r: late.append(r), lambda: {"sB"}
    )
    assert isinstance(late[0], EngineError)


def test_a_far_longer_joiner_costs_its_own_blocks_only(trained) -> None:
    """No padding: a 60-token prompt joining 4-token rows holds its own blocks, the short rows
    keep theirs, and all decode in the same forward passes."""
    short = [sw("sA", prompt(4, 60 + i), max_tokens=16, seed=i) for i in range(3)]
    long = sw("sB", prompt(60, 70), max_tokens=4, seed=9)
    alone = {id(w): sample(trained, [w])[0] for w in (*short, long)}
    trained._runtimes[TINY].decoder = None  # a fresh pool: no prefix cached from the above
    trained.kv_block_size = 4
    used: list[int] = []
    admitted = iter([[], [long]])

    def admit() -> list[SampleWork]:
        used.append(trained.kv_usage()[TINY].blocks_used)
        return next(admitted, [])

    seen, hook = step_tokens(trained)
    got: dict[int, Any] = {}
    try:
        trained.sample_continuous(short, admit, lambda w, r: got.update({id(w): r}))
    finally:
        hook.remove()
    for w in (*short, long):
        assert _tokens(got[id(w)]) == _tokens(alone[id(w)])
    # step 2 (after admit 2) prefills the long prompt with the 3 short rows' tokens
    assert seen[2] == 3 + 60
    # while both decode: 3 short rows of 4 + t tokens and the long row of 60 + t, blocks of 4
    t = 2  # tokens each short row had sampled when the long prompt was scheduled
    assert used[3] == 3 * -(-(4 + t + 1) // 4) + -(-(60 + 1) // 4)
    _idle(trained)


def test_a_row_that_stops_gives_its_blocks_back_at_once(trained) -> None:
    trained.kv_block_size = 4
    decoder = _decoder(trained, "sA", chunk=256)
    long = sw("sA", prompt(30, 80), max_tokens=1, seed=1)
    short = sw("sA", prompt(3, 81), max_tokens=6, seed=2)
    _admit(trained, decoder, long)
    _admit(trained, decoder, short)
    decoder.step()  # both prompts
    assert decoder.usage().blocks_used == 8 + 1
    decoder.step()  # the long request's only token: it leaves
    assert len(decoder.rows) == 1
    assert decoder.usage().blocks_used == 1  # the short row's 3 prompt tokens and its first
    results = {}
    while len(decoder):
        results.update({id(req.work): res for req, res in decoder.step()})
    _idle(trained)
    assert _tokens(results[id(short)]) == _tokens(sample(trained, [short])[0])
