"""`tuneloop demo` end to end on the tiny built-in model: every output it promises is there."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from tuneloop.recipes.demo import DemoConfig, run_demo

pytestmark = [pytest.mark.recipe, pytest.mark.integration]

TINY = "tuneloop/tiny-qwen3"


@pytest.fixture
def embedded_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The SDK's embedded server, serving only the tiny random model, with its data in tmp."""
    monkeypatch.delenv("TUNELOOP_BASE_URL", raising=False)
    monkeypatch.delenv("TUNELOOP_API_KEY", raising=False)
    monkeypatch.setenv("TUNELOOP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TUNELOOP_SERVE_ARGS", f"--model {TINY} --device cpu")
    return tmp_path


def test_demo_runs_and_leaves_every_output(embedded_tiny: Path) -> None:
    out = embedded_tiny / "demo"
    screen = io.StringIO()
    config = DemoConfig(
        seed=3,
        steps=2,
        group_size=4,
        problems=3,
        eval_problems=5,
        model=TINY,
        out=out,
        eval_every=1,
    )

    result = run_demo(config, Console(file=screen, width=120))

    lines = [json.loads(x) for x in result.metrics_path.read_text().splitlines()]
    assert [x["event"] for x in lines] == ["eval", "step", "step", "eval"]
    steps = [x for x in lines if x["event"] == "step"]
    assert [x["step"] for x in steps] == [1, 2]
    for record in steps:
        assert 0.0 <= record["accuracy"] <= 1.0
        assert record["tokens_sampled"] > 0
        assert record["seconds"] > 0
    assert steps[0]["held_out_accuracy"] is not None  # eval_every=1 measured it

    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.state_path.startswith("tinker://")
    assert "/weights/" in result.state_path
    assert result.sampler_path.startswith("tinker://")
    assert "/sampler_weights/" in result.sampler_path
    assert 0.0 <= result.before.accuracy <= 1.0
    assert 0.0 <= result.after.accuracy <= 1.0
    assert result.usage  # the server's metering, or this loop's own counts
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state_path"] == result.state_path

    text = screen.getvalue()
    assert "step  1/2" in text
    for word in ("before", "after", "accuracy"):
        assert word in text
    assert str(result.plot_path) in text
    assert result.state_path in text
