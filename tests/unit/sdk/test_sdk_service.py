"""ServiceClient life cycle, SamplingClient, RestClient and the tokenizer cache."""

from __future__ import annotations

import json
import time

import httpx
import pytest

import tuneloop
from tuneloop import ModelInput, SamplingParams, TuneloopError, _tokenizer, errors


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_rest_client_without_an_address_is_a_clear_error(monkeypatch):
    # A ServiceClient given no address starts a local server (tests/integration/
    # test_embedded_default.py); a RestClient has nothing to start and says what to set.
    monkeypatch.delenv("TUNELOOP_BASE_URL", raising=False)
    with pytest.raises(TuneloopError, match="TUNELOOP_BASE_URL"):
        tuneloop.RestClient()


def test_base_url_and_key_from_environment(monkeypatch, server):
    monkeypatch.setenv("TUNELOOP_BASE_URL", "http://from-env/")
    monkeypatch.setenv("TUNELOOP_API_KEY", "env-key")
    with tuneloop.ServiceClient(_transport=httpx.MockTransport(server.handle)) as client:
        assert client.session_id == "sess-1"
    first = server.requests[0]
    assert str(first.url) == "http://from-env/api/v1/client/config"
    assert first.headers["x-api-key"] == "env-key"


def test_startup_sends_config_then_create_session(make_service, server):
    make_service(user_metadata={"team": "a"}, project_id="p1")
    assert server.paths()[:2] == ["/api/v1/client/config", "/api/v1/create_session"]
    (body,) = server.bodies("/api/v1/create_session")
    assert body["user_metadata"] == {"team": "a"}
    assert body["project_id"] == "p1"
    assert body["type"] == "create_session"


def test_config_is_required(server):
    server.queue("POST", "/api/v1/client/config", httpx.Response(404, json={"detail": "no route"}))
    with pytest.raises(errors.NotFoundError):
        tuneloop.ServiceClient(
            base_url="http://fake", _transport=httpx.MockTransport(server.handle)
        )


def test_heartbeats_then_close_finishes_and_stops_them(make_service, server):
    client = make_service(_heartbeat_interval_s=0.01)

    def beats():
        return server.paths().count("/api/v1/session_heartbeat")

    assert wait_until(lambda: beats() >= 2)
    assert server.bodies("/api/v1/session_heartbeat")[0] == {
        "session_id": "sess-1",
        "type": "session_heartbeat",
    }
    client.close()
    assert server.bodies("/api/v1/sessions/sess-1/finish") == [{"reason": {"type": "success"}}]
    after_close = beats()
    time.sleep(0.05)
    assert beats() == after_close
    assert not client._holder.thread.is_alive()
    client.close()  # idempotent
    with pytest.raises(TuneloopError, match="closed"):
        client.create_rest_client().list_sessions()


def test_context_manager_reports_errors(server):
    with (
        pytest.raises(KeyError),
        tuneloop.ServiceClient(
            base_url="http://fake", _transport=httpx.MockTransport(server.handle)
        ),
    ):
        raise KeyError("x")
    (body,) = server.bodies("/api/v1/sessions/sess-1/finish")
    assert body["reason"] == {"type": "errored"}


def test_heartbeat_410_stops_the_loop(make_service, server):
    server.heartbeat_status = 410
    client = make_service(_heartbeat_interval_s=0.01)
    assert wait_until(lambda: not client._holder.heartbeat_running())
    assert server.paths().count("/api/v1/session_heartbeat") == 1


