"""Samplers (ephemeral snapshots, named checkpoints, the base model) and what asample returns."""

from __future__ import annotations

import asyncio
import math

import numpy as np

from tests.unit.server.harness import (
    Api,
    datum,
    expect_error,
    optim_step,
    sample,
    sample_body,
    sampler,
)
from tuneloop.types import proto

TOKENS = [5, 17, 33, 90, 120, 7, 64, 200]
PROMPT = [5, 17, 33, 90, 120, 7]


async def train_step(api: Api, model_id: str, seq: int) -> int:
    """One forward_backward + optim_step at seq, seq + 1; returns the next free seq."""
    await api.result(await api.forward_backward(model_id, seq, [datum(TOKENS)]))
    await optim_step(api, model_id, seq + 1, lr=0.1)
    return seq + 2


async def snapshot(api: Api, model_id: str, seq: int, sampling_seq: int) -> str:
    body = {"model_id": model_id, "seq_id": seq, "sampling_session_seq_id": sampling_seq}
    done = await api.result(await api.post("save_weights_for_sampler", body))
    assert done.json()["type"] == "save_weights_for_sampler", done.text
    return str(done.json()["sampling_session_id"])


async def prompt_logprobs(api: Api, sampler_id: str, tokens: list[int] = PROMPT) -> np.ndarray:
    out = await sample(api, sampler_id, tokens, max_tokens=1, seed=0, prompt_logprobs=True)
    assert out.prompt_logprobs is not None
    assert out.prompt_logprobs[0] is None
    return np.array(out.prompt_logprobs[1:], dtype=np.float64)


async def test_snapshot_reflects_the_adapter_as_of_its_seq(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    seq = await train_step(api, model_id, 1)
    first = await snapshot(api, model_id, seq, sampling_seq=0)
    assert first == f"{session_id}:sample:0"
    before = await sample(api, first, PROMPT, max_tokens=12, seed=7, prompt_logprobs=True)

    seq = await train_step(api, model_id, seq + 1)
    seq = await train_step(api, model_id, seq)
    after = await sample(api, first, PROMPT, max_tokens=12, seed=7, prompt_logprobs=True)
    assert after.sequences[0].tokens == before.sequences[0].tokens
    assert after.sequences[0].logprobs == before.sequences[0].logprobs
    assert after.prompt_logprobs == before.prompt_logprobs

    second = await snapshot(api, model_id, seq, sampling_seq=1)
    newer = await sample(api, second, PROMPT, max_tokens=12, seed=7, prompt_logprobs=True)
    old_lp = np.array(before.prompt_logprobs[1:], dtype=np.float64)  # type: ignore[index]
    new_lp = np.array(newer.prompt_logprobs[1:], dtype=np.float64)  # type: ignore[index]
    # Training on TOKENS raised the likelihood of the prompt (a prefix of TOKENS).
    assert new_lp.sum() > old_lp.sum() + 0.5


async def test_snapshot_waits_for_its_turn_in_the_model_stream(api: Api) -> None:
    model_id = await api.model(await api.session())
    # The snapshot (seq 3) is sent before the training it must include (seqs 1 and 2).
    body = {"model_id": model_id, "seq_id": 3, "sampling_session_seq_id": 0}
    pending = await api.post("save_weights_for_sampler", body)
    base = await prompt_logprobs(api, await sampler(api, await api.session(), seq=0))
    await train_step(api, model_id, 1)
    sampler_id = (await api.result(pending)).json()["sampling_session_id"]
    assert not np.allclose(await prompt_logprobs(api, sampler_id), base)


async def test_named_sampler_checkpoint_equals_ephemeral_snapshot(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    seq = await train_step(api, model_id, 1)
    saved = await api.result(
        await api.post(
            "save_weights_for_sampler", {"model_id": model_id, "path": "s1", "seq_id": seq}
        )
    )
    path = saved.json()["path"]
    assert path == f"tinker://{model_id}/sampler_weights/s1"
    ephemeral = await snapshot(api, model_id, seq + 1, sampling_seq=0)
    named = await sampler(api, session_id, seq=1, model_path=path)
    assert named == f"{session_id}:sample:1"
    np.testing.assert_allclose(
        await prompt_logprobs(api, named), await prompt_logprobs(api, ephemeral), rtol=1e-6
    )
    info = (await api.get(f"samplers/{named}")).json()
    assert info == {"sampler_id": named, "base_model": "tuneloop/fake-tiny", "model_path": path}

    # A training checkpoint (weights/...) serves as a sampler source too, in another session.
    trained = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "w1", "seq_id": seq + 2})
    )
    elsewhere = await sampler(api, await api.session(), model_path=trained.json()["path"])
    np.testing.assert_allclose(
        await prompt_logprobs(api, elsewhere), await prompt_logprobs(api, ephemeral), rtol=1e-6
    )


