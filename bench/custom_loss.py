"""Custom-loss benchmark: the official SDK's `forward_backward_custom` with a loss uploaded by
`create_custom_loss` (one forward_backward on the server) next to the same loss as a plain
callable (the SDK's client-side protocol: a forward pass, the loss and its backward on the
client, then a second forward_backward with surrogate weights), against one `tuneloop serve`
with the torch engine, alternating round by round so both see the same machine load.

    python bench/custom_loss.py [--model tuneloop/tiny-qwen3] [--rounds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import tinker
import torch
import torch.nn.functional as F  # noqa: N812

from tuneloop._local_server import live_server

types = tinker.types
BETA = 0.1


def dpo_style(logprobs, ref_logprobs, weights, sign):  # type: ignore[no-untyped-def]
    margin = ((logprobs - ref_logprobs) * weights).sum()
    return -F.logsigmoid(BETA * sign * margin), {"custom/margin:mean": margin.detach()}


def client_side(data: list[Any], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    total: Any = 0
    for datum, lp in zip(data, logprobs, strict=True):
        keys = ("ref_logprobs", "weights", "sign")
        loss, _ = dpo_style(lp, *(datum.loss_fn_inputs[k].to_torch() for k in keys))
        total = total + loss
    return total, {}


def batch(datums: int, length: int, vocab: int) -> list[Any]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(datums):
        ids = rng.integers(0, vocab, size=length + 1).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": ids[1:],
                    "ref_logprobs": types.TensorData.from_numpy(
                        rng.normal(-5.0, 0.5, size=length).astype(np.float32)
                    ),
                    "weights": types.TensorData.from_numpy(np.ones(length, dtype=np.float32)),
                    "sign": types.TensorData.from_numpy(
                        np.asarray(float(i % 2 * 2 - 1), np.float32)
                    ),
                },
            )
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tuneloop/tiny-qwen3")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--datums", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    with (
        tempfile.TemporaryDirectory() as data_dir,
        live_server(Path(data_dir), backend="torch", models=(args.model,)) as server,
    ):
        service = tinker.ServiceClient(base_url=server.url, api_key=server.key)
        training = service.create_lora_training_client(base_model=args.model, rank=8).result()
        vocab = len(training.get_tokenizer())
        data = batch(args.datums, args.length, min(vocab, 250))
        handle = service.create_custom_loss(
            dpo_style, {"logprobs": 1, "ref_logprobs": 1, "weights": 1, "sign": 0}
        ).result()
        assert handle.loss_id is not None
        times: dict[str, list[float]] = {"server_side": [], "client_side": []}
        for round_ in range(args.rounds + 1):
            for name, loss in (("server_side", handle), ("client_side", client_side)):
                start = time.perf_counter()
                training.forward_backward_custom(data, loss).result()
                if round_:  # round 0 warms up
                    times[name].append(time.perf_counter() - start)
    report: dict[str, Any] = {
        name: {"p50_ms": round(statistics.median(t) * 1000, 1)} for name, t in times.items()
    }
    report["client_over_server"] = round(
        report["client_side"]["p50_ms"] / report["server_side"]["p50_ms"], 2
    )
    report["setup"] = {
        "model": args.model,
        "datums": args.datums,
        "length": args.length,
        "rounds": args.rounds,
        "cpu": platform.processor() or platform.machine(),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
