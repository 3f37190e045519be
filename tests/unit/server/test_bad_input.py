"""Every bad input is a 4xx naming its field, and the session stays usable afterwards.

A training request rejected after its (model_id, seq_id) could be read consumes that seq_id:
the SDKs never reuse one, so the model's stream steps over it (a retry of it is a 409), and
requests queued behind it still run. A body too broken to name its seq_id consumes nothing.
"""

from __future__ import annotations

import base64
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zstandard

from tests.unit.server.harness import (
    MODEL,
    PROTO,
    Api,
    datum,
    decode_output,
    expect_error,
    optim_step,
    post_raw,
    sample,
    sample_body,
    sampler,
    serve,
)
from tuneloop.types import Datum, EncodedTextChunk, ImageChunk, ModelInput, SampledProvenanceSpan
from tuneloop.types.codec import ForwardBackwardRequest, encode_forward_backward_request

TOKENS = [5, 17, 33, 90, 120, 7]
N = len(TOKENS) - 1
F32 = np.float32


def rl_inputs(**override: Any) -> dict[str, Any]:
    inputs = {
        "logprobs": np.full(N, -2.0, dtype=F32),
        "advantages": np.linspace(-1, 1, N).astype(F32),
    }
    inputs.update(override)
    return inputs


async def assert_trains(api: Api, model_id: str, seq_id: int) -> None:
    """A good forward_backward at `seq_id` runs: the model's stream was not disturbed."""
    await assert_completes(api, await api.forward_backward(model_id, seq_id, [datum(TOKENS)]))


async def assert_completes(api: Api, submitted: httpx.Response, polls: int = 5) -> None:
    """The submitted forward_backward finishes within a few long-polls (no stalled stream)."""
    assert submitted.status_code == 200, submitted.text
    request_id = submitted.json()["request_id"]
    for _ in range(polls):
        out = await api.post("retrieve_future", {"request_id": request_id})
        if out.status_code != 408:
            assert out.headers["content-type"] == "application/x-protobuf", out.text
            assert math.isfinite(decode_output(out.content).metrics["loss:sum"])
            return
    raise AssertionError(f"request {request_id} is stuck behind a seq_id that never ran")


async def assert_seq_consumed(api: Api, model_id: str, seq_id: int) -> None:
    """The rejected seq_id counts as used: reusing it is a 409; the next one runs."""
    retry = await api.forward_backward(model_id, seq_id, [datum(TOKENS)])
    expect_error(retry, 409, "seq_id")
    await assert_trains(api, model_id, seq_id + 1)


