"""The C++ causal attention of packed sequences (native_attention.py, attention_tiles.cpp),
in both its forms (products on the AMX tile unit where the CPU has one, on AVX-512-BF16's dot
products everywhere it builds), against fp64 attention and causal_cpu.py's torch kernel: any
grouping of query heads, head sizes of 32 to 128, lengths of one token to the matmul kernel's
bound and of partial blocks; each sequence's values as it gets alone; strided inputs as the
projections give them; thread counts; the two forms against each other; what it refuses."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine import causal_cpu, native_attention, packing  # noqa: E402

F = torch.nn.functional

needs_tiles = pytest.mark.skipif(
    not native_attention._ready(), reason="the kernels need AVX512-BF16 (and a C++ compiler)"
)


@pytest.fixture(params=["tiles", "vector"], autouse=True)
def form(request: Any) -> Any:
    """Each test once per form of the products: on the tile unit (skipped on a CPU without
    AMX) and on the vector unit; the default (tiles where granted) restored after."""
    if request.param == "tiles" and not native_attention.tiles(True):
        pytest.skip("no AMX tile unit granted on this CPU")
    if request.param == "vector":
        native_attention.tiles(False)
    yield request.param
    native_attention.tiles(True)


def _case(heads: int, kv_heads: int, lengths: list[int], dim: int, seed: int = 0) -> list[Any]:
    """q, k, v [1, heads, T, d] as the projections give them (views of [1, T, heads, d]) and
    the output's gradient [1, T, heads, d]."""
    g = torch.Generator().manual_seed(seed * 1000 + heads * 100 + sum(lengths) + dim)
    total = sum(lengths)
    shapes = [heads, kv_heads, kv_heads, heads]
    made = [torch.randn(1, total, h, dim, generator=g).bfloat16() for h in shapes]
    return [t.transpose(1, 2) for t in made[:3]] + [made[3]]


def _packed(q: Any, k: Any, v: Any, grad: Any, lengths: list[int], scale: float) -> list[Any]:
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = native_attention.PackedTileCausal.apply(*leaves, tuple(lengths), scale)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


def _each(kernel: Any, q: Any, k: Any, v: Any, grad: Any, lengths: list[int], scale: float):  # type: ignore[no-untyped-def]
    """Each sequence on its own through `kernel(q, k, v, scale)` ([1, heads, len, d] in and
    out), the results in the packed layouts."""
    outs: list[list[Any]] = [[], [], [], []]
    start = 0
    for n in lengths:
        piece = [t[:, :, start : start + n].detach().clone().requires_grad_() for t in (q, k, v)]
        out = kernel(*piece, scale)
        out.backward(grad[:, start : start + n].transpose(1, 2))
        for i, t in enumerate([out.detach().transpose(1, 2), *(p.grad for p in piece)]):
            outs[i].append(t)
        start += n
    return [torch.cat(outs[0], 1), *(torch.cat(o, 2) for o in outs[1:])]


def _fp64(q: Any, k: Any, v: Any, grad: Any, lengths: list[int], scale: float):  # type: ignore[no-untyped-def]
    def exact(q: Any, k: Any, v: Any, scale: float) -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    wide = [t.double() for t in (q, k, v)]
    return _each(exact, *wide, grad.double(), lengths, scale)


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
    ("heads", "kv_heads", "lengths", "dim"),
    [
        (9, 3, [16], 64),
        (9, 3, [160, 64, 96], 64),
        (4, 4, [48, 1, 33], 32),
        (8, 2, [96, 17], 128),
        (6, 1, [272, 250], 64),
    ],
)
def test_matches_fp64_attention_as_closely_as_the_torch_kernel(
    heads: int, kv_heads: int, lengths: list[int], dim: int
) -> None:
    """Output and gradients within a few bf16 roundings of fp64's, and no further from them
    than causal_cpu.py's torch kernel's in root mean square (it rounds dP and the softmax's
    gradient to bf16 where the tiles keep fp32: q's and k's gradients measured 10-25 % closer
    to fp64's; the output and v's gradient the same)."""
    q, k, v, grad = _case(heads, kv_heads, lengths, dim)
    scale = dim**-0.5
    tiles = _packed(q, k, v, grad, lengths, scale)
    torch_kernel = _each(causal_cpu.causal_attention, q, k, v, grad, lengths, scale)
    exact = _fp64(q, k, v, grad, lengths, scale)
    for got, other, want in zip(tiles, torch_kernel, exact, strict=True):
        assert got.dtype == torch.bfloat16
        assert got.shape == want.shape
        assert _error(got, want) < 0.01
        assert _rms(got, want) <= 1.02 * _rms(other, want)