def test_sampling(service, server):
    sampler = service.create_sampling_client(model_path="tinker://sess-1:train:0/sampler_weights/a")
    (created,) = server.bodies("/api/v1/create_sampling_session")
    assert created == {
        "session_id": "sess-1",
        "sampling_session_seq_id": 0,
        "model_path": "tinker://sess-1:train:0/sampler_weights/a",
        "type": "create_sampling_session",
    }
    assert "/api/v1/samplers/sess-1:sample:0" in server.paths()
    assert sampler.get_base_model() == "tiny-base"
    prompt = ModelInput.from_ints([1, 2, 3])
    params = SamplingParams(max_tokens=2, temperature=0.7, stop=[])
    first = sampler.sample(prompt, 2, params)
    second = sampler.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=2)
    result = first.result(timeout=5)
    assert [s.sequence_id for s in result.sequences] == ["seq-0-0", "seq-0-1"]
    assert result.sequences[0].tokens == [7, 8]
    assert second.result(timeout=5).prompt_logprobs == [None, -1.0, -1.0]
    bodies = server.bodies("/api/v1/asample")
    assert bodies[0] == {
        "num_samples": 2,
        "prompt": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]},
        "sampling_params": {
            "max_tokens": 2,
            "stop": [],
            "temperature": 0.7,
            "top_k": -1,
            "top_p": 1.0,
        },
        "sampling_session_id": "sess-1:sample:0",
        "seq_id": 0,
        "prompt_logprobs": False,
        "topk_prompt_logprobs": 0,
        "topk_sample_logprobs": 0,
        "prompt_alt_tokens_k": 0,
        "record_stability_info": False,
        "type": "sample",
    }
    assert (bodies[1]["seq_id"], bodies[1]["topk_prompt_logprobs"]) == (1, 2)
    logprobs = sampler.compute_logprobs(prompt).result(timeout=5)
    assert logprobs == [None, -1.0, -1.0]
    last = server.bodies("/api/v1/asample")[-1]
    assert last["sampling_params"]["max_tokens"] == 1
    assert last["prompt_logprobs"] is True


def test_sampling_client_arguments(service, server):
    with pytest.raises(ValueError, match="tinker://"):
        service.create_sampling_client(model_path="/tmp/weights")
    with pytest.raises(ValueError, match="model_path or base_model"):
        service.create_sampling_client()
    sampler = service.create_sampling_client(base_model="tiny-base")
    assert sampler.get_base_model() == "tiny-base"
    assert not any(p.startswith("/api/v1/samplers/") for p in server.paths())


def test_rest_client_routes(service, server):
    rest = service.create_rest_client()
    run = {
        "training_run_id": "sess-1:train:0",
        "base_model": "tiny-base",
        "model_owner": "me",
        "is_lora": True,
        "last_request_time": "2026-01-01T00:00:00Z",
        "user_metadata": {"renderer_name": "role_colon"},
    }
    server.queue("GET", "/api/v1/training_runs/sess-1:train:0", httpx.Response(200, json=run))
    got = rest.get_training_run_by_tinker_path("tinker://sess-1:train:0/weights/a").result(5)
    assert got.user_metadata == {"renderer_name": "role_colon"}
    server.queue(
        "GET",
        "/api/v1/training_runs",
        httpx.Response(
            200,
            json={"training_runs": [run], "cursor": {"offset": 5, "limit": 2, "total_count": 9}},
        ),
    )
    runs = rest.list_training_runs(limit=2, offset=5).result(5)
    assert runs.cursor.total_count == 9
    assert server.requests[-1].url.params["limit"] == "2"
    assert server.requests[-1].url.params["offset"] == "5"
    ckpt = {
        "checkpoint_id": "weights/a",
        "checkpoint_type": "training",
        "time": "2026-01-01T00:00:00Z",
        "tinker_path": "tinker://sess-1:train:0/weights/a",
    }
    server.queue(
        "GET",
        "/api/v1/training_runs/sess-1:train:0/checkpoints",
        httpx.Response(200, json={"checkpoints": [ckpt]}),
    )
    assert (
        rest.list_checkpoints("sess-1:train:0").result(5).checkpoints[0].checkpoint_id
        == "weights/a"
    )
    server.queue("GET", "/api/v1/checkpoints", httpx.Response(200, json={"checkpoints": []}))
    rest.list_user_checkpoints().result(5)
    assert server.requests[-1].url.params["limit"] == "100"
    server.queue(
        "DELETE", "/api/v1/training_runs/sess-1:train:0/checkpoints/weights/a", httpx.Response(204)
    )
    assert (
        rest.delete_checkpoint_from_tinker_path("tinker://sess-1:train:0/weights/a").result(5)
        is None
    )
    server.queue(
        "POST", "/api/v1/weights_info", httpx.Response(200, json={"base_model": "tiny-base"})
    )
    assert rest.get_weights_info_by_tinker_path("tinker://r/weights/a").result(5).is_lora
    assert server.bodies("/api/v1/weights_info") == [{"tinker_path": "tinker://r/weights/a"}]
    server.queue(
        "GET",
        "/api/v1/sessions/sess-1",
        httpx.Response(200, json={"training_run_ids": ["sess-1:train:0"], "sampler_ids": []}),
    )
    assert rest.get_session("sess-1").result(5).training_run_ids == ["sess-1:train:0"]
    server.queue("GET", "/api/v1/sessions", httpx.Response(200, json={"sessions": ["sess-1"]}))
    assert rest.list_sessions().result(5).sessions == ["sess-1"]
    assert rest.get_sampler("sess-1:sample:0").result(5).base_model == "tiny-base"
    caps = {"supported_models": [{"model_name": "tiny-base", "max_context_length": 512}]}
    server.queue("GET", "/api/v1/get_server_capabilities", httpx.Response(200, json=caps))
    assert service.get_server_capabilities().supported_models[0].model_name == "tiny-base"
    with pytest.raises(ValueError, match="tinker path"):
        rest.delete_checkpoint_from_tinker_path("tinker://only/two")