# (case id, data, loss_fn, loss_fn_config, expected field)
FORWARD_BACKWARD_CASES: list[tuple[str, list[Datum], str, dict[str, Any], str]] = [
    ("input token above vocab", [datum([5, 300, 7])], "cross_entropy", {}, "data[0].model_input"),
    ("input token negative", [datum([5, -1, 7])], "cross_entropy", {}, "data[0].model_input"),
    (
        "second datum input token",
        [datum(TOKENS), datum([1, 2, 259, 3])],
        "cross_entropy",
        {},
        "data[1].model_input",
    ),
    (
        "target token above vocab",
        [datum(TOKENS, target_tokens=np.array([1, 2, 3, 4, 259]))],
        "cross_entropy",
        {},
        "data[0].loss_fn_inputs.target_tokens",
    ),
    (
        "target token negative",
        [datum(TOKENS, target_tokens=np.array([1, 2, -3, 4, 5]))],
        "cross_entropy",
        {},
        "data[0].loss_fn_inputs.target_tokens",
    ),
    (
        "target longer than input",
        [datum(TOKENS, target_tokens=np.arange(N + 1))],
        "cross_entropy",
        {},
        "data[0].loss_fn_inputs.target_tokens",
    ),
    (
        "target shorter than input",
        [datum(TOKENS, target_tokens=np.arange(N - 1))],
        "cross_entropy",
        {},
        "data[0].loss_fn_inputs.target_tokens",
    ),
    (
        "weights length differs",
        [datum(TOKENS, weights=np.ones(N + 1, dtype=F32))],
        "cross_entropy",
        {},
        "data[0].loss_fn_inputs.weights",
    ),
    (
        "weights 1-D with 2-D targets",
        [
            datum(
                TOKENS,
                target_tokens=np.tile(np.arange(2), (N, 1)),
                weights=np.ones(N, dtype=F32),
            )
        ],
        "cross_entropy",
        {},
        "data[0].loss_fn_inputs.weights",
    ),
    (
        "weights NaN",
        [datum(TOKENS, weights=np.array([1, 1, np.nan, 1, 1], dtype=F32))],
        "cross_entropy",
        {},
        "data[0].loss_fn_inputs.weights",
    ),
    (
        "weights inf",
        [datum(TOKENS, weights=np.array([1, 1, np.inf, 1, 1], dtype=F32))],
        "cross_entropy",
        {},
        "data[0].loss_fn_inputs.weights",
    ),
    (
        "advantages NaN",
        [datum(TOKENS, **rl_inputs(advantages=np.array([0, np.nan, 0, 0, 0], dtype=F32)))],
        "importance_sampling",
        {},
        "data[0].loss_fn_inputs.advantages",
    ),
    (
        "advantages -inf",
        [datum(TOKENS, **rl_inputs(advantages=np.array([0, 0, 0, 0, -np.inf], dtype=F32)))],
        "ppo",
        {},
        "data[0].loss_fn_inputs.advantages",
    ),
    (
        "sampler logprobs NaN",
        [datum(TOKENS, **rl_inputs(logprobs=np.full(N, np.nan, dtype=F32)))],
        "ppo",
        {},
        "data[0].loss_fn_inputs.logprobs",
    ),
    ("unknown loss", [datum(TOKENS)], "focal", {}, "loss_fn"),
    (
        "stable_reinforce without provenance",
        [datum(TOKENS, **rl_inputs())],
        "stable_reinforce",
        {},
        "data[0].loss_fn_input_spans",
    ),
    (
        "stable_reinforce naming an unrecorded sequence",
        [
            replace(
                datum(TOKENS, **rl_inputs()),
                model_input_spans=(SampledProvenanceSpan(sequence_id="nope", length=N),),
                loss_fn_input_spans=(SampledProvenanceSpan(sequence_id="nope", length=N),),
            )
        ],
        "stable_reinforce",
        {"kl_coeff": 0.1},
        "data[0].model_input_spans[0].sequence_id",
    ),
    (
        "stable_reinforce with the server's own inputs",
        [datum(TOKENS, **rl_inputs(recorded_logprobs=np.zeros(N, dtype=F32)))],
        "stable_reinforce",
        {},
        "data[0].loss_fn_inputs.recorded_logprobs",
    ),
    (
        "stable_reinforce config key of another loss",
        [datum(TOKENS, **rl_inputs())],
        "stable_reinforce",
        {"beta": 0.1},
        "loss_fn_config.beta",
    ),
    ("custom without loss_id", [datum(TOKENS)], "custom", {}, "loss_fn_config.loss_id"),
    (
        "custom loss_id a number",
        [datum(TOKENS)],
        "custom",
        {"loss_id": 3.0},
        "loss_fn_config.loss_id",
    ),
    (
        "unknown config key",
        [datum(TOKENS, **rl_inputs())],
        "ppo",
        {"clip_epsilon": 0.2},
        "loss_fn_config.clip_epsilon",
    ),
    (
        "config key of another loss",
        [datum(TOKENS)],
        "cross_entropy",
        {"beta": 0.1},
        "loss_fn_config.beta",
    ),
    (
        "config inf",
        [datum(TOKENS, **rl_inputs())],
        "ppo",
        {"clip_high_threshold": math.inf},
        "loss_fn_config.clip_high_threshold",
    ),
    (
        "config NaN",
        [datum(TOKENS, **rl_inputs())],
        "dro",
        {"beta": math.nan},
        "loss_fn_config.beta",
    ),
    (
        "config string",
        [datum(TOKENS, **rl_inputs())],
        "cispo",
        {"clip_low_threshold": "low"},
        "loss_fn_config.clip_low_threshold",
    ),
    (
        "importance_sampling without advantages",
        [datum(TOKENS, logprobs=np.zeros(N, dtype=F32))],
        "importance_sampling",
        {},
        "data[0].loss_fn_inputs.advantages",
    ),
    (
        "ppo without sampler logprobs",
        [datum(TOKENS, advantages=np.zeros(N, dtype=F32))],
        "ppo",
        {},
        "data[0].loss_fn_inputs.logprobs",
    ),
    (
        "unknown loss input",
        [datum(TOKENS, mask=np.ones(N, dtype=F32))],
        "cross_entropy",
        {},
        "data[0].loss_fn_inputs.mask",
    ),
    (
        "RL input sent to cross_entropy",
        [datum(TOKENS, advantages=np.ones(N, dtype=F32))],
        "cross_entropy",
        {},
        "data[0].loss_fn_inputs.advantages",
    ),
    (
        "empty model input",
        [Datum(ModelInput.from_ints([]), {"target_tokens": np.zeros(0, dtype=np.int64)})],
        "cross_entropy",
        {},
        "data[0].model_input",
    ),
    ("empty data", [], "cross_entropy", {}, "data"),
]


