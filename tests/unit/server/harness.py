"""Wire helpers for driving an in-process server over HTTP as a tenant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from tuneloop.server.storage.keys import KeyStore
from tuneloop.types import Datum, ModelInput
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
