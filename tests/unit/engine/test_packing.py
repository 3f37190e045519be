"""The packed row's attention: per sequence, as SDPA would run it alone; in bf16 on a CPU its
forward is SDPA's own kernel (the same bits) and its backward runs in fp32 (nearer fp64's
gradients than the half-precision backward)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine import packing  # noqa: E402

F = torch.nn.functional
LENGTHS = [37, 80, 11]
MODULE = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)


def _inputs(dtype: Any, seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    return [
        torch.randn(1, heads, total, 64, generator=g).to(dtype).requires_grad_()
        for heads in (9, 3, 3)
    ]


def _alone(q: Any, k: Any, v: Any) -> Any:
    """Each sequence's SDPA on its own, [1, total, heads, d]."""
    pieces = [
        F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=0.125, enable_gqa=True)
        for a, b, c in zip(
            q.split(LENGTHS, 2), k.split(LENGTHS, 2), v.split(LENGTHS, 2), strict=True
        )
    ]
    return torch.cat(pieces, dim=2).transpose(1, 2)


def _packed(q: Any, k: Any, v: Any) -> Any:
    with packing.packed_segments(LENGTHS):
        out, _ = packing._packed_sdpa(MODULE, q, k, v, None, dropout=0.0, scaling=0.125)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_forward_is_each_sequence_alone(dtype: Any) -> None:
    q, k, v = _inputs(dtype)
    assert torch.equal(_packed(q, k, v), _alone(q, k, v))


def test_bf16_backward_runs_in_fp32_nearer_fp64() -> None:
    q, k, v = _inputs(torch.bfloat16)
    grad = torch.randn(1, sum(LENGTHS), 9, 64, generator=torch.Generator().manual_seed(1))
    _packed(q, k, v).backward(grad.bfloat16())
    ours = [t.grad for t in (q, k, v)]
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _alone(*exact).backward(grad.double())
    half = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    _alone(*half).backward(grad.bfloat16())
    assert [g.dtype for g in ours] == [torch.bfloat16] * 3
    assert [g.shape for g in ours] == [q.shape, k.shape, v.shape]
    errors = []
    for got, bf16, ref in zip(ours, (t.grad for t in half), (t.grad for t in exact), strict=True):
        ours_error = (got.double() - ref).abs().max().item()
        half_error = (bf16.double() - ref).abs().max().item()
        assert ours_error <= half_error * 1.05 + 1e-6  # never worse than the bf16 backward
        assert ours_error < 0.02 * ref.abs().max().item()  # bf16 rounding of the inputs
        errors.append((ours_error, half_error))
    # the key and value gradients sum over many queries: fp32 sums are the nearer
    assert all(ours < half for ours, half in errors[1:])


def test_without_autograd_or_with_dropout_it_is_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = (t.detach() for t in _inputs(torch.bfloat16))
    monkeypatch.setattr(packing._HalfCausalCPU, "apply", lambda *a: pytest.fail("custom path"))
    assert torch.equal(_packed(q, k, v), _alone(q, k, v))
    assert not packing._fp32_backward(q, k, v, {})  # nothing to feed a backward
    assert packing._fp32_backward(q, k, v.requires_grad_(), {})  # the values' gradient
    assert not packing._fp32_backward(q, k, v, {"dropout": 0.1})
