"""`tuneloop usage`'s table: a row per tenant and operation that did work, the tenant's total,
columns by token class; per hour or day with --bucket."""

from __future__ import annotations

import pytest

from tuneloop.server.api.usage_report import build_report
from tuneloop.server.cli.records import _print_usage
from tuneloop.server.storage.usage_store import UsageSum

HOUR = 1_767_225_600  # 2026-01-01 00:00 UTC


def table_rows(text: str) -> tuple[list[str], list[list[str]]]:
    lines = text.splitlines()
    [header] = [[c.strip() for c in line.split("┃")[1:-1]] for line in lines if "┃" in line]
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if "│" in line]
    return header, rows


SUMS = [
    UsageSum("alice", HOUR, "forward_backward", 0, 0, 4_096, 8),
    UsageSum("alice", HOUR + 3600, "sample", 1_200, 25_000, 0, 16),
    UsageSum("bob", HOUR, "forward", 512, 0, 0, 2),
]


def test_by_tenant_and_operation(capsys: pytest.CaptureFixture[str]) -> None:
    _print_usage([build_report(SUMS, "alice"), build_report(SUMS, "bob")], "none")
    header, rows = table_rows(capsys.readouterr().out)
    assert header == [
        "tenant", "operation", "prefill", "sampled", "trained", "requests"
    ]  # fmt: skip
    assert rows == [
        ["alice", "forward_backward", "0", "0", "4,096", "8"],
        ["alice", "sample", "1,200", "25,000", "0", "16"],
        ["alice", "total", "1,200", "25,000", "4,096", "24"],
        ["bob", "forward", "512", "0", "0", "2"],
        ["bob", "total", "512", "0", "0", "2"],
    ]


def test_per_hour(capsys: pytest.CaptureFixture[str]) -> None:
    _print_usage([build_report(SUMS, "alice", bucket="hour")], "hour")
    header, rows = table_rows(capsys.readouterr().out)
    assert header[:3] == ["tenant", "hour (UTC)", "operation"]
    assert rows == [
        ["alice", "2026-01-01 00:00", "forward_backward", "0", "0", "4,096", "8"],
        ["alice", "2026-01-01 00:00", "total", "0", "0", "4,096", "8"],
        ["alice", "2026-01-01 01:00", "sample", "1,200", "25,000", "0", "16"],
        ["alice", "2026-01-01 01:00", "total", "1,200", "25,000", "0", "16"],
    ]
