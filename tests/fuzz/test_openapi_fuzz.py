"""Schema-driven fuzz of every operation in the OpenAPI document, as tenant A.

Schemathesis generates requests that fit each operation's schema (positive) and requests that
break it (negative). Id fields are seeded with real ids, A's own (so requests get past the
lookups and into validation) and B's (which must all answer 404 and leak nothing). Each answer
is checked by the probe: no 5xx, nothing of B's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode

from tests.fuzz.world import MODEL, World

# A failing example may hold a 20 kB string: report it whole.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

# The forward_backward body is bytes: generate it as an opaque binary string.
schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")

# Examples per operation and mode. Operations with few inputs (healthz) run fewer: hypothesis
# stops when it has tried every distinct case. Sized so the run stays near half a minute on
# two cores; tests/fuzz/test_body_fuzz.py adds the hand-written bodies.
EXAMPLES = 50
# What the counted requests of this module must reach (29 operations today).
MIN_REQUESTS = 2300


def _settings(examples: int) -> Any:
    return settings(
        max_examples=examples,
        database=None,
        derandomize=True,  # the same cases on every CI run: a failure reproduces
        deadline=None,
        suppress_health_check=list(HealthCheck),
        # Shrinking kept: a failure is reported as its smallest reproducing request.
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )


def _seed(schema: Any, pools: dict[str, list[str]]) -> Any:
    """`schema` with every property named in `pools` also drawing from that pool."""
    if isinstance(schema, list):
        return [_seed(s, pools) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _seed(v, pools) for k, v in schema.items()}
    for name, prop in list(out.get("properties", {}).items()):
        if name in pools:
            out["properties"][name] = {"anyOf": [prop, {"enum": pools[name]}]}
    return out


def seeded_document(document: dict[str, Any], world: World) -> dict[str, Any]:
    pools: dict[str, list[str]] = {}
    for owned in (world.a, world.b):
        for name, values in owned.ids.items():
            pools.setdefault(name, []).extend(values)
    pools["base_model"] = [MODEL]
    doc = copy.deepcopy(document)
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                pool = pools.get(parameter["name"], [])
                if path.endswith("/finish"):
                    # Finishing A's main session would turn the rest of the fuzz into 410s.
                    pool = [v for v in pool if v != world.a.session_id]
                if pool:
                    parameter["schema"] = {"anyOf": [parameter["schema"], {"enum": pool}]}
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None:
                body["schema"] = _seed(body["schema"], pools)
    return doc


def send_case(world: World, case: Any) -> None:
    kwargs = case.as_transport_kwargs(base_url="http://tuneloop")
    prepared = requests.Request(
        method=kwargs["method"],
        url=kwargs["url"],
        headers=kwargs.get("headers"),
        params=kwargs.get("params"),
        json=kwargs.get("json"),
        data=kwargs.get("data"),
    ).prepare()
    body = prepared.body.encode() if isinstance(prepared.body, str) else prepared.body
    headers = {
        k: v
        for k, v in prepared.headers.items()
        if k.lower() not in ("content-length", "connection", "accept-encoding")
    }
    assert prepared.method is not None
    assert prepared.url is not None
    world.probe.send(prepared.method, prepared.url, content=body, headers=headers)


@pytest.mark.slow
def test_every_operation_fuzzed(fuzz_world: World) -> None:
    document = fuzz_world.http.app.openapi()  # type: ignore[attr-defined]
    schema = schemathesis.openapi.from_dict(seeded_document(document, fuzz_world))
    operations = [result.ok() for result in schema.get_all_operations()]
    expected = {(m.upper(), p) for p, ops in document["paths"].items() for m in ops}
    assert {(op.method.upper(), op.path) for op in operations} == expected

    start = fuzz_world.probe.sent
    per_operation: dict[str, int] = {}
    for operation in operations:
        before = fuzz_world.probe.sent
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @_settings(EXAMPLES)
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                send_case(fuzz_world, case)

            try:
                run()
            except Unsatisfiable:
                # No schema-breaking request exists for some operations (an opaque binary
                # body, path parameters that take any string): positive cases cover them.
                assert mode is GenerationMode.NEGATIVE, operation.label
        per_operation[operation.label] = fuzz_world.probe.sent - before

    assert all(per_operation.values()), per_operation
    sent = fuzz_world.probe.sent - start
    assert sent >= MIN_REQUESTS, (sent, per_operation)
    fuzz_world.assert_healthy()