@pytest.mark.parametrize(
    ("data", "loss_fn", "config", "field"),
    [case[1:] for case in FORWARD_BACKWARD_CASES],
    ids=[case[0] for case in FORWARD_BACKWARD_CASES],
)
async def test_bad_forward_backward_is_400_and_the_stream_steps_over_it(
    api: Api, data: list[Datum], loss_fn: str, config: dict[str, Any], field: str
) -> None:
    model_id = await api.model(await api.session())
    await assert_trains(api, model_id, 1)
    # seq 3 arrives first and waits for seq 2, which is then rejected.
    waiting = await api.forward_backward(model_id, 3, [datum(TOKENS)])
    bad = await api.forward_backward(model_id, 2, data, loss_fn, config)
    expect_error(bad, 400, field)
    await assert_completes(api, waiting)
    expect_error(await api.forward_backward(model_id, 2, [datum(TOKENS)]), 409, "seq_id")
    await assert_trains(api, model_id, 4)


async def test_seq_id_reuse_with_other_content_is_409(api: Api) -> None:
    model_id = await api.model(await api.session())
    await assert_trains(api, model_id, 1)
    conflict = await api.forward_backward(model_id, 1, [datum([1, 2, 3])])
    expect_error(conflict, 409, "seq_id")
    # An identical retry maps to the original request; the stream goes on at seq 2.
    retry = await api.forward_backward(model_id, 1, [datum(TOKENS)])
    assert retry.status_code == 200
    await assert_trains(api, model_id, 2)


async def test_seq_id_zero_is_400(api: Api) -> None:
    model_id = await api.model(await api.session())
    expect_error(await api.forward_backward(model_id, 0, [datum(TOKENS)]), 400, "seq_id")
    await assert_trains(api, model_id, 1)
    expect_error(await api.forward_backward(model_id, -3, [datum(TOKENS)]), 400, "seq_id")
    await assert_trains(api, model_id, 2)


async def test_oversize_request_is_413(tmp_path: Path) -> None:
    async with serve(tmp_path, max_request_bytes=2048, long_poll_s=0.2) as api:
        model_id = await api.model(await api.session())
        waiting = await api.forward_backward(model_id, 2, [datum(TOKENS)])
        big = [datum(list(range(1, 250)) * 3)]
        expect_error(await api.forward_backward(model_id, 1, big), 413, "body")
        # The SDK moves on to seq 2 and never resends seq 1: the stream must not stall.
        await assert_completes(api, waiting)


async def test_oversize_after_zstd_decompression_is_413(tmp_path: Path) -> None:
    async with serve(tmp_path, max_request_bytes=4096) as api:
        model_id = await api.model(await api.session())
        raw = encode_forward_backward_request(
            ForwardBackwardRequest(model_id, 1, [datum([7] * 1500)], "cross_entropy")
        )
        packed = zstandard.ZstdCompressor().compress(raw)
        assert len(packed) < 4096 < len(raw)
        response = await post_raw(
            api, "forward_backward", packed, {**PROTO, "content-encoding": "zstd"}
        )
        assert response.status_code == 413, response.text
        assert response.json()["detail"]
        await assert_seq_consumed(api, model_id, 1)