@needs_tiles
def test_each_sequence_gets_the_bits_it_gets_alone() -> None:
    """Packed with others (lengths of partial blocks among them), a sequence's output and
    gradients are those of a call with it alone: nothing of its neighbours enters its sums."""
    lengths = [37, 160, 5, 64]
    q, k, v, grad = _case(9, 3, lengths, 64)
    together = _packed(q, k, v, grad, lengths, 0.125)

    def alone(q: Any, k: Any, v: Any, scale: float) -> Any:
        out = native_attention.PackedTileCausal.apply(q, k, v, (q.shape[2],), scale)
        return out.transpose(1, 2)

    apart = _each(alone, q, k, v, grad, lengths, 0.125)
    for a, b in zip(together, apart, strict=True):
        assert torch.equal(a, b)


@needs_tiles
def test_strided_inputs_give_the_bits_of_contiguous_ones() -> None:
    """q, k, v as the projections give them are read where they lie: the same bits as their
    contiguous copies."""
    q, k, v, grad = _case(9, 3, [64, 30], 64)
    assert not q.is_contiguous()
    want = _packed(q, k, v, grad, [64, 30], 0.125)
    got = _packed(q.contiguous(), k.contiguous(), v.contiguous(), grad, [64, 30], 0.125)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@needs_tiles
def test_the_bits_do_not_depend_on_the_thread_count() -> None:
    """Each output's sums run in one order however the units are shared among threads."""
    q, k, v, grad = _case(9, 3, [112, 40], 64)
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(_packed(q, k, v, grad, [112, 40], 0.125))
    finally:
        torch.set_num_threads(previous)
    for other in results[1:]:
        for a, b in zip(other, results[0], strict=True):
            assert torch.equal(a, b)


@needs_tiles
def test_the_packed_attention_takes_it_for_bf16_rows(monkeypatch: Any) -> None:
    """Inside packed_segments a bf16 row runs on the tile unit, one call, with the output the
    attention's caller reads ([1, T, heads, d]) and the per-sequence torch kernel's values to
    within a few bf16 roundings."""
    from types import SimpleNamespace

    calls: list[tuple[int, ...]] = []
    real = native_attention.PackedTileCausal.apply
    monkeypatch.setattr(
        native_attention.PackedTileCausal, "apply", lambda *a: calls.append(a[3]) or real(*a)
    )
    lengths = [50, 1, 64]
    q, k, v, grad = _case(4, 2, lengths, 32)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with packing.packed_segments(lengths):
        out, _ = packing._packed_sdpa(module, *leaves, None, dropout=0.0, scaling=0.2)
    out.backward(grad)
    assert calls == [tuple(lengths)]
    assert out.shape == (1, sum(lengths), 4, 32)
    want = _each(causal_cpu.causal_attention, q, k, v, grad, lengths, 0.2)
    for a, b in zip([out.detach(), *(t.grad for t in leaves)], want, strict=True):
        assert a.shape == b.shape
        assert _error(a, b.double()) < 0.01


@needs_tiles
def test_the_two_forms_agree_to_a_bf16_rounding(form: str) -> None:
    """The tile unit and the vector unit sum each product's pairs in their own order: values
    a bf16 rounding apart at most, where a CPU has both."""
    if form != "tiles":
        pytest.skip("compares the forms once, where the tile unit runs")
    lengths = [160, 37, 64]
    q, k, v, grad = _case(9, 3, lengths, 64)
    tiles = _packed(q, k, v, grad, lengths, 0.125)
    native_attention.tiles(False)
    vector = _packed(q, k, v, grad, lengths, 0.125)
    for a, b in zip(tiles, vector, strict=True):
        assert _error(a, b.double()) < 2**-7


def test_what_it_does_not_take() -> None:
    """fp16 or fp32, head sizes of partial tile rows, a batch of several rows, key heads that
    do not divide the query heads, a non-positive scale, lengths that do not cover the row
    or exceed the matmul kernel's bound."""
    q, k, v, _ = _case(4, 2, [32], 32)
    ok = native_attention._ready()
    assert native_attention.takes(q, k, v, 0.2, [20, 12]) == ok
    assert not native_attention.takes(q.half(), k.half(), v.half(), 0.2, [32])
    assert not native_attention.takes(q.float(), k.float(), v.float(), 0.2, [32])
    assert not native_attention.takes(q[..., :16], k[..., :16], v[..., :16], 0.2, [32])
    assert not native_attention.takes(q.expand(2, -1, -1, -1), k, v, 0.2, [32])
    q5 = torch.cat([q, q[:, :1]], dim=1)  # 5 query heads over 2 key heads
    assert not native_attention.takes(q5, k, v, 0.2, [32])
    assert not native_attention.takes(q, k, v, 0.0, [32])
    assert not native_attention.takes(q, k, v, 0.2, [30])
    assert not native_attention.takes(q, k, v, 0.2, [32, 0])
    long = _case(1, 1, [causal_cpu.MATMUL_MAX_TOKENS + 1], 32)
    assert not native_attention.takes(*long[:3], 0.2, [causal_cpu.MATMUL_MAX_TOKENS + 1])
