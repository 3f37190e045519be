"""Parsing a 62 MB forward_backward body whole against in pieces: total time, longest call.

The longest single parser call is how long the GIL (so every other thread of a server) waits
for it. The body is bench/event_loop.py's (1,900 datums of 2,047 tokens with weights); the two
ways alternate over `--rounds`, and the minimum and median of each are reported.

    python bench/proto_pieces.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from event_loop import big_body, cpu_model
from tuneloop.types import proto
from tuneloop.types.proto_pieces import PIECE_BYTES, piece_ends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    body = big_body("tenant:train:0", 1)
    view = memoryview(body)
    times: dict[str, list[float]] = {"whole": [], "pieces": [], "pieces_longest_call": []}
    scan: list[float] = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        proto.ForwardBackwardRequestProto().ParseFromString(body)
        times["whole"].append(time.perf_counter() - started)
        started = time.perf_counter()
        ends = piece_ends(body)
        scan.append(time.perf_counter() - started)
        msg, start, longest = proto.ForwardBackwardRequestProto(), 0, 0.0
        for end in ends:
            call = time.perf_counter()
            msg.MergeFromString(view[start:end])
            longest = max(longest, time.perf_counter() - call)
            start = end
        times["pieces"].append(time.perf_counter() - started)
        times["pieces_longest_call"].append(longest)
    report = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "body_mb": round(len(body) / 1e6, 1),
        "pieces": len(ends),
        "piece_bytes": PIECE_BYTES,
        "scan_ms_median": round(statistics.median(scan) * 1000, 1),
        **{
            f"{name}_ms": {
                "min": round(min(values) * 1000, 1),
                "median": round(statistics.median(values) * 1000, 1),
            }
            for name, values in times.items()
        },
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
