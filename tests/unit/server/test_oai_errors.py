"""Errors of the OpenAI-compatible routes: OpenAI's shape, the right status, the parameter named,
another tenant's models unseen; the server keeps serving after each."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.unit.server.harness import sampler
from tests.unit.server.oai_client import BASE, MODEL, OaiWorld, oai_world
from tuneloop.server.scheduler.futures import Outcome

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[OaiWorld]:
    async with oai_world(tmp_path) as built:
        yield built


def _error(response: Any, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"]
    return error


CHAT_400: list[tuple[dict[str, Any], str]] = [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"max_completion_tokens": 10**6}, "max_tokens"),
    ({"top_k": 0}, "top_k"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"bogus": 1}, "bogus"),
    ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "1", "tool_call_id": "a"}]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
    ),
    (
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
        "messages[0].tool_calls",
    ),
    ({"model": ""}, "model"),
]


async def test_bad_chat_parameters_are_400s_naming_them(world: OaiWorld) -> None:
    for change, param in CHAT_400:
        body = {"model": MODEL, "messages": HI, "max_tokens": 2, **change}
        error = _error(await world.post("chat/completions", body), 400, param)
        assert error["type"] == "invalid_request_error"
    # The official client raises BadRequestError with the same body.
    with pytest.raises(openai.BadRequestError) as raised:
        await world.client.chat.completions.create(
            model=MODEL,
            messages=HI,
            presence_penalty=1.0,  # type: ignore[arg-type]
        )
    assert raised.value.param == "presence_penalty"


async def test_no_op_values_of_unsupported_parameters_are_accepted(world: OaiWorld) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None},
            {"role": "user", "content": "again"},
        ],
        "max_completion_tokens": 3,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "user": "someone",
        "store": False,
        "metadata": {"k": "v"},
        "parallel_tool_calls": True,
    }
    response = await world.post("chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 3


COMPLETION_400: list[tuple[dict[str, Any], str]] = [
    ({"prompt": [300, 1]}, "prompt"),  # outside the fake model's vocabulary (259)
    ({"prompt": [[1, 2], [-1]]}, "prompt[1]"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [1] * 2048}, "prompt"),  # fills the context
    ({"logprobs": 50}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
]


async def test_bad_completion_parameters_are_400s_naming_them(world: OaiWorld) -> None:
    for change, param in COMPLETION_400:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **change}
        _error(await world.post("completions", body), 400, param)


async def test_bodies_that_are_not_json_or_not_objects(world: OaiWorld) -> None:
    headers = {"authorization": f"Bearer {world.api.key}", "content-type": "application/json"}
    for raw in (b"{", b"[]", b"null", b'"x"'):
        response = await world.api.http.post(
            "/oai/api/v1/chat/completions", content=raw, headers=headers
        )
        assert response.status_code == 400, (raw, response.text)
        assert "error" in response.json()


async def test_unknown_models_are_404s_naming_nothing_but_the_input(world: OaiWorld) -> None:
    for model in (
        "no/such-model",
        "tinker://run-x/sampler_weights/nope",
        "tuneloop/fake-tiny;tinker://run-x/sampler_weights/nope",
        "nope;tinker://run-x/sampler_weights/nope",
        "s-1:sample:0",
    ):
        error = _error(
            await world.post("chat/completions", {"model": model, "messages": HI}), 404, "model"
        )
        assert error["type"] == "not_found_error"
        assert error["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        await world.client.completions.create(model="no/such-model", prompt="x")
    _error(await world.post("completions", {"model": "tinker://bad", "prompt": "x"}), 400, "model")


async def test_bad_keys_are_401s(world: OaiWorld) -> None:
    body = {"model": MODEL, "messages": HI}
    error = _error(await world.post("chat/completions", body, key="tml-wrong"), 401, "X-API-Key")
    assert error["type"] == "authentication_error"
    no_key = await world.api.http.post("/oai/api/v1/chat/completions", json=body)
    _error(no_key, 401, "X-API-Key")
    wrong = openai.AsyncOpenAI(
        api_key="tml-wrong", base_url=str(world.client.base_url), http_client=world.api.http
    )
    with pytest.raises(openai.AuthenticationError):
        await wrong.models.list()
    # The rest of the API keeps its own error shape.
    tinker = await world.api.http.post("/api/v1/create_session", json={})
    assert tinker.status_code == 401
    assert tinker.json()["field"] == "X-API-Key"


async def test_another_tenants_checkpoints_and_samplers_are_404s(world: OaiWorld) -> None:
    api = world.api
    session_id = await api.session()
    model_id = await api.model(session_id)
    saved = await api.result(
        await api.post("save_weights_for_sampler", {"model_id": model_id, "path": "a", "seq_id": 1})
    )
    path = saved.json()["path"]
    own_sampler = await sampler(api, session_id)
    for model in (path, own_sampler, f"{MODEL};{path}"):
        ok = await world.client.completions.create(model=model, prompt="x", max_tokens=1)
        assert ok.choices
        with pytest.raises(openai.NotFoundError) as raised:
            await world.bob.completions.create(model=model, prompt="x", max_tokens=1)
        assert raised.value.param == "model"
        # The answer names what bob sent, nothing else of alice's.
        answer = str(raised.value.body)
        for sent in model.split(";"):
            answer = answer.replace(sent, "")
        assert model_id not in answer


async def test_the_in_flight_quota_applies(tmp_path: Path) -> None:
    async with oai_world(tmp_path, max_inflight=1) as world:
        futures = world.state.futures
        held = futures.create("alice", "Sample")  # one request of alice's in flight
        response = await world.post("completions", {"model": MODEL, "prompt": "x"})
        error = _error(response, 429, "max_inflight")
        assert error["type"] == "rate_limit_error"
        assert int(response.headers["retry-after"]) >= 1
        assert futures.pending("alice") == 1  # the refused request left nothing behind
        assert len(world.app.state.oai_samplers) == 0
        futures.resolve(held, Outcome(b"{}", "application/json"))
        ok = await world.post("completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200, ok.text


async def test_oversize_body_is_a_413_in_openais_shape(tmp_path: Path) -> None:
    async with oai_world(tmp_path, max_request_bytes=2048) as world:
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 4000}]}
        response = await world.api.http.post(
            f"{BASE}/chat/completions",
            json=big,
            headers={"authorization": f"Bearer {world.api.key}"},
        )
        _error(response, 413, "body")
        reply = await world.client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
        assert reply.choices
