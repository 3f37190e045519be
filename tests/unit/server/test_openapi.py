"""The OpenAPI document describes every request body, self-contained, so clients and the fuzz
(tests/fuzz) can generate them."""

from __future__ import annotations

import json
from typing import Any

from tuneloop.server.storage.keys import KeyStore

# POST routes that read no body.
BODYLESS = {
    ("post", "/api/v1/client/dynamic_config"),
    ("post", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/publish"),
}


async def test_every_body_is_declared(server: tuple[Any, KeyStore]) -> None:
    document = server[0].openapi()
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if method not in ("post", "put") or (method, path) in BODYLESS:
                continue
            content = operation.get("requestBody", {}).get("content", {})
            assert content, (method, path)
            for media_type, declared in content.items():
                assert declared["schema"], (method, path, media_type)
    forward_backward = document["paths"]["/api/v1/forward_backward"]["post"]["requestBody"]
    assert set(forward_backward["content"]) == {"application/x-protobuf"}
    sample = document["paths"]["/api/v1/asample"]["post"]["requestBody"]["content"]
    schema = sample["application/json"]["schema"]
    assert {"prompt", "sampling_params"} <= set(schema["required"])
    assert schema["additionalProperties"] is False
    # pydantic's $defs are inlined: the document has no place they would resolve in.
    assert "$defs" not in json.dumps(document)
