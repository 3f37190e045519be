"""Hand-shaped fuzz: protobuf forward_backward bodies, and JSON bodies that are valid in shape
but hostile in value (huge ints, negative seq_ids, NaN/inf, odd unicode, deep nesting, empty or
lengthened lists), on every JSON route and every query parameter. Tenant A sends them with its
own ids and B's; the probe fails the test on any 5xx or on anything of B's in an answer."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.fuzz.strategies import HOSTILE, dumps, hostile_bodies, protobuf_requests
from tests.fuzz.world import MODEL, World

# A failing example may hold a 20 kB string: report it whole.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

PROTOBUF_EXAMPLES = 700  # two requests each
JSON_EXAMPLES_PER_ROUTE = 55
QUERY_EXAMPLES = 300
# What each test of this module must send at the least: with test_openapi_fuzz.MIN_REQUESTS,
# the fuzz's total of at least 5,000 requests.
MIN_PROTOBUF, MIN_JSON, MIN_QUERY = 1400, 900, 400


def _settings(examples: int) -> Any:
    return settings(
        max_examples=examples,
        database=None,
        derandomize=True,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )


def json_templates(world: World) -> dict[str, list[Any]]:
    """A valid body per JSON route, with A's ids, and the same with B's where ids matter."""
    a, b = world.a, world.b
    sample = {
        "sampling_session_id": a.sampler_id,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 7, 9]}]},
        "sampling_params": {
            "max_tokens": 3,
            "seed": 1,
            "stop": [3, 4],
            "temperature": 0.7,
            "top_k": 5,
            "top_p": 0.9,
        },
        "num_samples": 2,
        "seq_id": 1,
        "topk_prompt_logprobs": 1,
        "topk_sample_logprobs": 1,
        "prompt_logprobs": True,
    }
    adam = {
        "learning_rate": 0.01,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "grad_clip_norm": 1.0,
    }
    templates: dict[str, list[Any]] = {
        "client/config": [{"sdk_version": "1"}],
        "telemetry": [{"events": [{"a": 1}], "platform": "p", "session_id": a.session_id}],
        "create_session": [{"tags": ["t"], "user_metadata": {"k": [1, 2]}, "sdk_version": "x"}],
        "session_heartbeat": [{"session_id": a.session_id}],
        f"sessions/{a.spare_session_id}/finish": [{"reason": {"type": "success"}, "detail": "d"}],
        "create_model": [
            {
                "session_id": a.session_id,
                "model_seq_id": 1,
                "base_model": MODEL,
                "user_metadata": {"k": "v"},
                "lora_config": {"rank": 4, "seed": 3, "train_mlp": True},
            }
        ],
        "get_info": [{"model_id": a.model_id}],
        "load_weights": [
            {"model_id": a.model_id, "seq_id": 7, "path": a.weights_path, "optimizer": True},
            {"session_id": a.session_id, "model_seq_id": 2, "path": a.weights_path},
        ],
        "optim_step": [{"model_id": a.model_id, "seq_id": 7, "adam_params": adam}],
        "save_weights": [
            {
                "model_id": a.model_id,
                "path": "p",
                "seq_id": 7,
                "ttl_seconds": 60,
                "user_metadata": {"k": "v"},
            }
        ],
        "save_weights_for_sampler": [
            {"model_id": a.model_id, "path": "q", "seq_id": 7, "ttl_seconds": 60},
            {"model_id": a.model_id, "sampling_session_seq_id": 3, "seq_id": 7},
        ],
        "create_sampling_session": [
            {"session_id": a.session_id, "sampling_session_seq_id": 1, "base_model": MODEL},
            {
                "session_id": a.session_id,
                "sampling_session_seq_id": 2,
                "model_path": a.sampler_path,
            },
        ],
        "asample": [sample, {**sample, "sampling_session_id": b.sampler_id}],
        "retrieve_future": [
            {"request_id": a.done_request_id},
            {"request_id": b.pending_request_id},
        ],
        "weights_info": [{"tinker_path": a.weights_path}, {"tinker_path": b.weights_path}],
        f"PUT training_runs/{a.model_id}/checkpoints/weights/w1/ttl": [{"ttl_seconds": 7200}],
        f"PUT training_runs/{b.model_id}/checkpoints/weights/w1/ttl": [{"ttl_seconds": None}],
    }
    # B's ids in A's bodies: the same shapes must answer 404 and leak nothing.
    for route in ("get_info", "optim_step", "save_weights", "load_weights"):
        templates[route].append({**templates[route][0], "model_id": b.model_id})
    templates["create_model"].append({**templates["create_model"][0], "session_id": b.session_id})
    templates["load_weights"].append({**templates["load_weights"][1], "path": b.weights_path})
    return templates


def _method_path(route: str) -> tuple[str, str]:
    method, _, path = route.partition(" ")
    return (method, path) if path else ("POST", route)


def _fuzz_route(world: World, route: str, bodies: list[Any]) -> None:
    @_settings(JSON_EXAMPLES_PER_ROUTE)
    @given(body=st.sampled_from(bodies).flatmap(hostile_bodies), ascii_only=st.booleans())
    def run(body: Any, ascii_only: bool) -> None:
        text = dumps(body)
        raw = text.encode("ascii", "backslashreplace") if ascii_only else text.encode()
        world.probe.json(*_method_path(route), raw)

    run()


@pytest.mark.slow
def test_hostile_json_bodies(fuzz_world: World) -> None:
    start = fuzz_world.probe.sent
    for route, bodies in json_templates(fuzz_world).items():
        # The valid form first: the templates themselves must not be what fails.
        for body in bodies:
            fuzz_world.probe.json(*_method_path(route), dumps(body).encode())
        _fuzz_route(fuzz_world, route, bodies)
    assert fuzz_world.probe.sent - start >= MIN_JSON
    fuzz_world.assert_healthy()


def query_routes(world: World) -> list[tuple[str, str, list[str]]]:
    a, b = world.a, world.b
    run_b, ckpt_b = b.model_id, b.weights_path.split("/", 3)[3]
    return [
        ("GET", "sessions", ["limit", "offset"]),
        ("GET", "training_runs", ["limit", "offset"]),
        ("GET", "checkpoints", ["limit", "offset"]),
        ("GET", "usage", ["session_id", "training_run_id", "since", "until", "bucket"]),
        ("GET", "tokenizer", ["base_model"]),
        ("GET", f"sessions/{a.session_id}", []),
        ("GET", f"training_runs/{a.model_id}", []),
        ("GET", f"training_runs/{run_b}/checkpoints", []),
        ("GET", f"samplers/{b.sampler_id}", []),
        ("DELETE", f"training_runs/{run_b}/checkpoints/{ckpt_b}", []),
    ]


def test_hostile_query_parameters(fuzz_world: World) -> None:
    start = fuzz_world.probe.sent
    routes = query_routes(fuzz_world)
    ids = [fuzz_world.a.session_id, fuzz_world.b.session_id, MODEL]
    numbers = ["-1", "0", "1", "1000", "1001", str(2**31), str(2**63 - 1), str(2**63), str(2**64)]
    numbers += ["9" * 50, "-" + "9" * 50, "1e3", "nan", "0x10", " 5", "", "\u0000"]
    numbers += ["24h", "-24h", "9999999999h", "0h", "2026-01-01T00:00:00", "9999-12-31T23:59:59"]
    numbers += ["0001-01-01", "hour", "day", "week"]
    # Every parameter meets every extreme once; random combinations follow.
    for method, path, names in routes:
        for name in names:
            for number in numbers:
                fuzz_world.probe.send(method, f"/api/v1/{path}", params={name: number})
    value = st.one_of(
        st.sampled_from(numbers),
        st.sampled_from(ids),
        # Capped: clients refuse a query string of more than 64 kB before it is sent.
        HOSTILE.map(lambda v: v.text if hasattr(v, "text") else str(v)).filter(
            lambda v: len(v) < 8000
        ),
    )

    @_settings(QUERY_EXAMPLES)
    @given(
        route=st.sampled_from(routes),
        values=st.lists(value, min_size=1, max_size=3),
        extra=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
    )
    def run(route: tuple[str, str, list[str]], values: list[str], extra: dict[str, str]) -> None:
        method, path, names = route
        params = {**extra, **dict(zip(names, values, strict=False))}
        fuzz_world.probe.send(method, f"/api/v1/{path}", params=params)

    run()
    assert fuzz_world.probe.sent - start >= MIN_QUERY
    fuzz_world.assert_healthy()


@pytest.mark.slow
def test_protobuf_forward_backward(fuzz_world: World) -> None:
    start = fuzz_world.probe.sent
    model_ids = [fuzz_world.a.model_id, fuzz_world.b.model_id]

    @_settings(PROTOBUF_EXAMPLES)
    @given(requests=protobuf_requests(model_ids))
    def run(requests: list[Any]) -> None:
        for request in requests:
            fuzz_world.probe.send(
                "POST",
                "/api/v1/forward_backward",
                content=request.body,
                headers=request.headers,
                plain=request.plain,
            )

    run()
    assert fuzz_world.probe.sent - start >= MIN_PROTOBUF
    fuzz_world.assert_healthy()
