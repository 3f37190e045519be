"""The compiled decode attention (kv/decode_attention.py): each row's one query per head against
its own slots of the pool, as exact as the gather + SDPA it replaces, eager on failure. Run
without autograd, as decode steps are (a graph per grad mode otherwise)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine.kv import decode_attention  # noqa: E402

HEADS, KV_HEADS, DIM, DIM_V = 6, 2, 16, 8  # three query heads a key head; MLA-like narrow values
SCALE = 0.3  # a constant of the compiled graph, as a model's own scale is


def _layout(dtype: torch.dtype, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A pool of scattered slots (stale NaNs everywhere nobody attends to, a zero pad slot
    last), rows of `lengths` slots each padded to the longest, and each row's query."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths) + 7
    k_pool = torch.randn(total + 1, KV_HEADS, DIM, generator=gen).to(dtype)
    v_pool = torch.randn(total + 1, KV_HEADS, DIM_V, generator=gen).to(dtype)
    order = torch.randperm(total, generator=gen)
    width = max(lengths)
    slots = torch.full((len(lengths), width), total, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.bool)
    used, start = torch.zeros(total + 1, dtype=torch.bool), 0
    for row, length in enumerate(lengths):
        slots[row, :length] = order[start : start + length]
        mask[row, :length] = True
        start += length
    used[slots[mask]] = True
    k_pool[:total][~used[:total]] = float("nan")
    v_pool[:total][~used[:total]] = float("nan")
    k_pool[total], v_pool[total] = 0, 0
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen).mul(2).to(dtype)
    return q, k_pool, v_pool, slots, mask


def _exact(q, k_pool, v_pool, slots, mask, scale: float) -> torch.Tensor:
    """fp64, row by row, each query head on its key head's slots."""
    rows = []
    for row in range(q.shape[0]):
        picked = slots[row][mask[row]]
        k = k_pool[picked].double().repeat_interleave(HEADS // KV_HEADS, 1)  # [ctx, heads, d]
        v = v_pool[picked].double().repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("hd,chd->hc", q[row].double(), k) * scale
        rows.append(torch.einsum("hc,chd->hd", scores.softmax(-1), v))
    return torch.stack(rows)


def _gather_sdpa(q, k_pool, v_pool, slots, mask, scale: float) -> torch.Tensor:
    """The reference's decode path: slots gathered, SDPA with the query heads folded."""
    rows = slots.shape[0]
    k = k_pool[slots].permute(0, 2, 1, 3)  # [rows, kv_heads, ctx, d]
    v = v_pool[slots].permute(0, 2, 1, 3)
    folded = q.reshape(rows, KV_HEADS, HEADS // KV_HEADS, DIM)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, k, v, attn_mask=mask[:, None, None, :], scale=scale
    )
    return out.reshape(rows, HEADS, DIM_V)


LENGTHS = [[2], [5, 1, 17, 9], [40, 3, 33]]  # a decode row has two slots or more


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    """Compiled as the engine does, before use (the first compile's own warnings silenced)."""
    for dtype in (torch.float32, torch.bfloat16):
        assert decode_attention.warm_up(
            HEADS, KV_HEADS, DIM, DIM_V, SCALE, dtype, torch.device("cpu")
        )


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


@pytest.mark.parametrize("lengths", LENGTHS)
def test_fp32_rows_equal_exact_attention(lengths: list[int]) -> None:
    inputs = _layout(torch.float32, lengths)
    expected = _exact(*inputs, SCALE)
    for fn in (decode_attention.attend, decode_attention.compiled()):
        out = fn(*inputs, SCALE)
        assert out.dtype == torch.float32
        assert out.shape == (len(lengths), HEADS, DIM_V)
        assert (out.double() - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("lengths", LENGTHS)
def test_bf16_rows_are_as_exact_as_gather_and_sdpa(lengths: list[int]) -> None:
    """fp32 scores and sums: no farther from fp64 than SDPA's bf16 path, beyond the rounding of
    the result to bf16 itself."""
    inputs = _layout(torch.bfloat16, lengths, seed=1)
    expected = _exact(*inputs, SCALE)
    clean = inputs[1].nan_to_num(0), inputs[2].nan_to_num(0)  # SDPA's 0 x NaN would leak
    sdpa = (_gather_sdpa(inputs[0], *clean, *inputs[3:], SCALE).double() - expected).abs().max()
    rounding = expected.abs().max() * 2.0**-8
    out = decode_attention.compiled()(*inputs, SCALE)
    assert out.dtype == torch.bfloat16
    error = (out.double() - expected).abs().max()
    assert error <= max(1.25 * sdpa, rounding), (error, sdpa, rounding)


def test_a_row_never_depends_on_the_rows_beside_it() -> None:
    """A row alone and the same row among longer ones (more padding): the same bits."""
    q, k_pool, v_pool, slots, mask = _layout(torch.bfloat16, [6, 30, 2], seed=2)
    kernel = decode_attention.compiled()
    together = kernel(q, k_pool, v_pool, slots, mask, SCALE)
    for row in range(3):
        width = int(mask[row].sum())
        alone = kernel(
            q[row : row + 1],
            k_pool,
            v_pool,
            slots[row, :width].reshape(1, width),
            mask[row, :width].reshape(1, width),
            SCALE,
        )
        assert torch.equal(alone[0], together[row])


def test_a_compile_failure_is_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cpu = torch.device("cpu")

    def broken() -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(decode_attention, "compiled", broken)
    with caplog.at_level(logging.WARNING):
        assert not decode_attention.warm_up(HEADS, KV_HEADS, DIM, DIM_V, SCALE, torch.float32, cpu)
    assert "no C++ compiler" in caplog.text
