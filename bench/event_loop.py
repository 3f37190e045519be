"""Event-loop stalls: how long one tenant's large body delays another tenant's small requests.

A real `tuneloop serve` (fake backend) on 127.0.0.1. Tenant A sends forward_backward bodies of
~60 MB (1,900 datums of 2,047 tokens with weights), the last datum's targets outside the
vocabulary, so the server decodes, validates and hashes the whole body and answers 400 without
running the engine. Meanwhile tenant B, on its own connection, sends GET /api/v1/healthz and a
retrieve_future of a finished request back to back, and each latency is recorded. Reported: B's
latency p50 / p99 / max while A's bodies are in the server and while the server is idle.

Meanwhile tenant C, from a process of its own, trains a small model step by step
(forward_backward, optim_step, a heartbeat; a save every 10th step): the registry work of every
submission and finish step. With `--db-url` the registry is that PostgreSQL server (each run in a
fresh schema, dropped after), else SQLite.

Side by side in one run, alternating over `--rounds`: the server as shipped (bodies over 256 KiB
decoded, validated and hashed on a worker thread; registry statements on database threads), the
same server with its registry calls made on the event loop (`db_inline`, as before), and with
the body threshold raised past any body too (`inline`: everything on the event loop); and
without the garbage-collector measures of api/large_body.py (`no_gc_tuning`: no heap frozen at
startup, no collections paused while a large body decodes), without the parse in pieces of
types/proto_pieces.py (`whole_parse`), or without both (`before`). With `--slow-callbacks` the
server logs every event-loop callback that ran over 10 ms (asyncio debug mode, which costs time
itself), and the report lists what they were; with `--gc-log` every garbage collection over 3 ms.

    python bench/event_loop.py [--bodies 3] [--rounds 2] [--db-url postgresql://...] [--json out]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

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
DB_INLINE = (
    "import tuneloop.server.api.state as st; "
    "exec('async def _inline(self, fn, *args):\\n    return fn(*args)', vars(st)); "
    "st.ServerState.db = st.ServerState.db_write = st._inline"
)
# Without the garbage-collector measures of api/large_body.py (no freeze, no pause).
NO_GC_TUNING = "import tuneloop.server.api.large_body as lb; lb.ENABLED = False"
# A large body parsed in one call, not in pieces (types/proto_pieces.py).
WHOLE_PARSE = "import tuneloop.types.proto_pieces as pp; pp.PIECE_BYTES = 2**62"
# Large bodies decoded on a worker thread, not in the decoding process (api/decode_pool.py).
THREAD = "import tuneloop.server.api.training as tr; tr.PROCESS_BYTES = 2**62"
# On the thread, with token chunks decoded into Python lists of ints, as before they were arrays.
TOKEN_LISTS = (
    THREAD + "; import tuneloop.types.codec as cd; "
    "tr._request_arrays = cd.forward_backward_request_from_proto"
)
VARIANTS = {
    "shipped": "",
    "thread": THREAD,
    "token_lists": TOKEN_LISTS,
    "no_gc_tuning": NO_GC_TUNING,
    "whole_parse": WHOLE_PARSE,
    # Both: the server as it was before them.
    "before": NO_GC_TUNING + "; " + WHOLE_PARSE,
    "db_inline": DB_INLINE,
    "inline": DB_INLINE + "; import tuneloop.server.api.deps as deps; deps.OFF_LOOP_BYTES = 2**62",
}
# Every event-loop callback over 10 ms is logged (asyncio debug mode).
SLOW_CALLBACKS = (
    "import asyncio, logging, asyncio.base_events as be; "
    "logging.getLogger('asyncio').addHandler(logging.StreamHandler(sys.stdout)); "
    "_init = be.BaseEventLoop.__init__; "
    "be.BaseEventLoop.__init__ = lambda self, *a, **k: "
    "(_init(self, *a, **k), self.set_debug(True), setattr(self, 'slow_callback_duration', 0.01))"
    "[0]; "
    # uvicorn's runner turns debug off again: keep it on.
    "_set_debug = be.BaseEventLoop.set_debug; "
    "be.BaseEventLoop.set_debug = lambda self, enabled: _set_debug(self, True)"
)
# Every garbage collection over 3 ms is logged, with its generation.
GC_LOG = "exec({code!r})".format(
    code=(
        "import gc, time\n"
        "_gc_started = [0.0]\n"
        "def _gc_timed(phase, info):\n"
        "    if phase == 'start':\n"
        "        _gc_started[0] = time.perf_counter()\n"
        "        return\n"
        "    took = time.perf_counter() - _gc_started[0]\n"
        "    if took > 0.003:\n"
        "        print(f'gc generation {info[\"generation\"]} took {took:.4f} s', flush=True)\n"
        "gc.callbacks.append(_gc_timed)\n"
    )
)
LAUNCH = (
    "import sys, runpy; {prelude}; sys.argv = ['tuneloop', *sys.argv[1:]]; "
    "runpy.run_module('tuneloop', run_name='__main__')"
)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


@contextlib.contextmanager
def postgres_schema(base_url: str) -> Iterator[str]:
    """A fresh schema on the PostgreSQL server; a URL whose connections use it. Dropped after."""
    import psycopg  # the server extra's driver

    schema = f"bench_{secrets.token_hex(6)}"
    with psycopg.connect(base_url, connect_timeout=5, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
    separator = "&" if "?" in base_url else "?"
    try:
        yield f"{base_url}{separator}options={quote(f'-csearch_path={schema}')}"
    finally:
        with psycopg.connect(base_url, connect_timeout=5, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@contextlib.contextmanager
def serve(
    data_dir: Path, variant: str, db_url: str | None, log: list[str], slow: bool, gc_log: bool
) -> Iterator[str]:
    args = ["serve", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir)]
    args += ["--backend", "fake", "--long-poll-s", "1", "--parent-pid", str(os.getpid())]
    if db_url is not None:
        args += ["--db-url", db_url]
    preludes = (VARIANTS[variant], SLOW_CALLBACKS if slow else "", GC_LOG if gc_log else "")
    prelude = "; ".join(p for p in preludes if p)
    command = [sys.executable, "-u", "-c", LAUNCH.format(prelude=prelude or "pass"), *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("tuneloop serving at "):
                url = line.split(" at ", 1)[1].strip()
                break
        else:
            raise RuntimeError("server did not start")
        # Keep the pipe drained, the lines kept (slow-callback reports).
        threading.Thread(target=lambda: log.extend(process.stdout or ()), daemon=True).start()
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
                samples.append((path, started, time.monotonic()))
            time.sleep(0.002)
    out.send(samples)


def train(url: str, key: str, until: float, out: Any) -> None:
    """Tenant C, in a process of its own: small training steps until `until`; steps done."""
    headers = {"x-api-key": key}
    steps = 0
    with httpx.Client(base_url=url, timeout=120, headers=headers) as c:
        model_id, _ = setup(c, key)
        session_id = model_id.split(":train:")[0]
        datum = Datum(
            ModelInput.from_ints(list(range(1, 33))),
            {"target_tokens": np.arange(2, 34, dtype=np.int64)},
        )
        seq = 1

        def result(response: httpx.Response) -> None:
            assert response.status_code == 200, response.text[:200]
            poll = {"request_id": response.json()["request_id"]}
            while c.post("/api/v1/retrieve_future", json=poll).status_code == 408:
                pass

        while time.monotonic() < until:
            body = encode_forward_backward_request(
                ForwardBackwardRequest(model_id, seq, [datum], "cross_entropy")
            )
            proto = {"content-type": "application/x-protobuf"}
            result(c.post("/api/v1/forward_backward", content=body, headers=proto))
            optim = {
                "model_id": model_id,
                "seq_id": seq + 1,
                "adam_params": {"learning_rate": 0.01},
            }
            result(c.post("/api/v1/optim_step", json=optim))
            seq += 2
            steps += 1
            if steps % 10 == 0:
                save = {"model_id": model_id, "seq_id": seq, "path": f"s{steps}"}
                result(c.post("/api/v1/save_weights", json=save))
                seq += 1
            c.post("/api/v1/session_heartbeat", json={"session_id": session_id})
    out.send(steps)


def slow_callbacks(log: list[str]) -> dict[str, Any]:
    """asyncio's slow-callback reports: how many, the longest, and the most frequent kinds."""
    found = []
    for line in log:
        match = re.search(r"Executing (.*) took (\d+\.\d+) seconds", line)
        if match:
            # The task's coroutine and where it stood: "run_asgi at h11_impl.py:415".
            coro = re.search(r"coro=<([\w.]+)\(\) \w+,?(?: defined)? at (\S+)>", match.group(1))
            what = f"{coro[1]} at {Path(coro[2]).name}" if coro else match.group(1)[:120]
            found.append((float(match.group(2)), what))
    kinds = collections.Counter(what for _, what in found)
    return {
        "n": len(found),
        "longest_ms": [round(t * 1000, 1) for t, _ in sorted(found, reverse=True)[:5]],
        "most_frequent": kinds.most_common(5),
    }


