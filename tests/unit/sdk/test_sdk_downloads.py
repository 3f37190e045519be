"""save_weights_external, get_external_weights_urls and download_checkpoint, against the fake
server: what goes on the wire, files fetched with no API key, URLs signed again near expiry."""

from __future__ import annotations

import asyncio
import inspect
import json
from datetime import UTC, datetime, timedelta

import httpx
import pytest

import tuneloop
from tuneloop.errors import APIConnectionError, GoneError, TuneloopError
from tuneloop.types import ExternalWeightsUrlsResponse, SaveWeightsExternalResponse

PATH = "tinker://sess-1:train:0/external_weights/e1"
URLS_PATH = (
    "/api/v1/training_runs/sess-1:train:0/checkpoints/external_weights/e1/external_weights_urls"
)
FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"\x00" * 3000}


@pytest.fixture
def rest(server):
    client = tuneloop.RestClient(
        base_url="http://fake", api_key="tml-key", _transport=httpx.MockTransport(server.handle)
    )
    yield client
    client.close()


def urls_body(expires: datetime, version: int = 1, files: dict[str, bytes] = FILES) -> dict:
    return {
        "urls": {name: f"http://files.example/d/{name}?v={version}&signature=s" for name in files},
        "expires": expires.isoformat(),
    }


def serve_files(server, files: dict[str, bytes] = FILES) -> None:
    for name, content in files.items():
        server.queue("GET", f"/d/{name}", lambda request, c=content: httpx.Response(200, content=c))


def test_save_weights_external_is_an_ordered_training_operation(service, server):
    server.queue(
        "POST",
        "/api/v1/save_weights_external",
        lambda request: server._future(
            server._json_result({"path": PATH, "size_bytes": 123, "type": "save_weights_external"})
        ),
    )
    tc = service.create_lora_training_client("tiny-base")
    tc.save_state("s").result(5)  # seq 1
    saved = tc.save_weights_external("e1", ttl_seconds=7200).result(5)
    assert isinstance(saved, SaveWeightsExternalResponse)
    assert (saved.path, saved.size_bytes) == (PATH, 123)
    assert server.bodies("/api/v1/save_weights_external") == [
        {
            "model_id": "sess-1:train:0",
            "path": "e1",
            "seq_id": 2,
            "ttl_seconds": 7200,
            "type": "save_weights_external",
        }
    ]


def test_save_weights_external_async(service, server):
    server.queue(
        "POST",
        "/api/v1/save_weights_external",
        lambda request: server._future(server._json_result({"path": PATH})),
    )
    tc = service.create_lora_training_client("tiny-base")
    saved = asyncio.run(tc.save_weights_external_async("e1"))
    assert saved.path == PATH
    assert "ttl_seconds" not in server.bodies("/api/v1/save_weights_external")[0]


def test_get_external_weights_urls(rest, server):
    expires = datetime(2030, 1, 1, tzinfo=UTC)
    server.queue("GET", URLS_PATH, httpx.Response(200, json=urls_body(expires)))
    got = rest.get_external_weights_urls(PATH).result(5)
    assert isinstance(got, ExternalWeightsUrlsResponse)
    assert got.expires == expires
    assert sorted(got.urls) == sorted(FILES)
    with pytest.raises(ValueError, match="sampler checkpoints cannot be downloaded"):
        rest.get_external_weights_urls("tinker://r/sampler_weights/s")
    with pytest.raises(ValueError, match="save_weights_external"):
        rest.get_external_weights_urls("tinker://r/weights/w")
    with pytest.raises(ValueError, match="not a tinker path"):
        rest.get_external_weights_urls("r/external_weights/e")


def test_download_fetches_every_file_without_the_api_key(rest, server, tmp_path):
    server.queue(
        "GET",
        URLS_PATH,
        httpx.Response(200, json=urls_body(datetime.now(UTC) + timedelta(hours=1))),
    )
    serve_files(server)
    out = tmp_path / "adapter"
    assert rest.download_checkpoint(PATH, out).result(5) == out
    assert {p.name: p.read_bytes() for p in out.iterdir()} == FILES
    fetched = [r for r in server.requests if r.url.host == "files.example"]
    assert len(fetched) == 2
    assert all("x-api-key" not in r.headers for r in fetched)
    api_calls = [r for r in server.requests if r.url.path == URLS_PATH]
    assert [r.headers["x-api-key"] for r in api_calls] == ["tml-key"]