async def test_malformed_protobuf_is_400(api: Api) -> None:
    model_id = await api.model(await api.session())
    bad = await post_raw(api, "forward_backward", b"\xff\xff\xff\xff", PROTO)
    expect_error(bad, 400, "body")
    await assert_trains(api, model_id, 1)


async def test_forward_backward_in_json_is_415(api: Api) -> None:
    model_id = await api.model(await api.session())
    bad = await api.post("forward_backward", {"model_id": model_id, "seq_id": 1})
    expect_error(bad, 415, "content-type")
    await assert_seq_consumed(api, model_id, 1)


async def test_unknown_content_encoding_is_415(api: Api) -> None:
    model_id = await api.model(await api.session())
    raw = encode_forward_backward_request(
        ForwardBackwardRequest(model_id, 1, [datum(TOKENS)], "cross_entropy")
    )
    bad = await post_raw(api, "forward_backward", raw, {**PROTO, "content-encoding": "br"})
    expect_error(bad, 415, "content-encoding")
    await assert_seq_consumed(api, model_id, 1)


async def test_zstd_forward_backward_works_and_garbage_zstd_is_400(api: Api) -> None:
    model_id = await api.model(await api.session())
    zstd = {**PROTO, "content-encoding": "zstd"}
    expect_error(
        await post_raw(api, "forward_backward", b"not zstd at all", zstd), 400, "content-encoding"
    )
    raw = encode_forward_backward_request(
        ForwardBackwardRequest(model_id, 1, [datum(TOKENS)], "cross_entropy")
    )
    packed = await post_raw(api, "forward_backward", zstandard.ZstdCompressor().compress(raw), zstd)
    compressed = decode_output((await api.result(packed)).content)
    plain = await api.forward_backward(model_id, 2, [datum(TOKENS)], forward_only=True)
    reference = decode_output((await api.result(plain)).content)
    np.testing.assert_array_equal(
        compressed.loss_fn_outputs[0]["logprobs"].to_numpy(),
        reference.loss_fn_outputs[0]["logprobs"].to_numpy(),
    )


# ---- JSON routes -------------------------------------------------------------------------------


async def test_json_route_with_wrong_content_type_is_415(api: Api) -> None:
    model_id = await api.model(await api.session())
    body = b'{"model_id": "%s", "seq_id": 1}' % model_id.encode()
    bad = await post_raw(api, "optim_step", body, {"content-type": "text/plain"})
    expect_error(bad, 415, "content-type")
    await assert_seq_consumed(api, model_id, 1)
    await optim_step(api, model_id, 3)


async def test_invalid_json_is_400(api: Api) -> None:
    session_id = await api.session()
    bad = await post_raw(
        api, "create_model", b'{"session_id": ', {"content-type": "application/json"}
    )
    expect_error(bad, 400, "body")
    await api.model(session_id)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"base_model": None}, "base_model"),
        ({"session_id": None}, "session_id"),
        ({"bogus": 1}, "bogus"),
        ({"lora_config": {"rank": 4, "alpha": 8}}, "lora_config.alpha"),
        ({"lora_config": {"rank": 0}}, "lora_config.rank"),
        ({"model_seq_id": -1}, "model_seq_id"),
        ({"base_model": "meta/llama-405b"}, "base_model"),
    ],
    ids=[
        "missing base_model",
        "missing session_id",
        "unknown field",
        "unknown nested field",
        "rank 0",
        "negative model_seq_id",
        "unknown base_model",
    ],
)
async def test_bad_create_model_is_400(api: Api, change: dict[str, Any], field: str) -> None:
    session_id = await api.session()
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL, **change}
    body = {k: v for k, v in body.items() if v is not None}
    expect_error(await api.post("create_model", body), 400, field)
    model_id = await api.model(session_id)
    await assert_trains(api, model_id, 1)


