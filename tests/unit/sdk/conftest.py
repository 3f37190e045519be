"""A fake tuneloop server behind httpx.MockTransport, for SDK tests without a network."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tuneloop import ServiceClient
from tuneloop.types import ForwardBackwardOutput, SampledSequence, SampleResponse, TensorData
from tuneloop.types.codec import (
    ForwardBackwardRequest,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)

SESSION_ID = "sess-1"
PROTOBUF = "application/x-protobuf"
Handler = Callable[[httpx.Request], Awaitable[httpx.Response] | httpx.Response]


def default_fwdbwd(request: ForwardBackwardRequest) -> ForwardBackwardOutput:
    """Cross-entropy with logprobs lp = -0.1 * (target + 1): loss = -sum(w * lp)."""
    outputs = []
    loss = 0.0
    for datum in request.data:
        targets = datum.loss_fn_inputs["target_tokens"].to_numpy()
        lp = (-0.1 * (targets + 1)).astype(np.float32)
        weights = datum.loss_fn_inputs.get("weights")
        if weights is not None:
            loss += float(-(weights.to_numpy() * lp).sum())
        outputs.append({"logprobs": TensorData.from_numpy(lp)})
    return ForwardBackwardOutput("ArrayRecord", outputs, {"loss:sum": loss})


class FakeServer:
    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.events: list[tuple[str, Any]] = []
        self.config: dict[str, Any] = {"fwdbwd_max_chunk_len": 1024}
        self.queued: dict[tuple[str, str], list[Handler | httpx.Response]] = {}
        self.results: dict[str, Callable[[], httpx.Response]] = {}
        self.polls: dict[str, int] = {}
        self.try_again_polls = 0
        self.hold: set[str] = set()  # request ids whose result is not ready yet
        self.fwdbwd: Callable[[ForwardBackwardRequest], ForwardBackwardOutput] = default_fwdbwd
        self.fwdbwd_requests: list[ForwardBackwardRequest] = []
        self.submit_delay: Callable[[int], float] = lambda seq_id: 0.0
        self.heartbeat_status = 200
        self.tokenizer_files: dict[str, bytes] = {}
        self._next_request = 0

    # ---- helpers for tests ----------------------------------------------------------------

    def queue(self, method: str, path: str, *responses: Handler | httpx.Response) -> None:
        self.queued.setdefault((method, path), []).extend(responses)

    def bodies(self, path: str) -> list[Any]:
        return [json.loads(r.content) for r in self.requests if r.url.path == path]

    def paths(self) -> list[str]:
        return [r.url.path for r in self.requests]

    def _future(self, result: Callable[[], httpx.Response], **extra: Any) -> httpx.Response:
        self._next_request += 1
        request_id = f"req-{self._next_request}"
        self.results[request_id] = result
        return httpx.Response(200, json={"request_id": request_id, **extra})

    @staticmethod
    def _json_result(body: dict[str, Any]) -> Callable[[], httpx.Response]:
        return lambda: httpx.Response(200, json=body)

    # ---- the transport handler ------------------------------------------------------------

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        key = (request.method, request.url.path)
        if self.queued.get(key):
            item = self.queued[key].pop(0)
            if isinstance(item, httpx.Response):
                return item
            result = item(request)
            return await result if asyncio.iscoroutine(result) else result  # type: ignore[return-value]
        return await self._route(request)

    async def _route(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body: Any = None
        if request.content and request.headers.get("content-type") == "application/json":
            body = json.loads(request.content)
        if path == "/api/v1/client/config":
            return httpx.Response(200, json=self.config)
        if path == "/api/v1/create_session":
            return httpx.Response(200, json={"session_id": SESSION_ID})
        if path == "/api/v1/session_heartbeat":
            return httpx.Response(self.heartbeat_status, json={"type": "session_heartbeat"})
        if path == f"/api/v1/sessions/{SESSION_ID}/finish":
            self.heartbeat_status = 410
            return httpx.Response(200, json={})
        if path == "/api/v1/create_model":
            model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
            return self._future(self._json_result({"model_id": model_id}))
        if path == "/api/v1/get_info":
            model_id = body["model_id"]
            return httpx.Response(
                200, json={"model_id": model_id, "model_data": {"model_name": "tiny-base"}}
            )
        if path == "/api/v1/forward_backward":
            assert request.headers["content-type"] == PROTOBUF
            fb = decode_forward_backward_request(request.content)
            self.events.append(("start", fb.seq_id))
            await asyncio.sleep(self.submit_delay(fb.seq_id))
            self.events.append(("end", fb.seq_id))
            self.fwdbwd_requests.append(fb)
            output = self.fwdbwd(fb)
            return self._future(
                lambda: httpx.Response(
                    200,
                    content=encode_forward_backward_output(output),
                    headers={"content-type": PROTOBUF},
                )
            )
        if path in (
            "/api/v1/optim_step",
            "/api/v1/save_weights",
            "/api/v1/save_weights_for_sampler",
            "/api/v1/load_weights",
        ):
            if "seq_id" in body:
                self.events.append(("start", body["seq_id"]))
                await asyncio.sleep(self.submit_delay(body["seq_id"]))
                self.events.append(("end", body["seq_id"]))
            if path == "/api/v1/optim_step":
                return self._future(self._json_result({"metrics": {"lr": 1.0}}))
            if path == "/api/v1/save_weights":
                result = {"path": f"tinker://{body['model_id']}/weights/{body['path']}"}
                return self._future(self._json_result(result))
            if path == "/api/v1/save_weights_for_sampler":
                if "path" in body:
                    result = {"path": f"tinker://{body['model_id']}/sampler_weights/{body['path']}"}
                else:
                    sid = f"{SESSION_ID}:sample:{body['sampling_session_seq_id']}"
                    result = {"sampling_session_id": sid}
                return self._future(self._json_result(result))
            return self._future(self._json_result({"path": body["path"]}))
        if path == "/api/v1/create_sampling_session":
            sid = f"{body['session_id']}:sample:{body['sampling_session_seq_id']}"
            return httpx.Response(200, json={"sampling_session_id": sid})
        if path.startswith("/api/v1/samplers/"):
            sampler_id = path.rsplit("/", 1)[1]
            return httpx.Response(200, json={"sampler_id": sampler_id, "base_model": "tiny-base"})
        if path == "/api/v1/asample":
            n = body["num_samples"]
            prompt = body["prompt"]["chunks"][0]["tokens"]
            response = SampleResponse(
                sequences=[SampledSequence("length", [7, 8], [-0.5, -0.25]) for _ in range(n)],
                prompt_logprobs=(
                    [None] + [-1.0] * (len(prompt) - 1) if body.get("prompt_logprobs") else None
                ),
            )
            ids = [f"seq-{body['seq_id']}-{i}" for i in range(n)]
            return self._future(
                lambda: httpx.Response(
                    200,
                    content=encode_sample_response(response),
                    headers={"content-type": PROTOBUF},
                ),
                sample_sequence_ids=ids,
            )
        if path == "/api/v1/retrieve_future":
            request_id = body["request_id"]
            if request_id not in self.results:
                return httpx.Response(404, json={"detail": f"unknown future {request_id}"})
            self.polls[request_id] = self.polls.get(request_id, 0) + 1
            try_again = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            if request_id in self.hold:
                await asyncio.sleep(0.02)
                return httpx.Response(408, json=try_again)
            if self.polls[request_id] <= self.try_again_polls:
                # Alternate the two try_again forms the protocol allows.
                status = 408 if self.polls[request_id] % 2 else 200
                return httpx.Response(status, json=try_again)
            return self.results[request_id]()
        if path == "/api/v1/tokenizer":
            import base64
            import hashlib

            digest = hashlib.sha256()
            for name in sorted(self.tokenizer_files):
                digest.update(name.encode() + b"\0" + self.tokenizer_files[name])
            files = {n: base64.b64encode(c).decode() for n, c in self.tokenizer_files.items()}
            payload = {
                "base_model": request.url.params["base_model"],
                "files": files,
                "sha256": digest.hexdigest(),
            }
            return httpx.Response(200, json=payload)
        return httpx.Response(404, json={"detail": f"no route {request.method} {path}"})


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
def make_service(server: FakeServer) -> Iterator[Callable[..., ServiceClient]]:
    made: list[ServiceClient] = []

    def make(**kwargs: Any) -> ServiceClient:
        kwargs.setdefault("base_url", "http://fake")
        kwargs.setdefault("api_key", "tl-test-key")
        client = ServiceClient(_transport=httpx.MockTransport(server.handle), **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def service(make_service: Callable[..., ServiceClient]) -> ServiceClient:
    return make_service()