def test_urls_near_expiry_are_signed_again(rest, server, tmp_path):
    # Already within 5 minutes of expiring: each file asks for fresh URLs first.
    soon = datetime.now(UTC) + timedelta(minutes=4)
    server.queue(
        "GET",
        URLS_PATH,
        httpx.Response(200, json=urls_body(soon, 1)),
        httpx.Response(200, json=urls_body(soon, 2)),
        httpx.Response(200, json=urls_body(datetime.now(UTC) + timedelta(hours=1), 3)),
    )
    serve_files(server)
    rest.download_checkpoint(PATH, tmp_path / "out").result(5)
    versions = [r.url.params["v"] for r in server.requests if r.url.host == "files.example"]
    assert versions == ["2", "3"]


def test_download_refuses_unsafe_names_and_bad_answers(rest, server, tmp_path):
    later = datetime.now(UTC) + timedelta(hours=1)
    for name in ("../escape", "/etc/passwd", "a/../../b", "a\\b"):
        server.queue(
            "GET", URLS_PATH, httpx.Response(200, json=urls_body(later, files={name: b""}))
        )
        with pytest.raises(TuneloopError, match="refusing to write"):
            rest.download_checkpoint(PATH, tmp_path / "unsafe").result(5)
    assert not (tmp_path / "escape").exists()

    # An expired URL's 410 is raised with the server's words; no partial file is left.
    server.queue("GET", URLS_PATH, httpx.Response(200, json=urls_body(later)))
    server.queue(
        "GET",
        "/d/adapter_config.json",
        httpx.Response(
            410, json={"detail": "expires: this download URL expired", "field": "expires"}
        ),
    )
    with pytest.raises(GoneError, match="expired"):
        rest.download_checkpoint(PATH, tmp_path / "gone").result(5)
    assert list((tmp_path / "gone").iterdir()) == []

    # A body shorter than its Content-Length is an error, not a truncated file.
    server.queue("GET", URLS_PATH, httpx.Response(200, json=urls_body(later)))
    server.queue(
        "GET",
        "/d/adapter_config.json",
        httpx.Response(200, content=b"{}", headers={"content-length": "10"}),
    )
    with pytest.raises(APIConnectionError, match=r"adapter_config\.json"):
        rest.download_checkpoint(PATH, tmp_path / "short").result(5)
    assert list((tmp_path / "short").iterdir()) == []

    server.queue(
        "GET", URLS_PATH, httpx.Response(200, json={"urls": {}, "expires": later.isoformat()})
    )
    with pytest.raises(TuneloopError, match="no files"):
        rest.download_checkpoint(PATH, tmp_path / "empty").result(5)

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("mine")
    with pytest.raises(ValueError, match="not an empty folder"):
        rest.download_checkpoint(PATH, taken)
    with pytest.raises(ValueError, match="sampler"):
        rest.download_checkpoint("tinker://r/sampler_weights/s", tmp_path / "s")


def test_public_signatures():
    assert str(inspect.signature(tuneloop.TrainingClient.save_weights_external)) == (
        "(self, name: 'str', ttl_seconds: 'int | None' = None) "
        "-> 'APIFuture[SaveWeightsExternalResponse]'"
    )
    assert str(inspect.signature(tuneloop.RestClient.get_external_weights_urls)) == (
        "(self, tinker_path: 'str') -> 'APIFuture[ExternalWeightsUrlsResponse]'"
    )
    assert str(inspect.signature(tuneloop.RestClient.download_checkpoint)) == (
        "(self, tinker_path: 'str', out_dir: 'str | Path') -> 'APIFuture[Path]'"
    )
    assert {"ExternalWeightsUrlsResponse", "SaveWeightsExternalRequest"} <= set(
        tuneloop.types.__all__
    )
    assert "SaveWeightsExternalResponse" in tuneloop.types.__all__
    assert json.loads(
        tuneloop.types.SaveWeightsExternalRequest(model_id="m", path="e", seq_id=1).model_dump_json(
            exclude_none=True
        )
    ) == {"model_id": "m", "path": "e", "seq_id": 1, "type": "save_weights_external"}
