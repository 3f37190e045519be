"""Wire helpers for driving an in-process server over HTTP as a tenant."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tuneloop.server.app import create_app
from tuneloop.server.config import ServerConfig
from tuneloop.server.storage.keys import KeyStore
from tuneloop.types import Datum, ModelInput, SampleResponse
from tuneloop.types.codec import (
    ForwardBackwardRequest,
    decode_forward_backward_output,
    decode_sample_response,
    encode_forward_backward_request,
)

MODEL = "tuneloop/fake-tiny"
PROTO = {"content-type": "application/x-protobuf"}


@dataclass
class Api:
    """A tenant's view of the server: raw HTTP plus the few steps every test repeats."""

    http: httpx.AsyncClient
    key: str
    keys: KeyStore

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {"x-api-key": self.key, **(extra or {})}

    async def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return await self.http.post(f"/api/v1/{path}", json=body, headers=self.headers(), **kw)

    async def get(self, path: str, **kw: Any) -> httpx.Response:
        return await self.http.get(f"/api/v1/{path}", headers=self.headers(), **kw)

    async def result(self, response: httpx.Response) -> httpx.Response:
        """Follow a future to its result, re-polling on 408 like the SDKs do."""
        assert response.status_code == 200, response.text
        request_id = response.json()["request_id"]
        for _ in range(50):
            polled = await self.post("retrieve_future", {"request_id": request_id})
            if polled.status_code != 408:
                return polled
        raise AssertionError("future never completed")

    async def session(self) -> str:
        response = await self.post("create_session", {"tags": [], "sdk_version": "test"})
        assert response.status_code == 200, response.text
        return str(response.json()["session_id"])

    async def model(self, session_id: str, seq: int = 0, rank: int = 4, seed: int = 0) -> str:
        body = {
            "session_id": session_id,
            "model_seq_id": seq,
            "base_model": MODEL,
            "lora_config": {"rank": rank, "seed": seed},
        }
        done = await self.result(await self.post("create_model", body))
        return str(done.json()["model_id"])

    async def forward_backward(
        self,
        model_id: str,
        seq_id: int,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        config: dict[str, float | str] | None = None,
        forward_only: bool = False,
    ) -> httpx.Response:
        body = encode_forward_backward_request(
            ForwardBackwardRequest(model_id, seq_id, data, loss_fn, config or {}, forward_only)
        )
        return await self.http.post(
            "/api/v1/forward_backward", content=body, headers=self.headers(PROTO)
        )


def datum(tokens: list[int], **inputs: Any) -> Datum:
    """A next-token datum: input tokens[:-1], targets tokens[1:], plus any extra inputs."""
    inputs.setdefault("target_tokens", np.asarray(tokens[1:], dtype=np.int64))
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


decode_output = decode_forward_backward_output
decode_sample = decode_sample_response


def expect_error(response: httpx.Response, status: int, field: str | None) -> dict[str, Any]:
    """A 4xx error body that names `field` and says what went wrong; never retried."""
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert body["field"] == field, body
    assert isinstance(body["detail"], str)
    assert body["detail"]
    assert body["type"]
    assert response.headers.get("x-should-retry") == "false"
    return body


def prompt(tokens: list[int]) -> dict[str, Any]:
    return {"chunks": [{"type": "encoded_text", "tokens": tokens}]}


async def post_raw(api: Api, path: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
    return await api.http.post(f"/api/v1/{path}", content=content, headers=api.headers(headers))


async def optim_step(api: Api, model_id: str, seq_id: int, lr: float = 0.05) -> httpx.Response:
    body = {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": lr}}
    return await api.result(await api.post("optim_step", body))


async def sampler(
    api: Api,
    session_id: str,
    seq: int = 0,
    base_model: str | None = MODEL,
    model_path: str | None = None,
) -> str:
    body: dict[str, Any] = {"session_id": session_id, "sampling_session_seq_id": seq}
    if model_path is not None:
        body["model_path"] = model_path
    elif base_model is not None:
        body["base_model"] = base_model
    response = await api.post("create_sampling_session", body)
    assert response.status_code == 200, response.text
    return str(response.json()["sampling_session_id"])


def sample_body(sampler_id: str, tokens: list[int], **params: Any) -> dict[str, Any]:
    """An asample body; keyword arguments go to sampling_params unless they are request fields."""
    request_keys = {
        "num_samples",
        "seq_id",
        "prompt_logprobs",
        "topk_prompt_logprobs",
        "topk_sample_logprobs",
        "prompt_logprobs_last_n",
    }
    body: dict[str, Any] = {"sampling_session_id": sampler_id, "prompt": prompt(tokens)}
    body["sampling_params"] = {k: v for k, v in params.items() if k not in request_keys}
    body.update({k: v for k, v in params.items() if k in request_keys})
    return body


async def sample(api: Api, sampler_id: str, tokens: list[int], **params: Any) -> SampleResponse:
    done = await api.result(await api.post("asample", sample_body(sampler_id, tokens, **params)))
    assert done.headers["content-type"] == "application/x-protobuf", done.text
    return decode_sample_response(done.content)


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, tenant: str = "alice", **config: Any) -> AsyncIterator[Api]:
    """An app with its own ServerConfig (e.g. a small body limit), as one tenant."""
    app = create_app(
        ServerConfig(data_dir=tmp_path, **{"long_poll_s": 1.0, "backend": "fake", **config})
    )
    async with app.router.lifespan_context(app):
        keys = KeyStore(tmp_path / "keys.json")
        key, _ = keys.create(tenant)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tuneloop") as http:
            yield Api(http, key, keys)
