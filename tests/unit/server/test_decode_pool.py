"""Large forward_backward bodies decoded in the server's decoding process.

The child's answer must be the in-process answer: the same work (same outputs), the same 400
naming the same field for every kind of bad body, the same fingerprint (a retry is deduplicated).
A child that dies is a 503 to retry, and the next body gets a fresh process. Bodies here are
~0.3 MB, sent through the child by lowering the handler's threshold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tuneloop.server.api.training as training
from tests.unit.server.harness import Api, datum, decode_output
from tuneloop.server.api import decode_pool
from tuneloop.server.api.decode_pool import DecodePool, decode_job, routing_fields
from tuneloop.types import proto
from tuneloop.types.codec import ForwardBackwardRequest, encode_forward_backward_request
from tuneloop.types.model_input import ImageChunk, ModelInput
from tuneloop.types.proto_pieces import last_string_fields
from tuneloop.types.provenance import PromptProvenanceSpan

PROTO = {"content-type": "application/x-protobuf"}


@pytest.fixture
def in_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every forward_backward body is decoded in the child."""
    monkeypatch.setattr(training, "PROCESS_BYTES", 1)


def _data(datums: int = 40, tokens: int = 200, seed: int = 0) -> list[Any]:
    rng = np.random.default_rng(seed)
    return [
        datum(rng.integers(0, 250, tokens + 1).tolist(), weights=rng.random(tokens, np.float32))
        for _ in range(datums)
    ]


def _body(model_id: str, seq_id: int, data: list[Any], loss_fn: str = "cross_entropy") -> bytes:
    return encode_forward_backward_request(ForwardBackwardRequest(model_id, seq_id, data, loss_fn))


async def _post(api: Api, body: bytes) -> Any:
    return await api.http.post("/api/v1/forward_backward", content=body, headers=api.headers(PROTO))


def _decoder(api: Api) -> DecodePool:
    transport: Any = api.http._transport  # the ASGI app the client talks to
    pool: DecodePool = transport.app.state.tuneloop.decoder
    return pool


