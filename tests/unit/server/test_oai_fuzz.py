"""Valid-looking OpenAI requests in many combinations (the schema fuzz in tests/fuzz rarely gets
past validation with this many parameters): never a 5xx, and every answer is whole: one choice
per prompt and sample, usage adding up, streams ending with [DONE]."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.server.oai_client import MODEL, OaiWorld, oai_world

TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
COMMON = {
    "max_tokens": st.integers(1, 12),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.sampled_from([-1, 1, 5, 300]),
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(TEXT.filter(bool), st.lists(TEXT.filter(bool), max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "user": TEXT,
    "presence_penalty": st.just(0),
}
CHAT = {**COMMON, "logprobs": st.just(True), "top_logprobs": st.integers(0, 5)}
COMPLETION = {**COMMON, "logprobs": st.integers(0, 5), "echo": st.just(False)}


def _some(options: dict[str, Any]) -> Any:
    keys = st.lists(st.sampled_from(sorted(options)), unique=True)
    return keys.flatmap(lambda chosen: st.fixed_dictionaries({k: options[k] for k in chosen}))


MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": TEXT}
    ),
    min_size=1,
    max_size=4,
)
PROMPTS = st.one_of(
    TEXT.filter(bool),
    st.lists(st.integers(0, 258), min_size=1, max_size=8),
    st.lists(TEXT.filter(bool), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, 258), min_size=1, max_size=5), min_size=1, max_size=3),
)


async def _check(world: OaiWorld, route: str, body: dict[str, Any], prompts: int) -> None:
    response = await world.post(route, body)
    assert response.status_code in (200, 400), (response.status_code, response.text)
    if response.status_code == 400:
        assert response.json()["error"]["param"], response.text
        return
    n = body.get("n", 1)
    if body.get("stream"):
        frames = response.text.split("\n\n")
        assert frames[-2:] == ["data: [DONE]", ""], frames[-3:]
        events = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
        finished = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert sorted(finished) == list(range(prompts * n))
        if body.get("stream_options"):
            usage = events[-1]["usage"]
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        return
    reply = response.json()
    assert [c["index"] for c in reply["choices"]] == list(range(prompts * n))
    usage = reply["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] <= prompts * n * body.get("max_tokens", 16)


async def test_many_valid_chat_and_completion_requests(tmp_path: Path) -> None:
    async with oai_world(tmp_path) as world:
        fuzz = settings(
            max_examples=60,
            database=None,
            derandomize=True,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )

        @fuzz
        @given(messages=MESSAGES, params=_some(CHAT))
        def chats(messages: list[dict[str, str]], params: dict[str, Any]) -> None:
            body = {"model": MODEL, "messages": messages, "max_tokens": 8, **params}
            cases.append(("chat/completions", body, 1))

        @fuzz
        @given(prompt=PROMPTS, params=_some(COMPLETION))
        def completions(prompt: Any, params: dict[str, Any]) -> None:
            count = 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)
            cases.append(("completions", {"model": MODEL, "prompt": prompt, **params}, count))

        # Drawn first (hypothesis runs synchronously), then sent on this test's event loop.
        cases: list[tuple[str, dict[str, Any], int]] = []
        chats()
        completions()
        for route, body, prompts in cases:
            await _check(world, route, body, prompts)
        health = await world.api.http.get("/oai/api/v1/health")
        assert health.status_code == 200
