"""The fuzz's world: one in-process server (fake backend), tenant A who fuzzes, tenant B who owns
real resources A must never see, and a probe that sends every request and checks its answer.

Synchronous (starlette's TestClient runs the app and its engine loop on one portal thread for the
whole run) so that hypothesis drives it directly.
"""

from __future__ import annotations

import json
import secrets
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import numpy as np
from starlette.testclient import TestClient

from tuneloop.server.app import create_app
from tuneloop.server.config import ServerConfig
from tuneloop.server.storage.keys import KeyStore
from tuneloop.types import Datum, ModelInput
from tuneloop.types.codec import ForwardBackwardRequest, encode_forward_backward_request

MODEL = "tuneloop/fake-tiny"
PROTO = "application/x-protobuf"
TOKENS = [5, 17, 33, 90, 120, 7]


class FuzzFindingError(AssertionError):
    """A 5xx, a crash or a cross-tenant leak, with the request that reproduces it."""


@dataclass
class Owned:
    """One tenant's live resources, and every string that identifies them."""

    tenant: str
    key: str
    session_id: str
    model_id: str
    sampler_id: str
    weights_path: str
    sampler_path: str
    pending_request_id: str
    done_request_id: str
    spare_session_id: str
    marker: str  # in the session's user_metadata: B's metadata must never reach A

    @property
    def ids(self) -> dict[str, list[str]]:
        """Values to seed into fields of each name (A's and B's ids alike go into the fuzz)."""
        return {
            "session_id": [self.session_id, self.spare_session_id],
            "model_id": [self.model_id],
            "run_id": [self.model_id],
            "sampler_id": [self.sampler_id],
            "sampling_session_id": [self.sampler_id],
            "request_id": [self.pending_request_id, self.done_request_id],
            "path": [self.weights_path, self.sampler_path],
            "model_path": [self.sampler_path, self.weights_path],
            "tinker_path": [self.weights_path, self.sampler_path],
            "checkpoint_id": [p.split("/", 3)[3] for p in (self.weights_path, self.sampler_path)],
        }

    @property
    def secrets(self) -> list[str]:
        """Strings that must never appear in an answer to the other tenant, unless it sent them."""
        return [
            self.tenant,
            self.key,
            self.session_id,
            self.spare_session_id,
            self.model_id,
            self.sampler_id,
            self.weights_path,
            self.sampler_path,
            self.pending_request_id,
            self.done_request_id,
            self.marker,
        ]


@dataclass
class Probe:
    """Sends tenant A's requests; every answer is checked (no 5xx, nothing of B's) and counted."""

    http: TestClient
    key: str
    other: Owned
    sent: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    # Futures A was given, with the request that made each: a future that resolves to a
    # server-side error is a 5xx in disguise.
    futures: dict[str, str] = field(default_factory=dict)

    def send(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        params: Any = None,
        plain: bytes | None = None,
    ) -> httpx.Response:
        """`plain`: the body before any compression, for telling an echo from a leak."""
        all_headers = {"x-api-key": self.key, **(headers or {})}
        self.sent += 1
        # Built outside the try: a request the client itself refuses is the test's fault.
        request = self.http.build_request(
            method, url, content=content, headers=all_headers, params=params
        )
        try:
            response = self.http.send(request)
        except Exception as exc:  # the app raised: what a client would see as a 500
            where = _describe(method, url, all_headers, params, content)
            trace = "".join(traceback.format_exception(exc)[-12:])
            raise FuzzFindingError(f"server error (exception) for\n{where}\n{trace}") from None
        self.by_status[response.status_code] = self.by_status.get(response.status_code, 0) + 1
        request_text = _request_text(str(response.request.url), plain if plain else content)
        if response.status_code >= 500:
            raise FuzzFindingError(
                f"{response.status_code} for\n"
                f"{_describe(method, url, all_headers, params, content)}\n{response.text[:2000]}"
            )
        self._check_leak(response, request_text, method, url, all_headers, params, content)
        if response.status_code == 200 and response.headers.get("content-type", "").startswith(
            "application/json"
        ):
            request_id = response.json().get("request_id")
            if isinstance(request_id, str) and not url.endswith("/retrieve_future"):
                self.futures[request_id] = _describe(method, url, all_headers, params, content)
        return response

    def check_futures(self) -> int:
        """Retrieve every future A was handed; none may hold a server error. Returns how many
        had resolved (the rest wait for a seq_id that never comes, as the fuzz left them)."""
        resolved = 0
        for request_id, made_by in list(self.futures.items()):
            polled = self.json("POST", "retrieve_future", {"request_id": request_id})
            if polled.status_code == 408:
                continue
            del self.futures[request_id]
            resolved += 1
            body = polled.json() if "json" in polled.headers.get("content-type", "") else {}
            if isinstance(body, dict) and body.get("category") == "server":
                raise FuzzFindingError(
                    f"future {request_id} failed on the server: {body}\n{made_by}"
                )
        return resolved

    def _check_leak(
        self,
        response: httpx.Response,
        request_text: str,
        *describe: Any,
    ) -> None:
        answer = response.text + "\n" + json.dumps(dict(response.headers))
        for secret in self.other.secrets:
            if secret not in answer:
                continue
            # An error that names what the caller sent leaks nothing; anything else does: a
            # success carrying B's id, or an error naming an id A never sent.
            if response.status_code >= 400 and all(p in request_text for p in _parts(secret)):
                continue
            raise FuzzFindingError(
                f"tenant A's answer ({response.status_code}) holds B's {secret!r}:\n"
                f"{_describe(*describe)}\n{response.text[:2000]}"
            )

    def json(self, method: str, path: str, body: Any) -> httpx.Response:
        raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
        return self.send(
            method, f"/api/v1/{path}", content=raw, headers={"content-type": "application/json"}
        )