async def test_a_body_decoded_in_the_child_gives_the_in_process_outputs(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_id = await api.model(await api.session())
    data = _data()
    monkeypatch.setattr(training, "PROCESS_BYTES", 2**62)
    here = await api.result(await _post(api, _body(model_id, 1, data)))
    assert not _decoder(api).started
    monkeypatch.setattr(training, "PROCESS_BYTES", 1)
    there = await api.result(await _post(api, _body(model_id, 2, data)))
    assert _decoder(api).started
    assert here.status_code == there.status_code == 200, there.text
    ours, theirs = decode_output(here.content), decode_output(there.content)
    assert len(theirs.loss_fn_outputs) == len(data)
    for a, b in zip(ours.loss_fn_outputs, theirs.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())
    assert ours.metrics == theirs.metrics


def _bad_bodies(model_id: str, seq_id: int) -> dict[str, bytes]:
    good = _data(datums=30)
    far_target = _data(datums=30)
    far_target[-1].loss_fn_inputs["target_tokens"].values[-1] = 10**6
    far_token = _data(datums=30)
    far_token[7].model_input.chunks[0].tokens[3] = 10**6  # type: ignore[union-attr]
    short_weights = _data(datums=30)
    short_weights[2] = datum(list(range(201)), weights=np.ones(5, np.float32))
    image = _data(datums=30)
    image[4] = datum(list(range(3)))
    image[4] = type(image[4])(
        model_input=ModelInput(chunks=[ImageChunk(data="aGk=", format="png")]),
        loss_fn_inputs=image[4].loss_fn_inputs,
    )
    # Framing that scans (model_id readable) around a datum that does not parse.
    torn = bytearray(_body(model_id, seq_id, good))
    datum_at = torn.index(b"\x1a")  # field 3 (data), length-delimited
    torn[datum_at + 3 : datum_at + 8] = b"\xff\xff\xff\xff\xff"
    return {
        "far_target": _body(model_id, seq_id, far_target),
        "far_token": _body(model_id, seq_id, far_token),
        "short_weights": _body(model_id, seq_id, short_weights),
        "image": _body(model_id, seq_id, image),
        "unknown_loss": _body(model_id, seq_id, good, "no_such_loss"),
        "no_data": _body(model_id, seq_id, []),
        "torn": bytes(torn),
        "unknown_model": _body("nobody:train:0", seq_id, good),
        "torn_unknown_model": bytes(torn).replace(model_id.encode(), b"x" * len(model_id)),
    }


@pytest.mark.parametrize(
    "case",
    [
        "far_target",
        "far_token",
        "short_weights",
        "image",
        "unknown_loss",
        "no_data",
        "torn",
        "unknown_model",
        "torn_unknown_model",
    ],
)
async def test_a_bad_body_is_refused_in_the_child_as_in_process(
    api: Api, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    model_id = await api.model(await api.session())
    monkeypatch.setattr(training, "PROCESS_BYTES", 2**62)
    here = await _post(api, _bad_bodies(model_id, 1)[case])
    monkeypatch.setattr(training, "PROCESS_BYTES", 1)
    there = await _post(api, _bad_bodies(model_id, 2)[case])
    assert 400 <= here.status_code < 500, here.text
    assert (there.status_code, there.json()) == (here.status_code, here.json())


async def test_a_retried_body_decoded_in_the_child_is_the_same_request(
    api: Api, in_child: None
) -> None:
    model_id = await api.model(await api.session())
    body = _body(model_id, 1, _data())
    first, retry = await _post(api, body), await _post(api, body)
    assert first.status_code == retry.status_code == 200, retry.text
    assert first.json()["request_id"] == retry.json()["request_id"]


async def test_stable_reinforce_spans_come_back_from_the_child(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_id = await api.model(await api.session())
    rng = np.random.default_rng(1)
    data = [
        datum(
            rng.integers(0, 250, 21).tolist(),
            advantages=np.ones(20, np.float32),
            logprobs=np.zeros(20, np.float32),
        ).with_provenance([_prompt_span("never-sampled", 20)], [_prompt_span("never-sampled", 20)])
        for _ in range(3)
    ]
    monkeypatch.setattr(training, "PROCESS_BYTES", 2**62)
    here = await _post(api, _body(model_id, 1, data, "stable_reinforce"))
    monkeypatch.setattr(training, "PROCESS_BYTES", 1)
    there = await _post(api, _body(model_id, 2, data, "stable_reinforce"))
    # The spans crossed: the refusal names the first span's unknown sequence.
    assert there.status_code == 400, there.text
    assert there.json()["field"] == "data[0].model_input_spans[0].sequence_id"
    assert there.json() == here.json()


def _prompt_span(sequence_id: str, length: int) -> PromptProvenanceSpan:
    return PromptProvenanceSpan(sequence_id=sequence_id, offset=0, length=length)


def die_once(*args: Any) -> Any:
    """A decode job whose first run kills its process (as an OOM kill would)."""
    marker = Path(os.environ["DECODE_POOL_TEST_MARKER"])
    if not marker.exists():
        marker.touch()
        os._exit(9)
    return decode_job(*args)


async def test_a_child_that_dies_is_a_503_to_retry_and_the_next_body_a_fresh_child(
    api: Api, in_child: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_id = await api.model(await api.session())
    monkeypatch.setenv("DECODE_POOL_TEST_MARKER", str(tmp_path / "died"))
    transport: Any = api.http._transport
    state = transport.app.state.tuneloop
    state.decoder.close()
    state.decoder = DecodePool(job=die_once)
    body = _body(model_id, 1, _data())
    died = await _post(api, body)
    assert died.status_code == 503, died.text
    assert died.json()["field"] == "body"
    assert died.headers["retry-after"] == "1"
    assert (tmp_path / "died").exists()
    retried = await _post(api, body)  # the SDK's retry: the seq_id was not consumed
    assert (await api.result(retried)).status_code == 200


def test_the_model_id_and_loss_are_read_from_the_framing_as_a_parse_reads_them() -> None:
    body = _body("first:train:0", 1, _data(datums=3, tokens=4))
    assert routing_fields(body) == ("first:train:0", "cross_entropy")
    # A later occurrence wins, as in a parse.
    again = proto.ForwardBackwardRequestProto(
        model_id="second:train:0", loss_fn="custom"
    ).SerializeToString()
    parsed = proto.ForwardBackwardRequestProto.FromString(body + again)
    assert routing_fields(body + again) == (parsed.model_id, parsed.loss_fn)
    assert parsed.model_id == "second:train:0"
    no_loss = proto.ForwardBackwardRequestProto(model_id="m").SerializeToString()
    assert routing_fields(no_loss) == ("m", "")
    assert routing_fields(b"\xff\xff") is None  # a varint that never ends
    assert routing_fields(body[:-3]) is None  # a field past the end
    assert routing_fields(b"\x0a\x02\xff\xfe") is None  # not UTF-8
    assert routing_fields(b"") is None  # no model_id
    assert last_string_fields(b"", (1,)) == {}


async def test_a_custom_loss_body_is_decoded_on_the_thread(api: Api, in_child: None) -> None:
    model_id = await api.model(await api.session())
    refused = await _post(api, _body(model_id, 1, _data(), "custom"))
    assert refused.status_code == 400, refused.text  # no custom loss was created
    assert not _decoder(api).started


async def test_the_pool_starts_on_the_first_large_body_and_closes_with_the_server(
    api: Api, in_child: None
) -> None:
    pool = _decoder(api)
    assert not pool.started
    model_id = await api.model(await api.session())
    assert (await api.result(await _post(api, _body(model_id, 1, _data())))).status_code == 200
    assert pool.started
    children = pool.pids()
    assert children
    pool.close()
    assert not pool.started
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_no_shared_block_outlives_its_request(
    api: Api, in_child: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The body's block and the child's answer block are unlinked once the request is done,
    accepted or refused."""
    names: list[str] = []

    class Recorded(decode_pool.SharedMemory):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            names.append(self.name)

    monkeypatch.setattr(decode_pool, "SharedMemory", Recorded)
    model_id = await api.model(await api.session())
    assert (await api.result(await _post(api, _body(model_id, 1, _data())))).status_code == 200
    bad = _data()
    bad[-1].loss_fn_inputs["target_tokens"].values[-1] = 10**6
    assert (await _post(api, _body(model_id, 2, bad))).status_code == 400
    assert len(names) == 3  # the two bodies' blocks, and the accepted body's answer block
    for name in names:
        with pytest.raises(FileNotFoundError):
            decode_pool.SharedMemory(name)
