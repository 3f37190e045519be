"""`chat_sft` on the tiny model: it trains only assistant tokens, logs, checkpoints, and a run
resumed from its checkpoint computes exactly what an uninterrupted run does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.recipes.conftest import TINY
from tuneloop._local_server import LiveServer
from tuneloop.recipes.chat_sft import ChatSFTConfig, run_chat_sft

pytestmark = [pytest.mark.recipe, pytest.mark.integration]


def _conversations(path: Path, n: int = 24) -> Path:
    with path.open("w") as f:
        for i in range(n):
            messages = [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def _config(server: LiveServer, log_dir: Path, data: Path, **kw: object) -> ChatSFTConfig:
    values: dict[str, object] = {
        "log_dir": str(log_dir),
        "base_url": server.url,
        "api_key": server.key,
        "model": TINY,
        "data": str(data),
        "steps": 4,
        "batch_size": 4,
        "eval_every": 2,
        "save_every": 2,
        "eval_fraction": 0.2,
        "learning_rate": 1e-2,
        "progress": False,
    }
    values.update(kw)
    return ChatSFTConfig(**values)  # type: ignore[arg-type]


def _losses(log_dir: Path) -> dict[tuple[str, int], float]:
    out = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key in ("train_loss", "eval_loss"):
            if key in record:
                out[(key, record["step"])] = record[key]
    return out


def test_chat_sft_trains_logs_and_resumes_exactly(tiny_server: LiveServer, tmp_path: Path) -> None:
    data = _conversations(tmp_path / "chats.jsonl")
    whole = run_chat_sft(_config(tiny_server, tmp_path / "whole", data))
    assert whole["steps"] == 4
    losses = _losses(tmp_path / "whole")
    trained = sorted(k for k in losses if k[0] == "train_loss")
    assert trained == [("train_loss", s) for s in (1, 2, 3, 4)]
    assert ("eval_loss", 0) in losses
    assert ("eval_loss", 2) in losses
    assert losses[("train_loss", 4)] < losses[("train_loss", 1)]  # it learns the pattern
    checkpoints = [
        json.loads(x) for x in (tmp_path / "whole" / "checkpoints.jsonl").read_text().splitlines()
    ]
    assert [c["step"] for c in checkpoints] == [2, 4]
    assert checkpoints[0]["position"] == {"cursor": 8}
    assert checkpoints[0]["state_path"].startswith("tinker://")
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert config["recipe"] == "ChatSFTConfig"

    # Interrupted after step 2 (its checkpoint), then resumed to step 4: step 3's loss needs the
    # weights back, step 4's also the data position and the optimizer's moments.
    run_chat_sft(_config(tiny_server, tmp_path / "parts", data, steps=2))
    run_chat_sft(_config(tiny_server, tmp_path / "parts", data, steps=4))
    resumed = _losses(tmp_path / "parts")
    for key in (("train_loss", 3), ("train_loss", 4), ("eval_loss", 4)):
        assert resumed[key] == pytest.approx(losses[key], rel=1e-4), key

    # A different setting cannot silently continue the same run folder.
    with pytest.raises(ValueError, match="other settings"):
        run_chat_sft(_config(tiny_server, tmp_path / "parts", data, steps=5, batch_size=2))