def gc_pauses(log: list[str]) -> dict[str, Any]:
    """The garbage collections over 3 ms: how many of each generation, the longest."""
    found = [re.search(r"gc generation (\d) took (\d+\.\d+) s", line) for line in log]
    times = [(int(m[1]), float(m[2])) for m in found if m]
    return {
        "n_by_generation": dict(collections.Counter(g for g, _ in times)),
        "longest_ms": [round(t * 1000, 1) for _, t in sorted(times, key=lambda x: -x[1])[:5]],
    }


def measure(
    variant: str, bodies: int, db_url: str | None, slow: bool, gc_log: bool
) -> dict[str, Any]:
    log: list[str] = []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        url_db = stack.enter_context(postgres_schema(db_url)) if db_url else None
        url = stack.enter_context(serve(Path(tmp), variant, url_db, log, slow, gc_log))
        key_a, key_b = create_key(Path(tmp), "a"), create_key(Path(tmp), "b")
        key_c = create_key(Path(tmp), "c")
        with httpx.Client(base_url=url, timeout=120) as a, httpx.Client(base_url=url) as b:
            model_id, _ = setup(a, key_a)
            _, done_id = setup(b, key_b)
        body = big_body(model_id, 1)
        receiver, sender = multiprocessing.Pipe(duplex=False)
        c_receiver, c_sender = multiprocessing.Pipe(duplex=False)
        until = time.monotonic() + 2.0 + bodies * 8.0
        prober = multiprocessing.Process(target=probe, args=(url, key_b, done_id, until, sender))
        trainer = multiprocessing.Process(target=train, args=(url, key_c, until, c_sender))
        trainer.start()
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
        c_steps = c_receiver.recv()
        trainer.join()

    def overlaps(sample: tuple[float, float]) -> bool:
        return any(sample[0] < end and sample[1] > start for start, end in windows)

    polls = [(s, e) for path, s, e in samples if path == "retrieve_future"]
    everything = [(s, e) for _path, s, e in samples]

    return {
        "body_mb": round(len(body) / 1e6, 1),
        "body_answered_s": [round(t, 2) for t in took],
        "b_while_a_body": summary([e - s for s, e in everything if overlaps((s, e))]),
        "b_idle": summary([e - s for s, e in everything if not overlaps((s, e))]),
        "b_all": summary([e - s for s, e in everything]),
        # retrieve_future alone (the measure): during A's bodies, and over the whole run.
        "b_retrieve_future_while_a_body": summary([e - s for s, e in polls if overlaps((s, e))]),
        "b_retrieve_future_all": summary([e - s for s, e in polls]),
        # The noise floor: the machine's own load, with no body in the server.
        "b_retrieve_future_idle": summary([e - s for s, e in polls if not overlaps((s, e))]),
        "uptime": uptime(),
        "c_training_steps": c_steps,
        **({"slow_callbacks": slow_callbacks(log)} if slow else {}),
        **({"collections_over_3ms": gc_pauses(log)} if gc_log else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bodies", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=1, help="variants alternate, round by round")
    parser.add_argument("--db-url", help="a PostgreSQL server for the registry (else SQLite)")
    parser.add_argument("--slow-callbacks", action="store_true")
    parser.add_argument("--gc-log", action="store_true", help="log collections over 3 ms")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in args.variants}
    for _ in range(args.rounds):
        for variant in args.variants:
            runs[variant].append(
                measure(variant, args.bodies, args.db_url, args.slow_callbacks, args.gc_log)
            )
    results = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "registry": "postgresql" if args.db_url else "sqlite",
        **runs,
    }
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
