"""Event-loop stalls: how long one tenant's large body delays another tenant's small requests.

A real `tuneloop serve` (fake backend) on 127.0.0.1. Tenant A sends forward_backward bodies of
~60 MB (1,900 datums of 2,047 tokens with weights), the last datum's targets outside the
vocabulary, so the server decodes, validates and hashes the whole body and answers 400 without
running the engine. Meanwhile tenant B, on its own connection, sends GET /api/v1/healthz and a
retrieve_future of a finished request back to back, and each latency is recorded. Reported: B's
latency p50 / p99 / max while A's bodies are in the server and while the server is idle.

Side by side in one run: the server as shipped (bodies over 256 KiB decoded, validated and
hashed on a worker thread) and the same server with that threshold raised past any body, i.e.
all of it on the event loop, as before.

    python bench/event_loop.py [--bodies 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tuneloop._local_server import create_key, stop
from tuneloop.types import Datum, ModelInput
from tuneloop.types.codec import ForwardBackwardRequest, encode_forward_backward_request

MODEL = "tuneloop/fake-tiny"
VOCAB = 259
DATUMS = 1900
TOKENS = 2047
# Runs `tuneloop serve` with the off-loop threshold raised past any body (everything inline).
# Each variant is `tuneloop serve` with a line of Python run first: as shipped, and with the
# off-loop threshold raised past any body (everything on the event loop, as before).
VARIANTS = {
    "shipped": "",
    "inline": "import tuneloop.server.api.deps as deps; deps.OFF_LOOP_BYTES = 2**62",
}
LAUNCH = (
    "import sys, runpy; {prelude}; sys.argv = ['tuneloop', *sys.argv[1:]]; "
    "runpy.run_module('tuneloop', run_name='__main__')"
)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


@contextlib.contextmanager
def serve(data_dir: Path, variant: str) -> Iterator[str]:
    args = ["serve", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir)]
    args += ["--backend", "fake", "--long-poll-s", "1", "--parent-pid", str(os.getpid())]
    command = [sys.executable, "-c", LAUNCH.format(prelude=VARIANTS[variant] or "pass"), *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("tuneloop serving at "):
                url = line.split(" at ", 1)[1].strip()
                break
        else:
            raise RuntimeError("server did not start")
        threading.Thread(target=process.stdout.read, daemon=True).start()  # keep the pipe drained
        yield url
    finally:
        stop(process)


def big_body(model_id: str, seq_id: int) -> bytes:
    rng = np.random.default_rng(0)
    data = []
    for i in range(DATUMS):
        tokens = rng.integers(0, VOCAB, TOKENS + 1)
        targets = tokens[1:].copy()
        if i == DATUMS - 1:
            targets[-1] = VOCAB  # outside the vocabulary: refused after everything was checked
        inputs = {"target_tokens": targets, "weights": np.ones(TOKENS, dtype=np.float32)}
        data.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    return encode_forward_backward_request(
        ForwardBackwardRequest(model_id, seq_id, data, "cross_entropy")
    )


def setup(http: httpx.Client, key: str) -> tuple[str, str]:
    """A session and model of the tenant: (model id, id of a finished request)."""
    headers = {"x-api-key": key}
    session = http.post("/api/v1/create_session", json={}, headers=headers).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": MODEL}
    request_id = http.post("/api/v1/create_model", json=body, headers=headers).json()["request_id"]
    while True:
        done = http.post(
            "/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers
        )
        if done.status_code == 200:
            return str(done.json()["model_id"]), str(request_id)


def summary(latencies_s: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in latencies_s)
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
        "max_ms": round(ms[-1], 2),
    }


def probe(url: str, key: str, done_id: str, until: float, out: Any) -> None:
    """Tenant B, in a process of its own (the client's GIL must not be A's): (start, end) of
    each request, on the machine-wide monotonic clock."""
    samples = []
    with httpx.Client(base_url=url, timeout=120) as b:
        headers = {"x-api-key": key}
        poll = {"request_id": done_id}
        while time.monotonic() < until:
            for path in ("healthz", "retrieve_future"):
                started = time.monotonic()
                if path == "healthz":
                    status = b.get("/api/v1/healthz").status_code
                else:
                    status = b.post(
                        "/api/v1/retrieve_future", json=poll, headers=headers
                    ).status_code
                assert status == 200
                samples.append((started, time.monotonic()))
            time.sleep(0.002)
    out.send(samples)


def measure(variant: str, bodies: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, serve(Path(tmp), variant) as url:
        key_a, key_b = create_key(Path(tmp), "a"), create_key(Path(tmp), "b")
        with httpx.Client(base_url=url, timeout=120) as a, httpx.Client(base_url=url) as b:
            model_id, _ = setup(a, key_a)
            _, done_id = setup(b, key_b)
        body = big_body(model_id, 1)
        receiver, sender = multiprocessing.Pipe(duplex=False)
        until = time.monotonic() + 2.0 + bodies * 8.0
        prober = multiprocessing.Process(target=probe, args=(url, key_b, done_id, until, sender))
        prober.start()
        time.sleep(1.0)  # idle baseline
        windows, took = [], []
        with httpx.Client(base_url=url, timeout=120) as a:
            headers = {"x-api-key": key_a, "content-type": "application/x-protobuf"}
            for _ in range(bodies):
                started = time.monotonic()
                answer = a.post("/api/v1/forward_backward", content=body, headers=headers)
                windows.append((started, time.monotonic()))
                took.append(windows[-1][1] - started)
                assert answer.status_code == 400, answer.text[:200]
                time.sleep(0.5)
        samples = receiver.recv()
        prober.join()

    def overlaps(sample: tuple[float, float]) -> bool:
        return any(sample[0] < end and sample[1] > start for start, end in windows)

    return {
        "body_mb": round(len(body) / 1e6, 1),
        "body_answered_s": [round(t, 2) for t in took],
        "b_while_a_body": summary([e - s for s, e in samples if overlaps((s, e))]),
        "b_idle": summary([e - s for s, e in samples if not overlaps((s, e))]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bodies", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    results = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        **{variant: measure(variant, args.bodies) for variant in args.variants},
    }
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
