"""The demo's usage table: rows are operations (and their total), columns the token classes and
requests; never flattened report keys."""

from __future__ import annotations

import io

from rich.console import Console

from tuneloop.recipes.demo import _client_usage, _Counts
from tuneloop.recipes.report import usage_table
from tuneloop.types import UsageCounts, UsageResponse


def rows(usage: dict[str, object], source: str = "metered by the server") -> list[list[str]]:
    screen = io.StringIO()
    Console(file=screen, width=100).print(usage_table(usage, source))
    text = screen.getvalue()
    assert "by_operation" not in text
    assert "…" not in text  # nothing cut short at 100 columns
    lines = text.splitlines()
    header = [[c.strip() for c in line.split("┃")[1:-1]] for line in lines if "┃" in line]
    assert header == [["operation", "prefill", "sampled", "trained", "requests"]]
    return [[c.strip() for c in line.split("│")[1:-1]] for line in lines if "│" in line]


def counts(prefill: int, sampled: int, trained: int, requests: int) -> UsageCounts:
    return UsageCounts(
        prefill_tokens=prefill, sampled_tokens=sampled, trained_tokens=trained, requests=requests
    )


def test_a_server_report_by_operation_and_token_class() -> None:
    report = UsageResponse(
        tenant="alice",
        session_id="sess-1",
        bucket="none",
        totals=counts(1_600, 12_345, 4_096, 27),
        by_operation={
            "forward_backward": counts(0, 0, 4_096, 10),
            "forward": counts(0, 0, 0, 0),
            "sample": counts(1_600, 12_345, 0, 17),
        },
    ).model_dump(mode="json")
    table = rows(report)
    assert table == [
        ["forward_backward", "0", "0", "4,096", "10"],
        ["sample", "1,600", "12,345", "0", "17"],  # forward did nothing: no row
        ["total", "1,600", "12,345", "4,096", "27"],
    ]


def test_the_loops_own_counts_when_the_server_has_no_usage_route() -> None:
    table = rows(
        _client_usage(_Counts(prompt_tokens_sampled=300, tokens_sampled=900, tokens_trained=1_200)),
        "counted by this loop",
    )
    assert table == [
        ["forward_backward", "0", "0", "1,200", "-"],
        ["sample", "300", "900", "0", "-"],
        ["total", "300", "900", "1,200", "-"],
    ]


def test_an_empty_report_shows_a_zero_total() -> None:
    assert rows({"by_operation": {}, "totals": counts(0, 0, 0, 0).model_dump()}) == [
        ["total", "0", "0", "0", "0"]
    ]
