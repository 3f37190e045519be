"""The official `openai` client against a real `tuneloop serve` (torch engine, the tiny built-in
model): chat, completions, streaming, logprobs of a fine-tuned adapter equal to the SDK's, n,
stop, errors, isolation between tenants, and usage metered."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

import tuneloop
from tuneloop import AdamParams, Datum, ModelInput, SamplingParams
from tuneloop._local_server import LiveServer, create_key, live_server

pytestmark = pytest.mark.integration
TINY = "tuneloop/tiny-qwen3"
TOKENS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10]
PROMPT = TOKENS[:6]
HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the server's torch: a shared 2-core machine
    try:
        with live_server(tmp_path_factory.mktemp("oai"), backend="torch", models=(TINY,)) as server:
            yield server
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def _client(live: LiveServer, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        api_key=key or live.key, base_url=f"{live.url}/oai/api/v1", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[openai.OpenAI]:
    with _client(live) as oai:
        yield oai


@dataclass
class Trained:
    path: str  # tinker://.../sampler_weights/s1
    sampler: tuneloop.SamplingClient
    tokenizer: Any


@pytest.fixture(scope="module")
def trained(live: LiveServer) -> Iterator[Trained]:
    service = tuneloop.ServiceClient(base_url=live.url, api_key=live.key)
    try:
        training = service.create_lora_training_client(TINY, rank=4, seed=7)
        datum = Datum(
            model_input=ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={"target_tokens": TOKENS[1:]},
        )
        for _ in range(3):
            training.forward_backward([datum], "cross_entropy")
            training.optim_step(AdamParams(learning_rate=0.05))
        path = training.save_weights_for_sampler("s1").result(timeout=120).path
        sampler = service.create_sampling_client(model_path=path)
        yield Trained(path, sampler, training.get_tokenizer())
    finally:
        service.close()


def test_chat_and_its_stream(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=TINY, messages=HI, max_tokens=16, seed=3)
    content = reply.choices[0].message.content
    assert isinstance(content, str)
    assert reply.usage is not None
    assert reply.usage.completion_tokens <= 16
    chunks = list(
        client.chat.completions.create(
            model=TINY,
            messages=HI,
            max_tokens=16,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == content
    assert deltas[-1].finish_reason == reply.choices[0].finish_reason
    # The torch engine streams token by token: more chunks than the role and the end.
    assert len(deltas) > 3
    assert chunks[-1].usage == reply.usage


def test_completions_logprobs_of_a_fine_tuned_adapter_equal_the_sdks(
    client: openai.OpenAI, trained: Trained
) -> None:
    reply = client.completions.create(
        model=trained.path, prompt=PROMPT, max_tokens=12, seed=5, logprobs=2
    )
    lp = reply.choices[0].logprobs
    assert lp is not None
    assert lp.token_logprobs is not None
    assert lp.top_logprobs is not None
    sequence = (
        trained.sampler.sample(
            ModelInput.from_ints(PROMPT), 1, SamplingParams(max_tokens=12, seed=5)
        )
        .result(timeout=120)
        .sequences[0]
    )
    n = len(lp.token_logprobs)
    assert n > 0
    assert sequence.logprobs is not None
    # The same engine numbers (float32 on the SDK's wire).
    assert lp.token_logprobs == pytest.approx(sequence.logprobs[:n], abs=1e-6)
    assert reply.choices[0].text == trained.tokenizer.decode(
        sequence.tokens[:n], skip_special_tokens=True
    )
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    # And what a forward pass of the adapter gives for those tokens.
    forward = trained.sampler.compute_logprobs(
        ModelInput.from_ints(PROMPT + sequence.tokens[:n])
    ).result(timeout=120)
    assert lp.token_logprobs == pytest.approx(forward[len(PROMPT) :], abs=1e-4)
    # Chat with the adapter reports numbers too (never nulls).
    chat = client.chat.completions.create(
        model=trained.path, messages=HI, max_tokens=6, logprobs=True, top_logprobs=2
    )
    entries = chat.choices[0].logprobs
    assert entries is not None
    assert entries.content
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries.content)


def test_n_seed_and_stop(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=TINY, prompt="Hello", max_tokens=12, n=3, seed=8)
    texts = [c.text for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len(set(texts)) > 1
    again = client.completions.create(model=TINY, prompt="Hello", max_tokens=12, n=3, seed=8)
    assert [c.text for c in again.choices] == texts
    text = texts[0]
    stop = next(ch for ch in text[1:] if ch.isprintable() and ch != "\ufffd")
    cut = client.completions.create(model=TINY, prompt="Hello", max_tokens=12, seed=8, stop=stop)
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_errors_and_another_tenants_checkpoint(
    live: LiveServer, client: openai.OpenAI, trained: Trained
) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no/such-model", messages=HI)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=TINY, messages=HI, temperature=9)
    assert bad.value.param == "temperature"
    with _client(live, "tml-not-a-key") as stranger, pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    with _client(live, create_key(live.data_dir, "bob")) as bob:
        with pytest.raises(openai.NotFoundError) as theirs:
            bob.completions.create(model=trained.path, prompt=PROMPT, max_tokens=2)
        assert theirs.value.param == "model"
        assert [m.id for m in bob.models.list()] == [TINY]
    # The server keeps serving.
    assert client.completions.create(model=TINY, prompt=PROMPT, max_tokens=2).choices


def test_usage_is_metered_to_the_tenant(live: LiveServer, client: openai.OpenAI) -> None:
    def totals() -> dict[str, int]:
        response = httpx.get(
            f"{live.url}/api/v1/usage", headers={"x-api-key": live.key}, timeout=30
        )
        assert response.status_code == 200, response.text
        counts: dict[str, int] = response.json()["totals"]
        return counts

    before = totals()
    reply = client.chat.completions.create(model=TINY, messages=HI, max_tokens=8, n=2)
    after = totals()
    assert reply.usage is not None
    assert after["requests"] == before["requests"] + 1
    assert after["prefill_tokens"] - before["prefill_tokens"] == reply.usage.prompt_tokens
    assert after["sampled_tokens"] - before["sampled_tokens"] == reply.usage.completion_tokens


def test_readiness(live: LiveServer) -> None:
    assert httpx.get(f"{live.url}/oai/api/v1/health", timeout=30).status_code == 200
