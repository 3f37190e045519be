"""The OpenAI-compatible routes on the fake backend, driven by the official `openai` client:
responses, parameters, streaming framing, checkpoints as models, metering, the sampler cache."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from tests.unit.server.harness import sample, sampler
from tests.unit.server.oai_client import MODEL, OaiWorld, oai_world
from tests.unit.server.test_sampling import snapshot, train_step

HI = [{"role": "user", "content": "hi there"}]
PROMPT = [5, 17, 33, 90, 120, 7]


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[OaiWorld]:
    async with oai_world(tmp_path) as built:
        yield built


async def test_chat_completion_shape_usage_and_seeded_choices(world: OaiWorld) -> None:
    reply = await world.client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, n=3, seed=11
    )
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in reply.choices)
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
    assert all(c.logprobs is None for c in reply.choices)
    # The prompt is the model's chat template (the byte-level tokenizer: one token per byte).
    rendered = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    specials = 2 * len("<|im_start|>") + len("<|im_end|>")
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(rendered.encode()) - specials + 3
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.completion_tokens >= len(reply.choices)
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1  # n samples, each with its own stream
    again = await world.client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, n=3, seed=11
    )
    assert [c.message.content for c in again.choices] == texts  # deterministic given seed
    other = await world.client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, n=3, seed=12
    )
    assert [c.message.content for c in other.choices] != texts


async def test_completions_take_text_or_token_prompts_and_report_logprobs(world: OaiWorld) -> None:
    reply = await world.client.completions.create(
        model=MODEL, prompt=[PROMPT, [5, 6, 7]], n=2, max_tokens=6, seed=3, logprobs=3
    )
    assert reply.object == "text_completion"
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]  # prompt-major, as OpenAI orders
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(PROMPT) + 3
    for choice in reply.choices:
        lp = choice.logprobs
        assert lp is not None
        assert lp.tokens is not None
        assert lp.token_logprobs is not None
        assert lp.top_logprobs is not None
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
        assert all(0 < len(top) <= 3 for top in lp.top_logprobs)
        assert all(x <= 0 for x in lp.token_logprobs)
        assert lp.text_offset == sorted(lp.text_offset or [])
    text = await world.client.completions.create(model=MODEL, prompt="abc", max_tokens=5)
    assert text.usage is not None
    assert text.usage.prompt_tokens == 3
    assert text.usage.completion_tokens <= 5
    # Without max_tokens, /completions writes 16 tokens at most, as OpenAI's does.
    default = await world.client.completions.create(model=MODEL, prompt="abc", seed=1)
    assert default.usage is not None
    assert default.usage.completion_tokens <= 16


async def test_logprobs_equal_the_samplers_for_a_trained_adapter(world: OaiWorld) -> None:
    api = world.api
    session_id = await api.session()
    model_id = await api.model(session_id)
    seq = await train_step(api, model_id, 1)
    seq = await train_step(api, model_id, seq)
    done = await api.result(
        await api.post(
            "save_weights_for_sampler", {"model_id": model_id, "path": "s1", "seq_id": seq}
        )
    )
    path = done.json()["path"]
    reference = await sample(
        api,
        await sampler(api, session_id, 1, model_path=path),
        PROMPT,
        max_tokens=10,
        seed=5,
        stop=[],
        topk_sample_logprobs=2,
    )
    expected = reference.sequences[0]
    for model in (path, f"{MODEL};{path}"):
        reply = await world.client.completions.create(
            model=model, prompt=PROMPT, max_tokens=10, seed=5, logprobs=2
        )
        lp = reply.choices[0].logprobs
        assert lp is not None
        assert lp.token_logprobs is not None
        n = len(lp.token_logprobs)
        assert n > 0
        assert lp.token_logprobs == pytest.approx(
            expected.logprobs[:n], abs=1e-6
        )  # float32 on the wire
        assert expected.topk_logprobs is not None
        assert lp.top_logprobs is not None
        # Keyed by token text, which two byte tokens may share: compare the likeliest of each.
        best = [row[0][1] for row in expected.topk_logprobs[:n] if row is not None]
        assert [max(t.values()) for t in lp.top_logprobs] == pytest.approx(best, abs=1e-6)
    # The adapter changed what the model says: the base model answers differently.
    base = await world.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, seed=5, logprobs=0
    )
    assert base.choices[0].logprobs is not None
    assert base.choices[0].logprobs.token_logprobs != lp.token_logprobs


async def test_stop_sequences_cut_the_text_and_end_with_stop(world: OaiWorld) -> None:
    free = await world.client.completions.create(
        model=MODEL, prompt="hello", max_tokens=16, seed=9, temperature=1.0
    )
    text = free.choices[0].text
    # Not a character of a special token's name: the engine sees those in its stop check.
    specials = "<|endoftext|><|im_start|><|im_end|>\ufffd"
    stop = next(ch for ch in text[2:] if ch not in specials)
    cut = await world.client.completions.create(
        model=MODEL, prompt="hello", max_tokens=16, seed=9, stop=[stop, "zzzz"]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    chat = await world.client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=16, seed=9, stop=stop
    )
    assert stop not in (chat.choices[0].message.content or "")


async def test_a_streamed_chat_is_openai_chunks_ending_with_done(world: OaiWorld) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 12, "seed": 4, "n": 2}
    whole = (await world.post("chat/completions", body)).json()
    events = await world.events(
        "chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert len({e["id"] for e in events}) == 1
    first = events[0]
    assert [c["delta"] for c in first["choices"]] == [{"role": "assistant", "content": ""}] * 2
    *chunks, last = events
    assert last["choices"] == []
    assert last["usage"] == whole["usage"]
    assert all(e["usage"] is None for e in chunks)
    for index in (0, 1):
        parts = [c for e in chunks for c in e["choices"] if c["index"] == index]
        content = "".join(c["delta"].get("content") or "" for c in parts)
        assert content == whole["choices"][index]["message"]["content"]
        finishes = [c["finish_reason"] for c in parts if c["finish_reason"]]
        assert finishes == [whole["choices"][index]["finish_reason"]]
    # Without include_usage no chunk carries a usage field.
    plain = await world.events("chat/completions", body)
    assert all("usage" not in e for e in plain)


async def test_a_streamed_completion_with_logprobs(world: OaiWorld) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "seed": 2, "logprobs": 1}
    whole = (await world.post("completions", body)).json()["choices"][0]
    events = await world.events("completions", body)
    choices = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == whole["text"]
    streamed = [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    # The official client reads the same stream.
    stream = await world.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, seed=2, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == whole["text"]


async def test_a_sampling_session_is_a_model_and_its_usage_is_metered(world: OaiWorld) -> None:
    api = world.api
    session_id = await api.session()
    sampler_id = await sampler(api, session_id)
    reply = await world.client.chat.completions.create(
        model=sampler_id, messages=HI, max_tokens=5, n=2
    )
    assert reply.usage is not None
    usage = (await api.get("usage", params={"session_id": session_id})).json()
    sample_usage = usage["by_operation"]["sample"]
    assert sample_usage["requests"] == 1
    assert sample_usage["prefill_tokens"] == reply.usage.prompt_tokens
    assert sample_usage["sampled_tokens"] == reply.usage.completion_tokens
    # Base models and checkpoints are metered too, to the tenant (session "oai").
    before = (await api.get("usage")).json()["totals"]
    other = await world.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    after = (await api.get("usage")).json()["totals"]
    assert other.usage is not None
    assert after["requests"] == before["requests"] + 1
    assert after["prefill_tokens"] - before["prefill_tokens"] == other.usage.prompt_tokens
    assert after["sampled_tokens"] - before["sampled_tokens"] == other.usage.completion_tokens
    bob = (await api.http.get("/api/v1/usage", headers={"x-api-key": world.bob_key})).json()
    assert bob["totals"]["requests"] == 0


async def test_models_lists_the_served_models(world: OaiWorld) -> None:
    models = [m.id async for m in world.client.models.list()]
    assert models == [MODEL]
    health = await world.api.http.get("/oai/api/v1/health")  # readiness needs no key
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "models": [MODEL]}


async def test_samplers_are_cached_per_model_bounded_and_freed(world: OaiWorld) -> None:
    api = world.api
    cache = world.app.state.oai_samplers
    backend = world.state.engine.backend
    cache.limit = 2
    session_id = await api.session()
    model_id = await api.model(session_id)
    paths = []
    for i in range(3):
        seq = await train_step(api, model_id, 1 + 3 * i)
        body = {"model_id": model_id, "path": f"c{i}", "seq_id": seq}
        paths.append((await api.result(await api.post("save_weights_for_sampler", body))).json())
    for _ in range(2):  # the second round reuses the cached samplers
        await world.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert len(cache) == 1
    for done in paths:
        await world.client.completions.create(model=done["path"], prompt=PROMPT, max_tokens=2)
    assert len(cache) == 2  # the least recently used went
    await asyncio.gather(*cache._deleting)  # freed on the engine thread, nobody waits for it
    held = cache.sampler_ids()
    assert all(s in backend._samplers for s in held)
    assert sum(s.startswith("oai:") for s in backend._samplers) == 2
    # The same model for another tenant is another sampler: nothing is shared across tenants.
    await world.bob.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert len(set(cache.sampler_ids())) == 2
    assert cache.sampler_ids()[-1] not in held
    await cache.close()
    assert not any(s.startswith("oai:") for s in backend._samplers)


async def test_a_finished_session_sampler_is_gone(world: OaiWorld) -> None:
    api = world.api
    session_id = await api.session()
    sampler_id = await sampler(api, session_id)
    assert (await api.post(f"sessions/{session_id}/finish", {})).status_code == 200
    with pytest.raises(openai.APIStatusError) as error:
        await world.client.chat.completions.create(model=sampler_id, messages=HI, max_tokens=2)
    assert error.value.status_code == 410


async def test_snapshot_sessions_follow_their_adapter(world: OaiWorld) -> None:
    # An ephemeral snapshot (save_weights_for_sampler without a path) is usable by its id.
    api = world.api
    session_id = await api.session()
    model_id = await api.model(session_id)
    seq = await train_step(api, model_id, 1)
    sampler_id = await snapshot(api, model_id, seq, 3)
    reply = await world.client.completions.create(
        model=sampler_id, prompt=PROMPT, max_tokens=6, seed=1, logprobs=0
    )
    reference = await sample(api, sampler_id, PROMPT, max_tokens=6, seed=1, stop=[])
    lp = reply.choices[0].logprobs
    assert lp is not None
    assert lp.token_logprobs is not None
    expected = reference.sequences[0].logprobs[: len(lp.token_logprobs)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-6)  # float32 on the wire