def _parts(secret: str) -> list[str]:
    # A checkpoint path may come back assembled from the run id and checkpoint id the caller
    # put in the URL (DELETE .../training_runs/{run}/checkpoints/{segment}/{name}).
    if secret.startswith("tinker://"):
        return secret.removeprefix("tinker://").split("/", 1)
    return [secret]


def _request_text(url: str, body: bytes | None) -> str:
    return unquote(url) + "\n" + (body or b"").decode("latin-1")


def _describe(
    method: str, url: str, headers: dict[str, str], params: Any, content: bytes | None
) -> str:
    shown = {k: v for k, v in headers.items() if k.lower() != "x-api-key"}
    body = repr(content[:1500]) if content is not None else "(none)"
    return f"  {method} {url} params={params!r} headers={shown!r}\n  body={body}"


# ---- building the world ----------------------------------------------------------------------


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, (response.request.url, response.text)
    out: dict[str, Any] = response.json()
    return out


class Tenant:
    """Plain (unchecked) requests of one tenant, for setting up and for health checks."""

    def __init__(self, http: TestClient, key: str) -> None:
        self.http = http
        self.key = key

    def post(self, path: str, body: Any) -> httpx.Response:
        return self.http.post(f"/api/v1/{path}", json=body, headers={"x-api-key": self.key})

    def get(self, path: str, **params: Any) -> httpx.Response:
        return self.http.get(f"/api/v1/{path}", params=params, headers={"x-api-key": self.key})

    def result(self, response: httpx.Response) -> httpx.Response:
        request_id = _ok(response)["request_id"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            polled = self.post("retrieve_future", {"request_id": request_id})
            if polled.status_code != 408:
                assert polled.status_code == 200, polled.text
                return polled
        raise AssertionError(f"future {request_id} never completed")

    def forward_backward(self, model_id: str, seq_id: int) -> httpx.Response:
        datum = Datum(
            model_input=ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={"target_tokens": np.asarray(TOKENS[1:], dtype=np.int64)},
        )
        body = encode_forward_backward_request(
            ForwardBackwardRequest(model_id, seq_id, [datum], "cross_entropy")
        )
        return self.http.post(
            "/api/v1/forward_backward",
            content=body,
            headers={"x-api-key": self.key, "content-type": PROTO},
        )

    def flow(self, name: str) -> dict[str, str]:
        """create_session, create_model, forward_backward, optim_step, save, sample: all 200."""
        marker = f"marker-{secrets.token_hex(8)}"
        session_id = _ok(
            self.post("create_session", {"tags": [name], "user_metadata": {"secret": marker}})
        )["session_id"]
        model_id = self.result(
            self.post(
                "create_model",
                {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL},
            )
        ).json()["model_id"]
        fwdbwd = self.result(self.forward_backward(model_id, 1))
        assert fwdbwd.headers["content-type"] == PROTO
        step = self.result(
            self.post(
                "optim_step",
                {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}},
            )
        )
        assert "metrics" in step.json()
        weights = self.result(
            self.post("save_weights", {"model_id": model_id, "path": "w1", "seq_id": 3})
        ).json()["path"]
        sampler_path = self.result(
            self.post("save_weights_for_sampler", {"model_id": model_id, "path": "s1", "seq_id": 4})
        ).json()["path"]
        sampler_id = _ok(
            self.post(
                "create_sampling_session",
                {
                    "session_id": session_id,
                    "sampling_session_seq_id": 0,
                    "model_path": sampler_path,
                },
            )
        )["sampling_session_id"]
        sample = {
            "sampling_session_id": sampler_id,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 7]}]},
            "sampling_params": {"max_tokens": 3, "seed": 1},
        }
        sampled = self.result(self.post("asample", sample))
        assert sampled.headers["content-type"] == PROTO
        return {
            "session_id": session_id,
            "model_id": model_id,
            "sampler_id": sampler_id,
            "weights_path": weights,
            "sampler_path": sampler_path,
            "done_request_id": _last_request_id(sampled),
            "marker": marker,
        }


