"""A hostile tenant's raw HTTP view of a running `tuneloop serve`, and what it may observe.

The hostile side speaks the wire directly (an SDK would refuse most of what it sends); every
answer it gets is recorded, so a test can check that none was a 5xx and that every JSON body
was plain JSON (no NaN / Infinity literals).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tuneloop.types import Datum, ModelInput
from tuneloop.types.codec import ForwardBackwardRequest, encode_forward_backward_request

__all__ = ["Answer", "Tenant", "read_checkpoint", "scale_checkpoint", "strict_json"]

# A future is polled at most this long (the server long-polls 5 s per request).
RESULT_TIMEOUT_S = 120.0


def strict_json(text: str) -> Any:
    """JSON as a strict client parses it: the literals NaN, Infinity and -Infinity refused."""

    def refuse(literal: str) -> Any:
        raise ValueError(f"non-JSON literal {literal} in a response")

    return json.loads(text, parse_constant=refuse)


@dataclass(frozen=True)
class Answer:
    """What one request got: the HTTP status of the submission and, for a future, its result."""

    what: str
    status: int
    body: Any  # parsed JSON (strictly), or the raw bytes of a protobuf result

    @property
    def failed_as(self) -> str | None:
        """The error category of a failed future ("user", "server"), None if it succeeded."""
        if isinstance(self.body, dict) and "error" in self.body:
            return str(self.body.get("category"))
        return None


@dataclass
class Tenant:
    url: str
    key: str
    answers: list[Answer] = field(default_factory=list)
    _seq: dict[str, int] = field(default_factory=dict)
    _client: httpx.Client | None = None

    @property
    def http(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(
                base_url=self.url, headers={"x-api-key": self.key}, timeout=60.0
            )
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    # ---- raw requests ---------------------------------------------------------------------

    def post(self, what: str, path: str, body: Any) -> httpx.Response:
        """POST `body` as JSON the way Python writes it (inf -> Infinity, nan -> NaN)."""
        return self.http.post(
            f"/api/v1/{path}",
            content=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )

    def submit(self, what: str, path: str, body: Any, *, proto: bytes | None = None) -> Answer:
        """A request that answers with a future; returns the future's outcome (or the refusal)."""
        if proto is not None:
            response = self.http.post(
                f"/api/v1/{path}",
                content=proto,
                headers={"content-type": "application/x-protobuf"},
            )
        else:
            response = self.post(what, path, body)
        return self.follow(what, response)

    def follow(self, what: str, response: httpx.Response) -> Answer:
        if response.status_code != 200:
            return self._record(Answer(what, response.status_code, strict_json(response.text)))
        request_id = strict_json(response.text)["request_id"]
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while time.monotonic() < deadline:
            polled = self.post(what, "retrieve_future", {"request_id": request_id})
            if polled.status_code == 408:
                continue
            if polled.headers.get("content-type", "").startswith("application/json"):
                body: Any = strict_json(polled.text)
            else:
                body = polled.content
            return self._record(Answer(what, polled.status_code, body))
        raise AssertionError(f"{what}: no result within {RESULT_TIMEOUT_S} s")

    def _record(self, answer: Answer) -> Answer:
        self.answers.append(answer)
        return answer

    # ---- the steps a tenant repeats -------------------------------------------------------

    def session(self) -> str:
        response = self.post("session", "create_session", {"tags": [], "sdk_version": "poison"})
        assert response.status_code == 200, response.text
        return str(strict_json(response.text)["session_id"])

    def model(self, session_id: str, base_model: str, seed: int = 0) -> str:
        body = {
            "session_id": session_id,
            "model_seq_id": 0,
            "base_model": base_model,
            "lora_config": {"rank": 4, "seed": seed},
        }
        answer = self.submit("create_model", "create_model", body)
        assert answer.failed_as is None, answer
        model_id = str(answer.body["model_id"])
        self._seq[model_id] = 1
        return model_id

    def next_seq(self, model_id: str) -> int:
        """The model's next seq_id; every training request takes one, refused or not."""
        seq = self._seq[model_id]
        self._seq[model_id] = seq + 1
        return seq

    def forward_backward(
        self, model_id: str, tokens: list[int], weight: float = 1.0, forward_only: bool = False
    ) -> Answer:
        n = len(tokens) - 1
        datum = Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                "weights": np.full(n, weight, dtype=np.float32),
            },
        )
        request = ForwardBackwardRequest(
            model_id, self.next_seq(model_id), [datum], "cross_entropy", {}, forward_only
        )
        proto = encode_forward_backward_request(request)
        return self.submit("forward_backward", "forward_backward", None, proto=proto)

    def optim_step(self, model_id: str, **adam: float) -> Answer:
        body = {"model_id": model_id, "seq_id": self.next_seq(model_id), "adam_params": adam}
        return self.submit(f"optim_step {adam}", "optim_step", body)

    def save(self, model_id: str, kind: str, name: str) -> str:
        """save_weights ("weights") or save_weights_for_sampler ("sampler"): the tinker path."""
        route = "save_weights" if kind == "weights" else "save_weights_for_sampler"
        body = {"model_id": model_id, "path": name, "seq_id": self.next_seq(model_id)}
        answer = self.submit(route, route, body)
        assert answer.failed_as is None, answer
        return str(answer.body["path"])

    def sampler(self, session_id: str, model_path: str, seq: int) -> str:
        body = {"session_id": session_id, "sampling_session_seq_id": seq, "model_path": model_path}
        response = self.post("create_sampling_session", "create_sampling_session", body)
        assert response.status_code == 200, response.text
        return str(strict_json(response.text)["sampling_session_id"])

    def asample(self, sampler_id: str, tokens: list[int], seed: int) -> httpx.Response:
        """Submit one sample request (the caller follows it, so several can be in flight)."""
        body = {
            "sampling_session_id": sampler_id,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
            "num_samples": 2,
            "sampling_params": {"max_tokens": 6, "seed": seed},
        }
        return self.post("asample", "asample", body)


def read_checkpoint(data_dir: Path, name: str) -> dict[str, np.ndarray]:
    """The weights of checkpoint `name` on disk, in whatever format the backend wrote them
    (the fake's weights.npz, the torch engine's safetensors)."""
    [directory] = [p for p in data_dir.rglob(name) if p.is_dir()]
    npz = directory / "weights.npz"
    if npz.exists():
        with np.load(npz) as data:
            return {k: data[k] for k in data.files}
    from safetensors.numpy import load_file

    return dict(load_file(str(directory / "adapter_model.safetensors")))


def scale_checkpoint(data_dir: Path, name: str, factor: float) -> None:
    """Multiply the weights of checkpoint `name` on disk by `factor`: the stand-in for a
    checkpoint an older, unchecked version wrote, or bit rot."""
    [directory] = [p for p in data_dir.rglob(name) if p.is_dir()]
    arrays = {
        k: v * np.asarray(factor, v.dtype) if np.issubdtype(v.dtype, np.floating) else v
        for k, v in read_checkpoint(data_dir, name).items()
    }
    npz = directory / "weights.npz"
    if npz.exists():
        np.savez(npz, **arrays)
        return
    from safetensors.numpy import save_file

    save_file(arrays, str(directory / "adapter_model.safetensors"))
