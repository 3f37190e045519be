"""The tile unit's causal attention (native_attention.py, attention_tiles.cpp) against fp64
attention and causal_cpu.py's torch kernel: any grouping of query heads, head sizes of 32 to
128, lengths of one block to the matmul kernel's bound; strided inputs as the projections
give them; thread counts; what it refuses."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine import causal_cpu, native_attention  # noqa: E402

F = torch.nn.functional

needs_tiles = pytest.mark.skipif(
    not native_attention._ready(), reason="no AMX tile unit granted on this CPU"
)


def _case(heads: int, kv_heads: int, length: int, dim: int, seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed * 1000 + heads * 100 + length + dim)
    shapes = [(heads, length), (kv_heads, length), (kv_heads, length), (heads, length)]
    return [torch.randn(1, h, n, dim, generator=g).bfloat16() for h, n in shapes]


def _run(kernel: Any, q: Any, k: Any, v: Any, grad: Any, scale: float) -> list[Any]:
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = kernel(*leaves, scale)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


def _error(got: Any, want: Any) -> float:
    """The largest error relative to the largest value (a one-token sequence's q gradient is
    zero: then the error itself)."""
    want = want.detach()
    return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-12))


def _rms(got: Any, want: Any) -> float:
    """The root-mean-square error relative to the values' root mean square."""
    want = want.detach()
    return float(((got.double() - want).square().mean() / want.square().mean()).sqrt())


@needs_tiles
@pytest.mark.parametrize(
    ("heads", "kv_heads", "length", "dim"),
    [(9, 3, 16, 64), (9, 3, 160, 64), (4, 4, 48, 32), (8, 2, 96, 128), (6, 1, 272, 64)],
)
def test_matches_fp64_attention_as_closely_as_the_torch_kernel(
    heads: int, kv_heads: int, length: int, dim: int
) -> None:
    """Output and gradients within a few bf16 roundings of fp64's, and no further from them
    than the torch matmul kernel's in root mean square (it rounds dP and the softmax's
    gradient to bf16 where the tiles keep fp32: q's and k's gradients measured 10-25 % closer
    to fp64's; the output and v's gradient the same)."""
    q, k, v, grad = _case(heads, kv_heads, length, dim)
    scale = dim**-0.5
    tiles = _run(native_attention.TileCausal.apply, q, k, v, grad, scale)
    torch_kernel = _run(causal_cpu._MatmulCausal.apply, q, k, v, grad, scale)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*exact, is_causal=True, scale=scale, enable_gqa=True)
    ref.backward(grad.double())
    for got, other, want in zip(tiles, torch_kernel, [ref, *(t.grad for t in exact)], strict=True):
        assert got.dtype == torch.bfloat16
        assert got.shape == want.shape
        assert _error(got, want) < 0.01
        assert _rms(got, want) <= 1.02 * _rms(other, want)


@needs_tiles
def test_strided_inputs_give_the_bits_of_contiguous_ones() -> None:
    """q, k, v as the attention's projections give them ([1, tokens, heads, d] transposed):
    read where they lie, the same bits as their contiguous copies."""
    q, k, v, grad = _case(9, 3, 64, 64)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, grad)]
    assert not strided[0].is_contiguous()
    want = _run(native_attention.TileCausal.apply, q, k, v, grad, 0.125)
    got = _run(native_attention.TileCausal.apply, *strided, 0.125)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@needs_tiles
def test_the_bits_do_not_depend_on_the_thread_count() -> None:
    """Each output's sums run in one order however the units are shared among threads."""
    q, k, v, grad = _case(9, 3, 112, 64)
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(_run(native_attention.TileCausal.apply, q, k, v, grad, 0.125))
    finally:
        torch.set_num_threads(previous)
    for other in results[1:]:
        for a, b in zip(other, results[0], strict=True):
            assert torch.equal(a, b)


@needs_tiles
@pytest.mark.parametrize("length", [1, 50, 64])
def test_causal_attention_takes_it_for_padded_bf16_sequences(length: int, monkeypatch: Any) -> None:
    """causal_attention pads a bf16 sequence to whole blocks and runs it on the tiles: the
    caller's length back, the padded keys masked and the padded queries dropped."""
    seen: list[int] = []
    real = native_attention.TileCausal.apply
    monkeypatch.setattr(
        native_attention.TileCausal, "apply", lambda *a: seen.append(a[0].shape[2]) or real(*a)
    )
    q, k, v, grad = _case(4, 2, length, 32)
    got = _run(causal_cpu.causal_attention, q, k, v, grad, 0.2)
    assert seen == [-(-length // 16) * 16]
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*exact, is_causal=True, scale=0.2, enable_gqa=True)
    ref.backward(grad.double())
    for a, want in zip(got, [ref, *(t.grad for t in exact)], strict=True):
        assert a.shape == want.shape
        assert _error(a, want) < 0.01


def test_what_it_does_not_take() -> None:
    """fp16 or fp32, lengths of partial blocks, head sizes of partial tile rows, a batch of
    several sequences, key heads that do not divide the query heads, a non-positive scale."""
    q, k, v, _ = _case(4, 2, 32, 32)
    assert not native_attention.takes(q.half(), k.half(), v.half(), 0.2, 32)
    assert not native_attention.takes(q.float(), k.float(), v.float(), 0.2, 32)
    assert not native_attention.takes(q, k, v, 0.2, 40)
    assert not native_attention.takes(q[..., :16], k[..., :16], v[..., :16], 0.2, 32)
    assert not native_attention.takes(q.expand(2, -1, -1, -1), k, v, 0.2, 32)
    q3 = torch.cat([q, q[:, :1]], dim=1)  # 5 query heads over 2 key heads
    assert not native_attention.takes(q3, k, v, 0.2, 32)
    assert not native_attention.takes(q, k, v, 0.0, 32)
    assert native_attention.takes(q, k, v, 0.2, 32) == native_attention._ready()
