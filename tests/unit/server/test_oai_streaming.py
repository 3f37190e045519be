"""Streaming is real on the torch engine: the per-token hook reports every token as it is drawn,
before the request's result, and a streamed reply reaches the client while decoding runs."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.unit.server.oai_client import oai_world

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tuneloop.server.engine.torch_backend import TorchBackend  # noqa: E402
from tuneloop.server.engine.types import SampleResult, SampleWork  # noqa: E402

TINY = "tuneloop/tiny-qwen3"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: no spinning OpenMP workers
    yield
    torch.set_num_threads(threads)


def _work(hook: Any, **kw: Any) -> SampleWork:
    settings: dict[str, Any] = {
        "sampler_id": "s",
        "prompt": np.array([5, 17, 33, 90], dtype=np.int64),
        "num_samples": 2,
        "max_tokens": 12,
        "temperature": 1.0,
        "top_k": -1,
        "top_p": 1.0,
        "seed": 3,
        "stop_token_ids": (),
        "stop_strings": (),
        "topk_sample_logprobs": 2,
        "on_token": hook,
        **kw,
    }
    return SampleWork(**settings)


def test_the_token_hook_sees_every_token_before_the_result(tmp_path: Path) -> None:
    backend = TorchBackend((TINY,), cache_dir=tmp_path, device="cpu")
    backend.create_sampler("s", TINY)
    seen: list[tuple[int, int, float, Any]] = []
    delivered: list[tuple[int, SampleResult]] = []

    def deliver(_work: SampleWork, result: Any) -> None:
        delivered.append((len(seen), result))

    work = _work(lambda *event: seen.append(event))
    backend.sample_continuous([work], list, deliver)
    [(seen_then, result)] = delivered
    assert seen_then == len(seen)  # every token was reported before the result
    for index, sequence in enumerate(result.sequences):
        mine = [e for e in seen if e[0] == index]
        assert [e[1] for e in mine] == sequence.tokens
        assert [e[2] for e in mine] == sequence.logprobs
        assert [e[3] for e in mine] == sequence.topk
    # Without a hook the same tokens come out (the hook only listens).
    plain = backend.sample([_work(None)])[0]
    assert isinstance(plain, SampleResult)
    assert [s.tokens for s in plain.sequences] == [s.tokens for s in result.sequences]
    # A hook that fails does not fail the request.
    broken = backend.sample([_work(lambda *_: 1 / 0)])[0]
    assert isinstance(broken, SampleResult)
    # Work sent to another process goes without its hook.
    assert pickle.loads(pickle.dumps(work)).on_token is None


class WatchedBackend(TorchBackend):
    """Records every sampling request's answer as the engine delivers it and, while `release`
    is given and not set, holds it back, so a test can see what the client got while the
    request was still running."""

    release: threading.Event | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answers: list[tuple[SampleWork, Any]] = []

    def sample_continuous(
        self,
        batch: Sequence[SampleWork],
        admit: Callable[[], Sequence[SampleWork]],
        deliver: Callable[[SampleWork, Any], None],
        cancelled: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        def watched(work: SampleWork, result: Any) -> None:
            if self.release is not None:
                self.release.wait(timeout=30)
            self.answers.append((work, result))
            deliver(work, result)

        super().sample_continuous(batch, admit, watched, cancelled)


async def _asgi_stream(
    app: Any,
    key: str,
    body: dict[str, Any],
    on_event: Any,
    gone: asyncio.Event | None = None,
    path: str = "/oai/api/v1/chat/completions",
) -> None:
    """POST a streamed request straight to the ASGI app, calling `on_event` with each server-sent
    event as the app sends it (httpx's ASGITransport would hand over the body only at the end).
    Setting `gone` disconnects the client."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"tuneloop"),
            (b"authorization", f"Bearer {key}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("tuneloop", 80),
    }
    sent = False
    done = gone or asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200
        elif message["type"] == "http.response.body":
            for frame in message.get("body", b"").decode().split("\n\n"):
                if frame.startswith("data: ") and frame != "data: [DONE]":
                    on_event(json.loads(frame.removeprefix("data: ")))
            if not message.get("more_body", False):
                done.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=120)


async def test_a_streamed_reply_reaches_the_client_while_the_request_runs(tmp_path: Path) -> None:
    backend = WatchedBackend((TINY,), cache_dir=tmp_path / "cache", device="cpu")
    release = backend.release = threading.Event()
    body = {
        "model": TINY,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 24,
        "seed": 1,
        "logprobs": True,
    }
    before: list[Any] = []
    after: list[Any] = []

    def on_event(event: dict[str, Any]) -> None:
        (after if release.is_set() else before).append(event)
        if sum(1 for e in before if e["choices"] and e["choices"][0]["logprobs"]) >= 3:
            release.set()  # three tokens' chunks arrived while the result was held

    async with oai_world(tmp_path, backend=backend) as world:
        try:
            await _asgi_stream(world.app, world.api.key, {**body, "stream": True}, on_event)
        finally:
            release.set()
        streamed = [e for e in before if e["choices"] and e["choices"][0]["logprobs"]]
        assert len(streamed) >= 3
        assert all(e["choices"][0]["finish_reason"] is None for e in before if e["choices"])
        assert after[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        text = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in before + after if e["choices"]
        )
        whole = (await world.post("chat/completions", body)).json()
        assert text == whole["choices"][0]["message"]["content"]


async def test_a_client_that_goes_away_mid_stream_stops_its_request(tmp_path: Path) -> None:
    backend = WatchedBackend((TINY,), cache_dir=tmp_path / "cache", device="cpu")
    max_tokens = 400  # the greedy reply runs to the limit: only cancelling ends it early
    body = {"model": TINY, "prompt": [5, 17, 33], "max_tokens": max_tokens, "temperature": 0}
    gone = asyncio.Event()
    events: list[Any] = []

    def on_event(event: dict[str, Any]) -> None:
        events.append(event)
        if len(events) >= 3:
            gone.set()  # the client hangs up after three chunks

    async with oai_world(tmp_path, backend=backend) as world:
        await _asgi_stream(
            world.app,
            world.api.key,
            {**body, "stream": True},
            on_event,
            gone,
            "/oai/api/v1/completions",
        )
        for _ in range(600):  # the engine answers the request at its next decode step
            if backend.answers:
                break
            await asyncio.sleep(0.05)
        [(work, answer)] = backend.answers
        assert work.cancel_key is not None
        assert not isinstance(answer, SampleResult), answer
        assert "cancelled" in str(answer)
        # The server carries on; the same request run to its end does go to the limit.
        whole = (await world.post("completions", body)).json()
        assert whole["usage"]["completion_tokens"] == max_tokens
        assert whole["choices"][0]["finish_reason"] == "length"