@pytest.mark.parametrize(
    ("adam", "field"),
    [
        ({"learning_rate": -0.1}, "adam_params.learning_rate"),
        ({"beta1": 1.0}, "adam_params.beta1"),
        ({"beta2": 1.5}, "adam_params.beta2"),
        ({"eps": 0.0}, "adam_params.eps"),
        ({"momentum": 0.9}, "adam_params.momentum"),
    ],
)
async def test_bad_adam_params_is_400(api: Api, adam: dict[str, Any], field: str) -> None:
    model_id = await api.model(await api.session())
    await assert_trains(api, model_id, 1)
    bad = await api.post("optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": adam})
    expect_error(bad, 400, field)
    retry = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.05}}
    expect_error(await api.post("optim_step", retry), 409, "seq_id")
    step = await optim_step(api, model_id, 3)
    assert step.json()["metrics"]["grad_norm"] > 0


async def test_optim_step_without_seq_id_is_400(api: Api) -> None:
    model_id = await api.model(await api.session())
    await assert_trains(api, model_id, 1)
    bad = await api.post("optim_step", {"model_id": model_id, "adam_params": {}})
    expect_error(bad, 400, "seq_id")
    await optim_step(api, model_id, 2)


@pytest.mark.parametrize("name", ["a/b", "", "../up", ".hidden", "x" * 200, "sp ace"])
async def test_bad_checkpoint_name_is_400(api: Api, name: str) -> None:
    model_id = await api.model(await api.session())
    bad = await api.post("save_weights", {"model_id": model_id, "path": name, "seq_id": 1})
    expect_error(bad, 400, "path")
    bad = await api.post(
        "save_weights_for_sampler", {"model_id": model_id, "path": name, "seq_id": 2}
    )
    expect_error(bad, 400, "path")
    saved = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "ok", "seq_id": 3})
    )
    assert saved.json()["path"] == f"tinker://{model_id}/weights/ok"


BAD_PATHS = [
    "s3://bucket/weights/x",
    "tinker://run/weights",
    "tinker://run/weights/a/b",
    "tinker://run/optimizer/x",
    "tinker:///weights/x",
]


@pytest.mark.parametrize("path", BAD_PATHS)
async def test_bad_tinker_path_is_400(api: Api, path: str) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    saved = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "good", "seq_id": 1})
    )
    load = {"session_id": session_id, "model_seq_id": 1}
    expect_error(await api.post("load_weights", {**load, "path": path}), 400, "path")
    expect_error(await api.post("weights_info", {"tinker_path": path}), 400, "tinker_path")
    loaded = await api.result(
        await api.post("load_weights", {**load, "path": saved.json()["path"]})
    )
    assert loaded.json()["model_id"] == f"{session_id}:train:1"


@pytest.mark.parametrize("path", BAD_PATHS[:2])
async def test_bad_sampler_model_path_names_model_path(api: Api, path: str) -> None:
    session_id = await api.session()
    body = {"session_id": session_id, "sampling_session_seq_id": 0, "model_path": path}
    expect_error(await api.post("create_sampling_session", body), 400, "model_path")
    await sampler(api, session_id)


async def test_unknown_checkpoint_is_404_naming_the_path(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    missing = f"tinker://{model_id}/weights/never-saved"
    load = {"session_id": session_id, "model_seq_id": 1, "path": missing}
    expect_error(await api.post("load_weights", load), 404, "path")
    body = {"session_id": session_id, "sampling_session_seq_id": 0, "model_path": missing}
    expect_error(await api.post("create_sampling_session", body), 404, "model_path")


# ---- sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "params", "field"),
    [
        ([5, 259], {"max_tokens": 4}, "prompt"),
        ([-5, 7], {"max_tokens": 4}, "prompt"),
        ([], {"max_tokens": 4}, "prompt"),
        ([5, 7], {"max_tokens": 2047}, "sampling_params.max_tokens"),
        ([5, 7], {"max_tokens": 0}, "sampling_params.max_tokens"),
        ([5, 7], {"max_tokens": 4, "top_p": 1.5}, "sampling_params.top_p"),
        ([5, 7], {"max_tokens": 4, "top_p": 0.0}, "sampling_params.top_p"),
        ([5, 7], {"max_tokens": 4, "temperature": -0.5}, "sampling_params.temperature"),
        ([5, 7], {"max_tokens": 4, "top_k": 0}, "sampling_params.top_k"),
        ([5, 7], {"max_tokens": 4, "stop": [300]}, "sampling_params.stop"),
        ([5, 7], {"max_tokens": 4, "num_samples": 0}, "num_samples"),
        ([5, 7], {"max_tokens": 4, "prompt_logprobs_last_n": 1}, "prompt_logprobs_last_n"),
        ([5, 7], {"max_tokens": 4, "beam_width": 2}, "sampling_params.beam_width"),
    ],
    ids=[
        "prompt token above vocab",
        "prompt token negative",
        "empty prompt",
        "max_tokens past context",
        "max_tokens 0",
        "top_p above 1",
        "top_p 0",
        "negative temperature",
        "top_k 0",
        "stop token outside vocab",
        "num_samples 0",
        "prompt_logprobs_last_n",
        "unknown sampling param",
    ],
)
async def test_bad_sample_is_400(
    api: Api, tokens: list[int], params: dict[str, Any], field: str
) -> None:
    sampler_id = await sampler(api, await api.session())
    expect_error(await api.post("asample", sample_body(sampler_id, tokens, **params)), 400, field)
    good = await sample(api, sampler_id, [5, 7], max_tokens=4, seed=1)
    assert len(good.sequences[0].tokens) >= 1


