"""retrieve_futures (the batch completion feed per sampling session and clone),
join_sampling_session, and zstd bodies that decompress past the limit."""

from __future__ import annotations

import asyncio
import resource
import time
from pathlib import Path
from typing import Any

import pytest
import zstandard

from tests.unit.server.harness import (
    PROTO,
    Api,
    expect_error,
    post_raw,
    sample_body,
    sampler,
    serve,
)
from tuneloop.server.api import futures_feed
from tuneloop.server.api.futures_feed import CLONE_STRIDE
from tuneloop.server.scheduler.futures import FutureTable, Outcome

PROMPT = [5, 7, 9]


async def _poll(api: Api, sampler_id: str, cursor: int, **extra: Any) -> dict[str, Any]:
    body = {"target": {"sampling_session_id": sampler_id}, "prev_cursor": cursor, **extra}
    response = await api.post("retrieve_futures", body)
    assert response.status_code == 200, response.text
    return dict(response.json())


async def test_feed_reports_each_completion_once_and_its_payload_size(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    empty = await _poll(api, sampler_id, 0, timeout=0)
    assert empty["completions"] == []
    submitted = []
    for seq in range(5):
        response = await api.post(
            "asample", sample_body(sampler_id, PROMPT, max_tokens=3, seq_id=seq)
        )
        submitted.append(response.json()["request_id"])
    seen: dict[str, int] = {}
    cursor = int(empty["cursor"])
    for _ in range(20):
        if len(seen) == 5:
            break
        page = await _poll(api, sampler_id, cursor)
        assert int(page["cursor"]) >= cursor
        cursor = int(page["cursor"])
        for completion in page["completions"]:
            assert completion["request_id"] not in seen  # each once
            assert completion["state"] == "finished"
            seen[completion["request_id"]] = completion["response_payload_uncompressed_size"]
    assert set(seen) == set(submitted)
    # The payload is then fetched as usual, and is exactly the size the feed announced.
    for request_id, size in seen.items():
        fetched = await api.post("retrieve_future", {"request_id": request_id})
        assert fetched.status_code == 200
        assert len(fetched.content) == size
    # Nothing new after the cursor: an ack-only call answers at once, empty.
    start = time.monotonic()
    after = await _poll(api, sampler_id, cursor, timeout=0, retrieved_request_ids=list(seen))
    assert after["completions"] == []
    assert after["cursor"] == cursor
    assert time.monotonic() - start < 0.5
    # Acknowledged payloads are gone.
    gone = await api.post("retrieve_future", {"request_id": submitted[0]})
    assert gone.status_code == 404


async def test_a_held_poll_answers_when_a_sample_completes(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    cursor = int((await _poll(api, sampler_id, 0, timeout=0))["cursor"])
    poll = asyncio.create_task(_poll(api, sampler_id, cursor, timeout=5))
    await asyncio.sleep(0.1)
    assert not poll.done()  # held: nothing completed yet
    response = await api.post("asample", sample_body(sampler_id, PROMPT, max_tokens=2, seq_id=0))
    page = await asyncio.wait_for(poll, 5)
    ids = [c["request_id"] for c in page["completions"]]
    assert ids == [response.json()["request_id"]]


async def test_clones_have_feeds_of_their_own(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    clone = (await api.post("join_sampling_session", {"sampling_session_id": sampler_id})).json()
    assert clone["client_counter"] >= 1
    original = await api.post("asample", sample_body(sampler_id, PROMPT, max_tokens=2, seq_id=0))
    cloned = await api.post(
        "asample",
        sample_body(
            sampler_id, PROMPT, max_tokens=2, seq_id=CLONE_STRIDE * clone["client_counter"]
        ),
    )
    await asyncio.sleep(0.3)
    mine = await _poll(api, sampler_id, 0, timeout=1)
    theirs = await _poll(
        api,
        sampler_id,
        0,
        timeout=1,
        target={"sampling_session_id": sampler_id, "cloned_sampler_id": clone["client_counter"]},
    )
    assert [c["request_id"] for c in mine["completions"]] == [original.json()["request_id"]]
    assert [c["request_id"] for c in theirs["completions"]] == [cloned.json()["request_id"]]


async def test_join_numbers_never_repeat_even_when_concurrent(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    answers = await asyncio.gather(
        *(api.post("join_sampling_session", {"sampling_session_id": sampler_id}) for _ in range(20))
    )
    counters = [a.json()["client_counter"] for a in answers]
    assert sorted(counters) == list(range(1, 21))
    assert all(a.json()["type"] == "join_sampling_session" for a in answers)


async def test_join_and_feed_refuse_bad_input(api: Api) -> None:
    sampler_id = await sampler(api, await api.session())
    expect_error(
        await api.post("join_sampling_session", {"sampling_session_id": "nope"}),
        404,
        "sampling_session_id",
    )
    expect_error(
        await api.post(
            "retrieve_futures", {"target": {"sampling_session_id": sampler_id}, "prev_cursor": -1}
        ),
        400,
        "prev_cursor",
    )
    expect_error(
        await api.post(
            "retrieve_futures",
            {"target": {"sampling_session_id": sampler_id, "cloned_sampler_id": -2}},
        ),
        400,
        "target.cloned_sampler_id",
    )
    expect_error(
        await api.post("retrieve_futures", {"target": {"sampling_session_id": sampler_id}, "x": 1}),
        400,
        "x",
    )


async def test_a_zstd_bomb_is_413_without_inflating(tmp_path: Path) -> None:
    # ~8 KB that declare (and would expand to) 256 MB: refused after at most the limit. Made a
    # megabyte at a time, so the test's own peak memory stays far below what it checks.
    size = 256 << 20
    packer = zstandard.ZstdCompressor().compressobj(size=size)
    zeros = b"\0" * (1 << 20)
    bomb = b"".join(packer.compress(zeros) for _ in range(size // len(zeros))) + packer.flush()
    assert len(bomb) < 20_000
    assert zstandard.frame_content_size(bomb) == size
    async with serve(tmp_path, max_request_bytes=1 << 20) as api:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        response = await post_raw(
            api, "forward_backward", bomb, {**PROTO, "content-encoding": "zstd"}
        )
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        expect_error(response, 413, "body")
        assert grown_mb < 64, grown_mb  # never the 256 MB the frame declares


async def test_a_feed_nobody_polls_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(futures_feed, "MAX_EVENTS", 50)
    table = FutureTable()
    feeds = futures_feed.CompletionFeeds(table)
    for _ in range(500):  # a client that never polls the feed (our SDK does not)
        request_id = table.create("alice", "Sample")
        feeds.watch(request_id, "s:sample:0", 0)
        table.resolve(request_id, Outcome(b"x", "application/x-protobuf"))
    assert len(feeds) == 50
    completions, _cursor = await feeds.poll("s:sample:0", 0, 0, 0)
    assert len(completions) == 50  # the newest ones
    feeds.forget_samplers({"s:sample:0"})
    assert len(feeds) == 0