async def test_base_model_sampler_equals_untrained_adapter(api: Api) -> None:
    session_id = await api.session()
    base = await sampler(api, session_id, seq=0)
    model_id = await api.model(session_id)
    fresh = await snapshot(api, model_id, 1, sampling_seq=1)
    np.testing.assert_allclose(
        await prompt_logprobs(api, base), await prompt_logprobs(api, fresh), rtol=1e-6
    )
    info = (await api.get(f"samplers/{base}")).json()
    assert info == {"sampler_id": base, "base_model": "tuneloop/fake-tiny", "model_path": None}


async def test_create_sampling_session_is_idempotent_and_conflicts_are_409(api: Api) -> None:
    session_id = await api.session()
    first = await sampler(api, session_id, seq=0)
    assert await sampler(api, session_id, seq=0) == first
    model_id = await api.model(session_id)
    saved = await api.result(
        await api.post("save_weights_for_sampler", {"model_id": model_id, "path": "s", "seq_id": 1})
    )
    body = {
        "session_id": session_id,
        "sampling_session_seq_id": 0,
        "model_path": saved.json()["path"],
    }
    expect_error(await api.post("create_sampling_session", body), 409, "sampling_session_seq_id")


async def test_seeded_sampling_is_deterministic(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    runs = [
        await sample(api, sampler_id, PROMPT, max_tokens=20, seed=seed, stop=[], num_samples=2)
        for seed in (11, 11, 12)
    ]
    assert [s.tokens for s in runs[0].sequences] == [s.tokens for s in runs[1].sequences]
    assert [s.logprobs for s in runs[0].sequences] == [s.logprobs for s in runs[1].sequences]
    assert [s.tokens for s in runs[0].sequences] != [s.tokens for s in runs[2].sequences]
    # Two samples of one request differ from each other.
    assert runs[0].sequences[0].tokens != runs[0].sequences[1].tokens


async def test_num_samples_matches_sequences_and_ids(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    submitted = await api.post(
        "asample", sample_body(sampler_id, PROMPT, max_tokens=3, seed=1, num_samples=5)
    )
    ids = submitted.json()["sample_sequence_ids"]
    assert len(ids) == len(set(ids)) == 5
    out = await sample(api, sampler_id, PROMPT, max_tokens=3, seed=1, num_samples=5)
    assert len(out.sequences) == 5


async def test_every_sampled_token_has_a_logprob(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    out = await sample(api, sampler_id, PROMPT, max_tokens=16, seed=3, stop=[], num_samples=3)
    for seq in out.sequences:
        assert seq.logprobs is not None
        assert len(seq.logprobs) == len(seq.tokens) == 16
        assert all(math.isfinite(lp) and lp <= 0 for lp in seq.logprobs)
        # At temperature 1 each logprob is the model's: scoring the sequence as a prompt agrees.
        scored = await prompt_logprobs(api, sampler_id, PROMPT + seq.tokens)
        np.testing.assert_allclose(scored[len(PROMPT) - 1 :], seq.logprobs, rtol=1e-5, atol=1e-6)


async def test_stop_token_is_included_with_stop_reason_stop(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    free = await sample(api, sampler_id, PROMPT, max_tokens=10, temperature=0.0, stop=[])
    greedy = free.sequences[0].tokens
    assert free.sequences[0].stop_reason == "length"
    assert len(greedy) == 10
    stop_token = greedy[3]
    stopped = await sample(
        api, sampler_id, PROMPT, max_tokens=10, temperature=0.0, stop=[stop_token]
    )
    expected = greedy[: greedy.index(stop_token) + 1]
    assert stopped.sequences[0].tokens == expected
    assert stopped.sequences[0].tokens[-1] == stop_token
    assert stopped.sequences[0].stop_reason == "stop"
    assert stopped.sequences[0].logprobs == free.sequences[0].logprobs[: len(expected)]  # type: ignore[index]


async def test_empty_stop_list_runs_to_max_tokens(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    out = await sample(api, sampler_id, [258], max_tokens=40, seed=5, stop=[], num_samples=4)
    for seq in out.sequences:
        assert seq.stop_reason == "length"
        assert len(seq.tokens) == 40


async def test_default_stop_is_eos(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    out = await sample(api, sampler_id, PROMPT, max_tokens=300, seed=2, num_samples=8)
    for seq in out.sequences:
        if seq.stop_reason == "stop":
            assert seq.tokens[-1] == 258
            assert 258 not in seq.tokens[:-1]
        else:
            assert len(seq.tokens) == 300
            assert 258 not in seq.tokens
    assert any(seq.stop_reason == "stop" for seq in out.sequences)


async def test_prompt_logprobs_entry_zero_is_none(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    out = await sample(api, sampler_id, PROMPT, max_tokens=2, seed=0, prompt_logprobs=True)
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(PROMPT)
    assert out.prompt_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in out.prompt_logprobs[1:])
    without = await sample(api, sampler_id, PROMPT, max_tokens=2, seed=0)
    assert without.prompt_logprobs is None


async def test_topk_prompt_and_sample_logprobs_with_sentinels(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    k = 5
    body = sample_body(
        sampler_id,
        PROMPT,
        max_tokens=6,
        seed=4,
        stop=[],
        prompt_logprobs=True,
        topk_prompt_logprobs=k,
        topk_sample_logprobs=3,
    )
    raw = await api.result(await api.post("asample", body))
    msg = proto.SampleResponseProto()
    msg.ParseFromString(raw.content)
    # On the wire: a dense [P, k] matrix whose first row is all sentinels (token 0, -99999).
    topk = msg.topk_prompt_logprobs
    assert (topk.length, topk.k) == (len(PROMPT), k)
    ids = np.frombuffer(topk.token_ids, dtype="<i4").reshape(len(PROMPT), k)
    lps = np.frombuffer(topk.logprobs, dtype="<f4").reshape(len(PROMPT), k)
    assert (ids[0] == 0).all()
    assert (lps[0] == -99999.0).all()
    assert (lps[1:] > -99999.0).all()

    out = await sample(
        api,
        sampler_id,
        PROMPT,
        max_tokens=6,
        seed=4,
        stop=[],
        prompt_logprobs=True,
        topk_prompt_logprobs=k,
        topk_sample_logprobs=3,
    )
    assert out.topk_prompt_logprobs is not None
    assert out.prompt_logprobs is not None
    assert out.topk_prompt_logprobs[0] is None
    for position, row in enumerate(out.topk_prompt_logprobs[1:], start=1):
        assert row is not None
        assert len(row) == k
        values = [lp for _, lp in row]
        assert values == sorted(values, reverse=True)
        assert len({t for t, _ in row}) == k
        actual = dict(row).get(PROMPT[position])
        assert out.prompt_logprobs[position] <= values[0] + 1e-6  # type: ignore[operator]
        if actual is not None:
            assert math.isclose(actual, out.prompt_logprobs[position], rel_tol=1e-5)  # type: ignore[arg-type]

    seq = out.sequences[0]
    assert seq.topk_logprobs is not None
    assert len(seq.topk_logprobs) == len(seq.tokens)
    for token, lp, row in zip(seq.tokens, seq.logprobs or [], seq.topk_logprobs, strict=True):
        assert row is not None
        assert len(row) == 3
        assert lp <= row[0][1] + 1e-6
        if token in dict(row):
            assert math.isclose(dict(row)[token], lp, rel_tol=1e-5)


async def test_fifty_concurrent_samples_all_complete(api: Api) -> None:
    session_id = await api.session()
    samplers = [await sampler(api, session_id, seq=i) for i in range(3)]

    async def one(i: int) -> int:
        out = await sample(api, samplers[i % 3], PROMPT, max_tokens=4, seed=i, stop=[])
        return len(out.sequences[0].tokens)

    lengths = await asyncio.gather(*(one(i) for i in range(50)))
    assert lengths == [4] * 50


async def test_sample_dedup_on_session_and_seq_id(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    body = sample_body(sampler_id, PROMPT, max_tokens=4, seq_id=1, num_samples=2)
    first = (await api.post("asample", body)).json()
    retry = (await api.post("asample", body)).json()
    assert retry == first
    other_seq = (await api.post("asample", {**body, "seq_id": 2})).json()
    assert other_seq["request_id"] != first["request_id"]
    no_seq = {k: v for k, v in body.items() if k != "seq_id"}
    a = (await api.post("asample", no_seq)).json()
    b = (await api.post("asample", no_seq)).json()
    assert a["request_id"] != b["request_id"]
    done = await api.result(await api.post("asample", body))
    assert done.status_code == 200


async def test_sampling_in_a_finished_session_is_410(api: Api) -> None:
    session_id = await api.session()
    sampler_id = await sampler(api, session_id)
    await api.post(f"sessions/{session_id}/finish", {})
    expect_error(
        await api.post("asample", sample_body(sampler_id, PROMPT, max_tokens=2)), 410, "session_id"
    )


async def test_top_k_and_top_p_truncation(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    greedy = await sample(api, sampler_id, PROMPT, max_tokens=8, temperature=0.0, stop=[])
    for params in ({"top_k": 1}, {"top_p": 1e-6}):
        out = await sample(api, sampler_id, PROMPT, max_tokens=8, seed=9, stop=[], **params)
        assert out.sequences[0].tokens == greedy.sequences[0].tokens, params
    # top_k of the vocabulary size or more truncates nothing: the same as -1 (no limit).
    free = await sample(api, sampler_id, PROMPT, max_tokens=8, seed=9, stop=[], top_k=-1)
    for top_k in (259, 1000):
        out = await sample(api, sampler_id, PROMPT, max_tokens=8, seed=9, stop=[], top_k=top_k)
        assert out.sequences[0].tokens == free.sequences[0].tokens
