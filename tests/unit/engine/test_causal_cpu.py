"""causal_cpu.py's kernels on their own: any grouping of query heads over key heads, fp16 as
well as bf16, the length that picks the kernel."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine import causal_cpu  # noqa: E402

F = torch.nn.functional


def _case(heads: int, kv_heads: int, length: int, dtype: Any) -> tuple[list[Any], Any]:
    g = torch.Generator().manual_seed(heads * 100 + length)
    qkv = [
        torch.randn(1, h, length, 32, generator=g).to(dtype).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    ]
    return qkv, torch.randn(1, heads, length, 32, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("length", [1, 50, 128, 129])  # 4 x 32 = 128: the last is flash
def test_matches_fp64_attention(dtype: Any, heads: int, kv_heads: int, length: int) -> None:
    (q, k, v), grad = _case(heads, kv_heads, length, dtype)
    out = causal_cpu.causal_attention(q, k, v, 0.2)
    out.backward(grad)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*exact, is_causal=True, scale=0.2, enable_gqa=True)
    ref.backward(grad.double())
    # half-precision rounding of inputs and outputs: a few units of 2^-8 (bf16) of the largest
    tolerance = 0.02 if dtype == torch.bfloat16 else 0.004
    assert out.dtype == dtype
    assert out.shape == q.shape
    pairs = [(out, ref)] + [(t.grad, e.grad) for t, e in zip((q, k, v), exact, strict=True)]
    for got, want in pairs:
        assert got.dtype == dtype
        assert got.shape == want.shape
        error = (got.double() - want).abs().max().item()
        assert error <= tolerance * max(1.0, want.abs().max().item()), (error, want.abs().max())


def test_inputs_are_left_as_they_were() -> None:
    (q, k, v), _ = _case(4, 2, 20, torch.float32)
    before = [t.detach().clone() for t in (q, k, v)]
    causal_cpu.causal_attention(q.detach(), k.detach(), v.detach(), 0.5)  # shares q's storage
    assert all(torch.equal(t, b) for t, b in zip((q, k, v), before, strict=True))


def test_kernel_choice_by_length() -> None:
    assert causal_cpu.uses_matmul(16)
    assert causal_cpu.uses_matmul(584)  # an RL sequence: a 200-token prompt and 384 sampled
    assert causal_cpu.uses_matmul(1024)
    assert not causal_cpu.uses_matmul(1025)


def test_causal_bias_is_a_view_of_the_longest() -> None:
    small = causal_cpu._causal_bias(3)
    big = causal_cpu._causal_bias(200)
    assert small.tolist() == [[0, float("-inf"), float("-inf")], [0, 0, float("-inf")], [0] * 3]
    assert causal_cpu._causal_bias(5).data_ptr() == big.data_ptr()


@pytest.mark.parametrize(("dtype", "during"), [(torch.bfloat16, "bf16"), (torch.float16, None)])
def test_scores_use_bf16_units_only_for_bf16_and_only_inside(
    dtype: Any, during: str | None, monkeypatch: Any
) -> None:
    """bf16 values are exact in bf16, so their fp32 scores may run on bf16 units; fp16 values
    are not. The process-wide switch is back to what it was once the kernel returns."""
    switch = torch.backends.mkldnn.matmul
    before = switch.fp32_precision
    seen: list[tuple[Any, str]] = []
    bmm = torch.bmm

    def spy(a: Any, b: Any) -> Any:
        seen.append((a.dtype, switch.fp32_precision))
        return bmm(a, b)

    monkeypatch.setattr(torch, "bmm", spy)
    (q, k, v), grad = _case(4, 2, 40, dtype)
    causal_cpu.causal_attention(q, k, v, 0.3).backward(grad)
    assert switch.fp32_precision == before
    fp32 = [precision for operand, precision in seen if operand == torch.float32]
    assert fp32 == [during or before]  # the scores: the one fp32 product
    assert all(p == before for operand, p in seen if operand != torch.float32)


@pytest.mark.parametrize("length", [1, 50, 64])
def test_matmul_kernel_runs_lengths_padded_to_the_granule(length: int, monkeypatch: Any) -> None:
    """The kernel sees a multiple of LENGTH_GRANULE tokens; the caller gets its own length, with
    the unpadded kernel's outputs and gradients (the padded keys are masked, the padded
    queries' rows dropped)."""
    (q, k, v), grad = _case(4, 2, length, torch.bfloat16)
    granule = causal_cpu.LENGTH_GRANULE
    seen: list[int] = []
    real = causal_cpu._MatmulCausal.apply
    monkeypatch.setattr(
        causal_cpu._MatmulCausal, "apply", lambda *a: seen.append(a[0].shape[2]) or real(*a)
    )
    out = causal_cpu.causal_attention(q, k, v, 0.2)
    out.backward(grad)
    padded = [out.detach(), *(t.grad for t in (q, k, v))]
    monkeypatch.setattr(causal_cpu, "LENGTH_GRANULE", 1)
    for t in (q, k, v):
        t.grad = None
    out = causal_cpu.causal_attention(q, k, v, 0.2)
    out.backward(grad)
    plain = [out.detach(), *(t.grad for t in (q, k, v))]
    assert seen == [-(-length // granule) * granule, length]
    for got, want in zip(padded, plain, strict=True):
        assert got.shape == want.shape
        # the same products; only the order of some fp32 sums may differ: one bf16 rounding
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)
