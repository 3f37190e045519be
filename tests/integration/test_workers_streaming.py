"""A real `tuneloop serve --workers 2` (2 gloo ranks, the tiny model), replicated and with
`--shard-weights fsdp`: the OpenAI endpoint streams from a worker group of either kind.

What must hold: the SSE chunks of a long completion arrive while it is generated, not at its
end (a short request sent once the first chunk arrived is answered before the stream's last
chunk arrives: it joined the running decode), and the streamed text equals the whole answer of
the same seeded request.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tuneloop._local_server import LiveServer, live_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TINY = "tuneloop/tiny-qwen3"
PROMPT = [72, 101, 108, 108, 111, 44]
LONG = 200


@pytest.fixture(scope="module", params=["none", "fsdp"])
def live(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    root: Path = tmp_path_factory.mktemp(f"workers-stream-{request.param}")
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the server's torch: a shared 2-core machine
    try:
        with live_server(
            root / "data",
            *("--workers", "2", "--device", "cpu", "--cache-dir", str(root / "cache")),
            *("--shard-weights", request.param),
            backend="torch",
            models=(TINY,),
        ) as server:
            yield server
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def test_a_worker_group_streams_completions(live: LiveServer) -> None:
    client = openai.OpenAI(
        api_key=live.key, base_url=f"{live.url}/oai/api/v1", max_retries=0, timeout=120
    )
    # A seed whose completion runs to max_tokens (the random tiny model may draw its EOS).
    for seed in range(20):
        whole = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=LONG, seed=seed)
        if whole.choices[0].finish_reason == "length":
            break
    else:
        pytest.fail("no seed ran to max_tokens")
    arrivals: list[tuple[float, str]] = []
    first = threading.Event()

    def consume() -> None:
        stream = client.completions.create(
            model=TINY, prompt=PROMPT, max_tokens=LONG, seed=seed, stream=True
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append((time.monotonic(), chunk.choices[0].text))
                first.set()

    reader = threading.Thread(target=consume)
    reader.start()
    try:
        assert first.wait(120), "no chunk arrived"
        short = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=2, seed=1)
        answered = time.monotonic()
    finally:
        reader.join(timeout=120)
    assert not reader.is_alive()
    assert short.choices[0].finish_reason in ("length", "stop")
    assert "".join(text for _, text in arrivals) == whole.choices[0].text
    assert len(arrivals) > 10
    # streamed as generated: the stream was still going when the short request was answered
    assert arrivals[-1][0] > answered
