"""What the demo shows and leaves behind: step lines, tables, the metrics file and the plot."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rich.table import Table


@dataclass(frozen=True)
class StepRecord:
    step: int
    reward: float  # mean over the step's samples
    accuracy: float  # share of the step's samples that were right
    held_out_accuracy: float | None  # greedy, on the held-out problems, if evaluated this step
    datums: int  # samples trained on (groups that all scored the same are left out)
    tokens_trained: int
    tokens_sampled: int
    loss: float
    seconds: float


class MetricsLog:
    """One JSON object per line, flushed as written so a stopped run keeps its steps."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("w")

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def step_line(r: StepRecord, steps: int) -> str:
    """One step in under 80 columns (plus the held-out accuracy when it was measured)."""
    held_out = "" if r.held_out_accuracy is None else f"  held-out {r.held_out_accuracy:.0%}"
    return (
        f"step {r.step:>2}/{steps}  reward {r.reward:.2f}  acc {r.accuracy:4.0%}  "
        f"trained {r.tokens_trained:>5} tok  sampled {r.tokens_sampled:>4} tok  "
        f"{r.seconds:4.0f} s{held_out}"
    )


def before_after_table(
    task: str, n_problems: int, before: tuple[float, float], after: tuple[float, float]
) -> Table:
    """Rows: accuracy and clean-reply share, before and after training."""
    table = Table(title=f"{task}: {n_problems} held-out problems, greedy")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    table.add_column("change", justify="right")
    for name, b, a in (
        ("accuracy", before[0], after[0]),
        ("reply is only the number", before[1], after[1]),
    ):
        table.add_row(name, f"{b:.1%}", f"{a:.1%}", f"{(a - b) * 100:+.1f} pts")
    return table


# Columns of the usage table: header, key of a usage report's counts (tuneloop.UsageCounts).
USAGE_COLUMNS = (
    ("prefill", "prefill_tokens"),
    ("sampled", "sampled_tokens"),
    ("trained", "trained_tokens"),
    ("requests", "requests"),
)


def usage_table(usage: Mapping[str, Any], source: str) -> Table:
    """Rows: operations (those with any count) and their total; columns: prefill, sampled and
    trained tokens, and requests.

    `usage` is a usage report as JSON (`by_operation`: operation -> counts; `totals`, summed
    from the rows when absent); a count that is None (not known) shows as "-".
    """
    table = Table(title=f"usage: tokens by class, and requests ({source})")
    table.add_column("operation", no_wrap=True)
    for header, _key in USAGE_COLUMNS:
        table.add_column(header, justify="right", no_wrap=True)
    by_operation: Mapping[str, Mapping[str, Any]] = usage.get("by_operation") or {}
    for operation, counts in by_operation.items():
        if any(counts.get(key) for _header, key in USAGE_COLUMNS):
            table.add_row(operation, *_cells(counts))
    totals = usage.get("totals") or {
        key: sum(c.get(key) or 0 for c in by_operation.values())
        if any(c.get(key) is not None for c in by_operation.values())
        else None
        for _header, key in USAGE_COLUMNS
    }
    table.add_section()
    table.add_row("total", *_cells(totals), style="bold")
    return table


def _cells(counts: Mapping[str, Any]) -> list[str]:
    values = [counts.get(key) for _header, key in USAGE_COLUMNS]
    return ["-" if v is None else f"{v:,}" if isinstance(v, int) else str(v) for v in values]


def plot(
    records: Sequence[StepRecord],
    before: float,
    after: float,
    path: Path,
    title: str,
) -> Path:
    """Reward and accuracy per step, held-out accuracy as points; written as a PNG."""
    # Imported here: matplotlib is slow to import and only this function needs it. Agg draws
    # without a display, so the demo works over ssh and in CI.
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r.step for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, [r.reward for r in records], label="mean reward (training samples)")
    ax.plot(steps, [r.accuracy for r in records], label="accuracy (training samples)")
    held = [(0, before)] + [
        (r.step, r.held_out_accuracy) for r in records if r.held_out_accuracy is not None
    ]
    if not records or records[-1].held_out_accuracy is None:
        held.append((records[-1].step if records else 0, after))
    # Two points joined by a line would suggest a trend nobody measured: then markers only.
    ax.plot(
        [s for s, _ in held],
        [a for _, a in held],
        "o--" if len(held) > 2 else "o",
        markersize=7,
        label="held-out accuracy (greedy; step 0 = before training)",
    )
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