async def test_sample_without_sampling_session_is_400(api: Api) -> None:
    body = sample_body("x", [5, 7], max_tokens=3)
    del body["sampling_session_id"]
    expect_error(await api.post("asample", body), 400, "sampling_session_id")


async def test_rejecting_a_seq_already_queued_or_run_changes_nothing(api: Api) -> None:
    model_id = await api.model(await api.session())
    queued = await api.forward_backward(model_id, 2, [datum(TOKENS)])
    bad = [datum([5, 300, 7])]
    expect_error(await api.forward_backward(model_id, 2, bad), 400, "data[0].model_input")
    again = await api.forward_backward(model_id, 2, [datum(TOKENS)])
    assert again.json()["request_id"] == queued.json()["request_id"]
    await assert_trains(api, model_id, 1)
    await assert_completes(api, queued)
    expect_error(await api.forward_backward(model_id, 1, bad), 400, "data[0].model_input")
    await assert_trains(api, model_id, 3)


async def test_image_chunk_is_400_for_a_text_model(api: Api) -> None:
    model_id = await api.model(await api.session())
    image = ImageChunk(data=base64.b64encode(b"\x89PNG").decode(), format="png", expected_tokens=4)
    bad = Datum(
        ModelInput(chunks=[EncodedTextChunk(tokens=[1, 2]), image]),
        {"target_tokens": np.arange(6)},
    )
    expect_error(
        await api.forward_backward(model_id, 1, [bad]), 400, "data[0].model_input.chunks[1]"
    )
    await assert_seq_consumed(api, model_id, 1)


async def test_optimizer_state_from_a_sampler_checkpoint_is_400(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    saved = await api.result(
        await api.post("save_weights_for_sampler", {"model_id": model_id, "path": "s", "seq_id": 1})
    )
    load = {"session_id": session_id, "model_seq_id": 1, "path": saved.json()["path"]}
    expect_error(await api.post("load_weights", {**load, "optimizer": True}), 400, "optimizer")
    loaded = await api.result(await api.post("load_weights", load))
    assert loaded.json()["model_id"] == f"{session_id}:train:1"


async def test_experts_alone_are_something_to_train_and_the_run_keeps_the_choice(api: Api) -> None:
    import httpx

    session_id = await api.session()
    off = {"train_mlp": False, "train_attn": False, "train_unembed": False}
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL}
    nothing = {**body, "lora_config": {"rank": 4, **off, "train_experts": False}}
    bad = await api.post("create_model", nothing)
    expect_error(bad, 400, "body")
    assert "train_experts" in bad.json()["detail"]
    experts = {**body, "lora_config": {"rank": 4, **off, "train_experts": True}}
    done = await api.result(await api.post("create_model", experts))
    model_id = done.json()["model_id"]
    transport = api.http._transport
    assert isinstance(transport, httpx.ASGITransport)
    state = transport.app.state.tuneloop  # type: ignore[attr-defined]
    run = state.registry.training_run(model_id, "alice")
    assert (run.train_mlp, run.train_experts) == (False, True)
