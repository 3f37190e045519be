"""`native_linear.zero_spans`: each block's input pairs to multiply, found in tensor operations,
against a plain loop over each block's live pairs (no kernel needed: it runs on every CPU)."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine.native_linear import zero_spans  # noqa: E402


def _reference(live: torch.Tensor) -> list[list[int]]:
    """Per block: its first live pair, last live pair + 1, and its longest run of zero pairs
    between two live ones (the first of the longest), as [first, start, end, last]."""
    spans: list[list[int]] = []
    for row in live:
        found = torch.nonzero(row).flatten().tolist()
        if not found:
            spans.append([0, 0, 0, 0])
            continue
        first, last = found[0], found[-1] + 1
        gap, start = 0, last
        for before, after in itertools.pairwise(found):
            if after - before - 1 > gap:
                gap, start = after - before - 1, before + 1
        spans.append([first, start, start + gap, last])
    return spans


def _blocks(live: torch.Tensor) -> torch.Tensor:
    """bf16 blocks [nb, pairs, 64, 2] whose live pairs hold one nonzero weight somewhere."""
    blocks = torch.zeros((*live.shape, 64, 2), dtype=torch.bfloat16)
    blocks[..., 5, 1][live] = -0.5
    return blocks


def test_spans_match_a_plain_loop_over_random_patterns() -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(300):
        count = int(torch.randint(1, 6, (1,), generator=gen))
        pairs = int(torch.randint(1, 40, (1,), generator=gen))
        live = torch.rand(count, pairs, generator=gen) < float(torch.rand(1, generator=gen))
        scanned_from = int(torch.randint(0, pairs + 3, (1,), generator=gen))
        taken = live.clone()
        taken[:, :scanned_from] = True  # pairs before `scanned_from` are taken to be live
        got = zero_spans(_blocks(live), scanned_from)
        if bool(taken.all()):
            assert got is None
        else:
            assert got is not None
            assert got.dtype == torch.int32
            assert got.tolist() == _reference(taken)


def test_negative_zero_is_a_zero_weight() -> None:
    blocks = torch.zeros((1, 4, 64, 2), dtype=torch.bfloat16)
    blocks[0, 0] = 1.0
    blocks[0, 3] = -0.0
    spans = zero_spans(blocks)
    assert spans is not None
    assert spans.tolist() == [[0, 1, 1, 1]]