def test_standalone_rest_client(server):
    server.queue("GET", "/api/v1/sessions", httpx.Response(200, json={"sessions": []}))
    with tuneloop.RestClient(
        base_url="http://fake", api_key="k", _transport=httpx.MockTransport(server.handle)
    ) as rest:
        assert rest.list_sessions().result(5).sessions == []
    assert server.paths() == ["/api/v1/client/config", "/api/v1/sessions"]


def tiny_tokenizer_files() -> dict[str, bytes]:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    return {
        "tokenizer.json": tok.to_str().encode(),
        "tokenizer_config.json": json.dumps(config).encode(),
    }


def test_tokenizer_is_fetched_from_the_server_and_cached(service, server, tmp_path, monkeypatch):
    monkeypatch.setenv("TUNELOOP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_tokenizer, "_loaded", {})
    writes = []
    real_write = _tokenizer._write_cache
    monkeypatch.setattr(
        _tokenizer, "_write_cache", lambda *a: writes.append(a[1]) or real_write(*a)
    )
    server.tokenizer_files = tiny_tokenizer_files()
    tc = service.create_lora_training_client("tiny-base")
    tokenizer = tc.get_tokenizer()
    assert tokenizer.encode("hello world", add_special_tokens=False) == [1, 2]
    assert server.requests[-1].url.params["base_model"] == "tiny-base"
    (cached,) = (tmp_path / "tokenizers").iterdir()
    assert sorted(p.name for p in cached.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert tc.get_tokenizer() is tokenizer  # in-process cache: no second request
    assert server.paths().count("/api/v1/tokenizer") == 1
    monkeypatch.setattr(_tokenizer, "_loaded", {})
    sampler = service.create_sampling_client(base_model="tiny-base")
    assert sampler.get_tokenizer().encode("world", add_special_tokens=False) == [2]
    assert writes == [cached.name]  # the second fetch found the files on disk


def test_tokenizer_rejects_unsafe_file_names(service, server, tmp_path, monkeypatch):
    monkeypatch.setenv("TUNELOOP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_tokenizer, "_loaded", {})
    server.tokenizer_files = {"../evil.json": b"{}"}
    pytest.importorskip("transformers")
    with pytest.raises(errors.APIResponseValidationError, match="plain file name"):
        _tokenizer.get_tokenizer(service._holder, "tiny-base")
    assert not (tmp_path / "evil.json").exists()


def test_usage_of_the_session_and_of_the_tenant(service, server):
    body = {
        "tenant": "me",
        "session_id": "sess-1",
        "bucket": "none",
        "totals": {"prefill_tokens": 4, "sampled_tokens": 6, "trained_tokens": 8, "requests": 2},
        "by_operation": {
            "forward_backward": {"trained_tokens": 8, "requests": 1},
            "sample": {"prefill_tokens": 4, "sampled_tokens": 6, "requests": 1},
        },
        "buckets": [],
    }
    server.queue("GET", "/api/v1/usage", httpx.Response(200, json=body))
    usage = service.get_usage()
    assert usage.totals.trained_tokens == 8
    assert usage.by_operation["sample"].sampled_tokens == 6
    assert usage.session_id == "sess-1"
    assert server.requests[-1].url.params["session_id"] == "sess-1"
    server.queue("GET", "/api/v1/usage", httpx.Response(200, json={**body, "session_id": None}))
    rest = service.create_rest_client()
    assert rest.get_usage().result(5).session_id is None
    assert "session_id" not in server.requests[-1].url.params
    server.queue("GET", "/api/v1/usage", httpx.Response(200, json={**body, "bucket": "day"}))
    rest.get_usage(training_run_id="sess-1:train:0", since="24h", bucket="day").result(5)
    params = server.requests[-1].url.params
    assert (params["training_run_id"], params["since"], params["bucket"]) == (
        "sess-1:train:0",
        "24h",
        "day",
    )
