"""A packed row's sequences in batches of one length: each sequence gets the bits it gets alone
(the output and the gradients of q, k and v), by the matmul kernel at half precision and by
SDPA in fp32, with lengths shared, padded together, unique, empty and past the kernel's bound."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine import (  # noqa: E402
    causal_cpu,
    native_attention,
    packing,
    sequence_batches,
)

F = torch.nn.functional
MODULE = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
LENGTHS = [
    [9, 12, 13, 11, 10, 9, 16, 5] * 4,  # an RL batch of short answers: a few batches
    [37, 80, 11, 40, 33, 37],  # too few of one length to batch
    [37, 80, 11, 40, 33, 37] * 4,  # several batches: one gather for all of them
    [20, 1100, 30, 1050, 17, 25],  # padded to one length, and two past the kernel's bound
    [0, 5, 0, 5],  # sequences of no tokens
]


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed row through the torch kernels' batches, which these tests are about, where a
    CPU with AVX512-BF16 would run the C++ kernel (test_native_attention.py holds that one to
    the same per-sequence bits)."""
    monkeypatch.setattr(native_attention, "takes", lambda *args: False)


def _alone(q: Any, k: Any, v: Any, lengths: list[int], half: bool) -> Any:
    """Each sequence by its own call, [1, total, heads, d]."""
    pieces = [
        causal_cpu.causal_attention(a, b, c, 0.125)
        if half
        else F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=0.125, enable_gqa=True)
        for a, b, c in zip(
            q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True
        )
        if a.shape[2]
    ]
    return torch.cat(pieces, dim=2).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_each_sequence_gets_its_bits_alone(dtype: Any, lengths: list[int]) -> None:
    g = torch.Generator().manual_seed(len(lengths))
    total = sum(lengths)
    q, k, v = (
        torch.randn(1, heads, total, 64, generator=g).to(dtype).requires_grad_()
        for heads in (9, 3, 3)
    )
    grad = torch.randn(1, total, 9, 64, generator=g).to(dtype)
    with packing.packed_segments(lengths):
        out, _ = packing._packed_sdpa(MODULE, q, k, v, None, dropout=0.0, scaling=0.125)
    out.backward(grad)
    got = [out.detach(), *(t.grad.clone() for t in (q, k, v))]
    for t in (q, k, v):
        t.grad = None
    ref = _alone(q, k, v, lengths, half=dtype == torch.bfloat16)
    ref.backward(grad)
    want = [ref.detach(), *(t.grad for t in (q, k, v))]
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert torch.equal(a, b)


def test_the_plan_batches_shared_lengths_and_keeps_the_rest_alone() -> None:
    how = sequence_batches.plan((9, 12, 3, 16, 40, 0, 1100, 1100), 16, 1024)
    # 9, 12, 3 and 16 pad to 16: one batch of four; 40 and the long ones alone (in order)
    assert [(length, count) for length, count, _ in how.batches] == [(16, 4)]
    assert how.alone == (4, 6, 7)
    index = how.batches[0][2].view(4, 16)
    total = 9 + 12 + 3 + 16 + 40 + 2200
    assert index[0].tolist() == list(range(9)) + [total] * 7  # padded rows read the zero row
    assert index[2].tolist() == [21, 22, 23] + [total] * 13
    # each packed token's row: the batch's rows (16 a sequence, padding skipped), then the
    # sequences alone in turn
    assert how.order is not None
    expected = [*range(9), *range(16, 28), *range(32, 35), *range(48, 64), *range(64, 2304)]
    assert how.order.tolist() == expected


def test_a_plan_without_batches_keeps_the_packed_order() -> None:
    how = sequence_batches.plan((5, 7, 9))  # exact lengths, none shared
    assert how.batches == ()
    assert how.alone == (0, 1, 2)
    assert how.order is None
    assert sequence_batches.plan((5, 7, 9)) is how  # one plan per packing, kept


def test_fewer_than_min_batch_of_a_length_run_alone() -> None:
    assert sequence_batches.MIN_BATCH == 4
    how = sequence_batches.plan((4, 4, 4, 2))
    assert how.batches == ()
    assert how.alone == (0, 1, 2, 3)


def test_indices_are_copied_to_a_device_once() -> None:
    how = sequence_batches.plan((4, 4, 2, 4, 4))
    first = how.indices(torch.device("cpu"))
    assert how.indices(torch.device("cpu")) is first
    assert first[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17]
    assert first[1] is not None
    assert first[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 8, 9, 10, 11, 12, 13, 14, 15]


def test_sdpa_batches_sequences_on_a_cpu_only() -> None:
    lengths = [6, 6, 6, 6, 9]
    on_cpu = packing.sdpa_plan(lengths, torch.device("cpu"))
    assert [(length, count) for length, count, _ in on_cpu.batches] == [(6, 4)]
    elsewhere = packing.sdpa_plan(lengths, torch.device("meta"))
    assert elsewhere.batches == ()
    assert elsewhere.alone == (0, 1, 2, 3, 4)
    assert elsewhere.order is None
