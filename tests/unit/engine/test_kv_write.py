"""A step's new keys and values written into the pool by the C++ loop (kv/kv_write.py): the
bits of `index_copy_`, rows read through their stride, nothing written where a slot lies
outside the pool, and `index_copy_` left to run wherever the loop does not apply."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine.kv import kv_write  # noqa: E402

pytestmark = pytest.mark.skipif(kv_write.native_kernel() is None, reason="no C++ compiler here")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5, 128])
def test_rows_land_where_index_copy_puts_them(dtype: torch.dtype, tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    pool = torch.randn((300, 3, 64), generator=gen).to(dtype)
    # the values' half of a q/k/v matmul's output: rows 960 elements apart
    out = torch.randn((tokens, 960), generator=gen).to(dtype)
    rows = out[:, 768:].view(tokens, 3, 64)
    slots = torch.randperm(300, generator=gen)[:tokens]
    want = pool.clone().index_copy_(0, slots, rows)
    assert kv_write.write(pool, slots, rows)
    assert torch.equal(pool, want)


def test_a_slot_outside_the_pool_writes_nothing() -> None:
    pool = torch.zeros((10, 2, 4), dtype=torch.bfloat16)
    rows = torch.ones((3, 2, 4), dtype=torch.bfloat16)
    for bad in (10, -1):
        assert not kv_write.write(pool, torch.tensor([1, bad, 2]), rows)
        assert not pool.any()
    with pytest.raises((IndexError, RuntimeError)):  # what the caller runs then
        pool.index_copy_(0, torch.tensor([1, 10, 2]), rows)


def test_what_the_loop_does_not_take_is_left_to_index_copy() -> None:
    pool = torch.zeros((10, 2, 4))
    rows = torch.ones((3, 2, 4))
    slots = torch.tensor([1, 2, 3])
    assert not kv_write.write(pool, slots, rows.bfloat16())  # another dtype
    assert not kv_write.write(pool, slots, rows.transpose(1, 2).contiguous().transpose(1, 2))
    assert not kv_write.write(pool, slots.int(), rows)
    assert not kv_write.write(pool, slots[:0], rows[:0])
    assert not kv_write.write(pool[:, :1], slots, rows[:, :1])  # a pool that is not contiguous
    assert not pool.any()
