"""An in-process server (fake backend unless given another) with the official `openai` client
bound to it over httpx.ASGITransport, as tenant alice; bob's key for isolation checks."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.unit.server.harness import Api
from tuneloop.server.app import create_app
from tuneloop.server.config import ServerConfig
from tuneloop.server.engine.backend import Backend
from tuneloop.server.storage.keys import KeyStore

MODEL = "tuneloop/fake-tiny"
BASE = "/oai/api/v1"


@dataclass
class OaiWorld:
    app: Any
    api: Api  # alice over the Tinker API
    client: openai.AsyncOpenAI  # alice over the OpenAI-compatible API
    bob: openai.AsyncOpenAI
    bob_key: str

    @property
    def state(self) -> Any:
        return self.app.state.tuneloop

    async def post(self, path: str, body: Any, key: str | None = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {key or self.api.key}"}
        return await self.api.http.post(f"{BASE}/{path}", json=body, headers=headers)

    async def events(self, path: str, body: Any) -> list[Any]:
        """A streamed request's server-sent events, framing checked: JSON objects, then DONE."""
        headers = {"authorization": f"Bearer {self.api.key}"}
        async with self.api.http.stream(
            "POST", f"{BASE}/{path}", json={**body, "stream": True}, headers=headers
        ) as response:
            assert response.status_code == 200, await response.aread()
            assert response.headers["content-type"].startswith("text/event-stream")
            raw = (await response.aread()).decode()
        assert raw.endswith("\n\n")
        frames = raw.split("\n\n")[:-1]
        assert all(f.startswith("data: ") for f in frames), frames
        assert frames[-1] == "data: [DONE]"
        return [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]


@contextlib.asynccontextmanager
async def oai_world(
    tmp_path: Path, backend: Backend | None = None, **config: Any
) -> AsyncIterator[OaiWorld]:
    settings = {"long_poll_s": 1.0, "backend": "fake", **config}
    app = create_app(ServerConfig(data_dir=tmp_path, **settings), backend=backend)
    async with app.router.lifespan_context(app):
        keys = KeyStore(tmp_path / "keys.json")
        key, _ = keys.create("alice")
        bob_key, _ = keys.create("bob")
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://tuneloop") as http,
            httpx.AsyncClient(transport=transport, base_url="http://tuneloop") as oai_http,
        ):
            url = f"http://tuneloop{BASE}"
            client = openai.AsyncOpenAI(
                api_key=key, base_url=url, http_client=oai_http, max_retries=0
            )
            bob = openai.AsyncOpenAI(
                api_key=bob_key, base_url=url, http_client=oai_http, max_retries=0
            )
            yield OaiWorld(app, Api(http, key, keys), client, bob, bob_key)