def _last_request_id(response: httpx.Response) -> str:
    # The retrieve_future call that returned it carried the request id in its body.
    return str(json.loads(response.request.content)["request_id"])


def own_world(http: TestClient, keys: KeyStore, tenant: str) -> Owned:
    key, _ = keys.create(tenant)
    client = Tenant(http, key)
    made = client.flow(tenant)
    # Left unfinished: seq 6 waits for a seq 5 that never comes, so its future stays pending.
    pending = _ok(
        client.post("optim_step", {"model_id": made["model_id"], "seq_id": 6, "adam_params": {}})
    )["request_id"]
    spare = _ok(client.post("create_session", {}))["session_id"]
    return Owned(
        tenant=tenant,
        key=key,
        pending_request_id=pending,
        spare_session_id=spare,
        **made,
    )


@dataclass
class World:
    http: TestClient
    a: Owned
    b: Owned
    probe: Probe

    def assert_healthy(self) -> None:
        """No future of A's failed on the server; healthz, a full training and sampling flow
        for A, and B's resources untouched."""
        self.probe.check_futures()
        assert self.http.get("/api/v1/healthz").json() == {"status": "ok"}
        Tenant(self.http, self.a.key).flow("after-fuzz")
        b = Tenant(self.http, self.b.key)
        assert b.post("session_heartbeat", {"session_id": self.b.session_id}).status_code == 200
        listed = _ok(b.get(f"training_runs/{self.b.model_id}/checkpoints"))
        assert {c["tinker_path"] for c in listed["checkpoints"]} == {
            self.b.weights_path,
            self.b.sampler_path,
        }
        waiting = b.post("retrieve_future", {"request_id": self.b.pending_request_id})
        assert waiting.status_code == 408, waiting.text
        assert _ok(b.get(f"samplers/{self.b.sampler_id}"))["sampler_id"] == self.b.sampler_id


@contextmanager
def world(data_dir: Path) -> Iterator[World]:
    # A short long-poll: the fuzz polls pending futures, and each poll would otherwise hold 30 s.
    # No quotas: thousands of requests from one tenant would otherwise meet 429s (which the
    # quota tests cover) instead of the validation under test.
    config = ServerConfig(
        data_dir=data_dir, backend="fake", long_poll_s=0.01, max_sessions=0, max_inflight=0
    )
    app = create_app(config)
    keys = KeyStore(data_dir / "keys.json")
    with TestClient(app, base_url="http://tuneloop") as http:
        # Unique tenant names: a name in an answer to the other tenant is a leak we can see.
        a = own_world(http, keys, f"tenant-a-{secrets.token_hex(4)}")
        b = own_world(http, keys, f"tenant-b-{secrets.token_hex(4)}")
        yield World(http, a, b, Probe(http, a.key, b))
