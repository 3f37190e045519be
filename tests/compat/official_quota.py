"""The official `tinker` SDK against a server with tight quotas: `python -m` this module.

The server runs with --max-inflight 1 --max-sessions 2. The SDK's own backoff must carry every
refused (429) request through once capacity frees: a model's creation and a training step while
another request holds the tenant's one slot, concurrent samples, and a third ServiceClient whose
session waits until one of the two live ones finishes. The SDK's HTTP responses are counted, so
the run shows that 429s did happen and were retried.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import warnings
from typing import Any

import httpx
import tinker

types = tinker.types
MODEL = "tuneloop/fake-tiny"  # overridden by the third argument
# (path, status) -> count, over every response the SDK received.
responses: collections.Counter[tuple[str, int]] = collections.Counter()
_send = httpx.AsyncClient.send


async def _counting_send(self: httpx.AsyncClient, request: httpx.Request, **kw: Any) -> Any:
    response = await _send(self, request, **kw)
    responses[(request.url.path.rsplit("/", 1)[-1], response.status_code)] += 1
    return response


httpx.AsyncClient.send = _counting_send  # type: ignore[method-assign]


def _datum(tokens: list[int]) -> Any:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


class Blocker:
    """Holds the tenant's one in-flight slot from outside the SDK, over raw HTTP: an optim_step
    whose seq_id waits for an earlier one; sending that earlier one frees the slot."""

    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(base_url=url, headers={"x-api-key": key}, timeout=30)
        self.session_id = self.http.post("/api/v1/create_session", json={}).json()["session_id"]
        created = self.http.post(
            "/api/v1/create_model",
            json={"session_id": self.session_id, "model_seq_id": 0, "base_model": MODEL},
        ).json()
        self.model_id = self._result(created["request_id"])["model_id"]
        self.next_seq = 1

    def _result(self, request_id: str) -> Any:
        while True:
            polled = self.http.post("/api/v1/retrieve_future", json={"request_id": request_id})
            if polled.status_code != 408:
                return polled.json()

    def _step(self, seq_id: int) -> Any:
        body = {"model_id": self.model_id, "seq_id": seq_id, "adam_params": {}}
        response = self.http.post("/api/v1/optim_step", json=body)
        assert response.status_code == 200, response.text
        return response.json()["request_id"]

    def hold_then_free(self, after_s: float) -> None:
        """Take the slot now; free it after `after_s` seconds, from a timer thread."""
        early, late = self.next_seq, self.next_seq + 1
        self.next_seq += 2
        waiting = self._step(late)

        def free() -> None:
            self._result(self._step(early))
            self._result(waiting)

        threading.Timer(after_s, free).start()


def run(url: str, key: str) -> None:
    blocker = Blocker(url, key)  # one of the two sessions the tenant may have
    service = tinker.ServiceClient(base_url=url, api_key=key)

    # The model's creation (seq 0) is refused while the slot is held, and retried by the SDK.
    blocker.hold_then_free(2.0)
    started = time.monotonic()
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    assert time.monotonic() - started >= 1.5
    ce = _datum([5, 17, 33, 90, 120, 7, 64, 12])

    # A refused forward_backward is retried with the same seq_id; the steps after it run in
    # order once it is in (a seq_id consumed by the 429 would fail the retry with a 409).
    blocker.hold_then_free(2.0)
    first = training.forward_backward([ce], "cross_entropy")
    step = training.optim_step(types.AdamParams(learning_rate=0.05))
    second = training.forward_backward([ce], "cross_entropy")
    before = first.result().metrics["loss:sum"]
    step.result()
    after = second.result().metrics["loss:sum"]
    assert after < before, (before, after)

    # Concurrent samples: one in flight at a time, the rest refused and retried.
    sampler = training.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=1)
    prompt = types.ModelInput.from_ints([5, 17, 33])
    pending = [sampler.sample(prompt, 1, params) for _ in range(4)]
    for future in pending:
        assert len(future.result().sequences) == 1

    refused = {path for (path, status) in responses if status == 429}
    assert {"create_model", "forward_backward", "asample"} <= refused, responses

    # A third session waits (429, retried by the SDK) until one of the two live ones finishes.
    made: list[tuple[tinker.ServiceClient, Any]] = []

    def third_session() -> None:
        client = tinker.ServiceClient(base_url=url, api_key=key)
        # The SDK makes its session on first use, not in the constructor.
        made.append((client, client.create_lora_training_client(base_model=MODEL, rank=4)))

    started = time.monotonic()
    third = threading.Thread(target=third_session, daemon=True)
    third.start()
    time.sleep(2.0)
    assert not made, "a third session got in while two were live"
    assert responses[("create_session", 429)] >= 1, responses
    service.close("success").result()
    third.join(timeout=60)
    assert made, "the third session never got in"
    waited = time.monotonic() - started
    client, other = made[0]
    assert other.result().forward([ce], "cross_entropy").result().metrics["loss:sum"] > 0
    client.close("success").result()
    counts = {f"{path}:{status}": n for (path, status), n in sorted(responses.items())}
    print(f"responses {counts}; the third session waited {waited:.1f} s")


if __name__ == "__main__":
    warnings.simplefilter("ignore", FutureWarning)
    if len(sys.argv) > 3:
        MODEL = sys.argv[3]
    run(sys.argv[1], sys.argv[2])
    print("official SDK quota flow: OK")
