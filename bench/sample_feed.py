"""1,000 samples in flight from the official tinker SDK, with and without the batch completion
feed (`sample_use_retrieve_futures`): futures completed per second, and the CPU seconds the
server and the client spent, side by side in one run against one `tuneloop serve` (fake backend:
this measures the control plane, not a model).

Without the feed the SDK holds one long-polled `retrieve_future` per sample (1,000 requests
held open); with it, one `retrieve_futures` poll per sampling session, then one payload fetch
per completed sample. The "off" runs turn the flag off in the client after it read the server's
config: same server, same build, only the polling differs.

    python bench/sample_feed.py [--samples 1000] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tuneloop._local_server import live_server

MODEL = "tuneloop/fake-tiny"
ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def client(url: str, key: str, samples: int, feed: bool) -> dict[str, Any]:
    """In a child process (the SDK's holder is per process): submit `samples` samples at once,
    wait for all; seconds, and the process's CPU seconds."""
    import tinker

    service = tinker.ServiceClient(base_url=url, api_key=key)
    sampler = service.create_sampling_client(base_model=MODEL).result()
    holder = sampler.holder
    if not feed:
        config = holder.get_client_config()
        holder._client_config = config.model_copy(update={"sample_use_retrieve_futures": False})
    prompt = tinker.types.ModelInput.from_ints(list(range(10, 42)))
    params = tinker.types.SamplingParams(max_tokens=16, seed=1)
    sampler.sample(prompt, 1, params).result()  # warm: connections, the poller
    cpu0 = time.process_time()
    start = time.perf_counter()
    futures = [sampler.sample(prompt, 1, params) for _ in range(samples)]
    results = [f.result(timeout=600) for f in futures]
    seconds = time.perf_counter() - start
    assert all(len(r.sequences[0].tokens) == 16 for r in results)  # none lost or cut
    return {"seconds": seconds, "client_cpu_s": time.process_time() - cpu0}


async def raw_client(url: str, key: str, samples: int, feed: bool) -> dict[str, Any]:
    """The same two ways of learning completions over plain httpx (no SDK): what each costs
    the server alone. 64 connections; every sample submitted at once."""
    import asyncio

    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    headers = {"X-API-Key": key}
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=60) as http:
        session = (await http.post("/api/v1/create_session", json={"tags": []})).json()
        body = {"session_id": session["session_id"], "sampling_session_seq_id": 0}
        made = await http.post(
            "/api/v1/create_sampling_session", json={**body, "base_model": MODEL}
        )
        sampler = made.json()["sampling_session_id"]
        prompt = {"chunks": [{"type": "encoded_text", "tokens": list(range(10, 42))}]}
        params = {"max_tokens": 16, "seed": 1}

        async def submit(i: int) -> str:
            sample = {"sampling_session_id": sampler, "seq_id": i, "prompt": prompt}
            answer = await http.post("/api/v1/asample", json={**sample, "sampling_params": params})
            return str(answer.json()["request_id"])

        async def fetch(request_id: str) -> None:
            while True:
                got = await http.post("/api/v1/retrieve_future", json={"request_id": request_id})
                if got.status_code == 200:
                    return
                assert got.status_code == 408, got.text

        start = time.perf_counter()
        ids = await asyncio.gather(*(submit(i) for i in range(samples)))
        if feed:
            pending, cursor, fetches = set(ids), 0, []
            while pending:
                target = {"sampling_session_id": sampler}
                page = await http.post(
                    "/api/v1/retrieve_futures", json={"target": target, "prev_cursor": cursor}
                )
                cursor = page.json()["cursor"]
                done = [c["request_id"] for c in page.json()["completions"]]
                pending -= set(done)
                fetches += [asyncio.ensure_future(fetch(r)) for r in done]
            await asyncio.gather(*fetches)
        else:
            await asyncio.gather(*(fetch(r) for r in ids))
        return {"seconds": time.perf_counter() - start, "client_cpu_s": 0.0}


def open_sockets(pid: int) -> int:
    """Sockets process `pid` holds open now (its listening socket and every connection)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed while listed
            count += os.readlink(fd).startswith("socket:")
    return count


def run_mode(
    url: str, key: str, pid: int, samples: int, feed: bool, raw: bool = False
) -> dict[str, Any]:
    before = cpu_seconds(pid)
    peak = [0]
    stop = threading.Event()

    def watch() -> None:  # the server's open connections, every 20 ms
        while not stop.wait(0.02):
            peak[0] = max(peak[0], open_sockets(pid))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child-raw" if raw else "--child",
            url,
            key,
            str(samples),
            "on" if feed else "off",
        ],
        cwd=ROOT,
        env={**os.environ, "TINKER_TELEMETRY": "0"},
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    stop.set()
    watcher.join()
    server_cpu = cpu_seconds(pid) - before  # includes the child's startup requests (small)
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        **measured,
        "futures_per_s": samples / measured["seconds"],
        "server_cpu_s": server_cpu,
        "server_peak_sockets": peak[0],
    }


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {
        "feed": [],
        "per_sample_poll": [],
        "raw_feed": [],
        "raw_per_sample_poll": [],
    }
    # The default 30 s long poll (live_server's is 5 s): a held per-sample poll is re-sent
    # only once it has waited that long, as against a production server.
    with (
        tempfile.TemporaryDirectory() as tmp,
        live_server(Path(tmp), "--long-poll-s", "30", backend="fake", models=(MODEL,)) as live,
    ):
        pid = live.process.pid
        for _ in range(args.rounds):  # alternated, so drift hits both alike
            runs["feed"].append(run_mode(live.url, live.key, pid, args.samples, True))
            runs["per_sample_poll"].append(run_mode(live.url, live.key, pid, args.samples, False))
            for name, feed in (("raw_feed", True), ("raw_per_sample_poll", False)):
                runs[name].append(run_mode(live.url, live.key, pid, args.samples, feed, raw=True))
    summary = {
        mode: {
            k: round(statistics.median(r[k] for r in rs), 3)
            for k in (
                "futures_per_s",
                "server_cpu_s",
                "client_cpu_s",
                "seconds",
                "server_peak_sockets",
            )
        }
        for mode, rs in runs.items()
    }
    report = {
        "samples_in_flight": args.samples,
        "rounds": args.rounds,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "median": summary,
        "ratios_feed_over_poll": {
            f"{prefix}{k}": round(
                summary[f"{prefix}feed"][k] / summary[f"{prefix}per_sample_poll"][k], 2
            )
            for prefix in ("", "raw_")
            for k in ("futures_per_s", "server_cpu_s")
        },
        "runs": runs,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        url, key, samples, mode = sys.argv[2:6]
        print(json.dumps(client(url, key, int(samples), mode == "on")))
    elif len(sys.argv) > 1 and sys.argv[1] == "--child-raw":
        import asyncio

        url, key, samples, mode = sys.argv[2:6]
        print(json.dumps(asyncio.run(raw_client(url, key, int(samples), mode == "on"))))
    else:
        main()
