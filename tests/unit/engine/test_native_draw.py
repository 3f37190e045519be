"""The CPU's native draw (native_draw.py, draw.cpp) against the torch form it stands in for."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.unit.engine.test_draw import step_params, work  # noqa: E402
from tuneloop.server.engine import draw as d  # noqa: E402
from tuneloop.server.engine import native_draw  # noqa: E402

pytestmark = pytest.mark.skipif(not native_draw.available(), reason="no C++ compiler here")

BLOCK = 256


def _logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> Any:
    """bf16-valued logits held in fp32 (the head's output, copied)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * scale).bfloat16().float()


def _plain(rows: int) -> tuple[Any, Any]:
    return torch.ones(rows), torch.zeros(rows, dtype=torch.bool)


@pytest.mark.parametrize("vocab", [49_152, 50_257, 1000, 17])
def test_the_logsumexp_is_fp64s_and_the_maxima_torchs(vocab: int) -> None:
    """Ragged last blocks and vocabularies that are not whole vectors included; logits from
    flat to peaked. The logsumexp is within 2e-7 of one summed in fp64 (torch's fp32 softmax
    is within ~4e-6 at 49,152 tokens)."""
    for scale in (0.1, 3.0, 30.0):
        logits = _logits(8, vocab, seed=int(scale * 10), scale=scale)
        u = torch.rand(8, generator=torch.Generator().manual_seed(1)).clamp(min=2**-24)
        tokens, logsumexp, finite, maxima = native_draw.draw(logits, u, *_plain(8), BLOCK)
        exact = torch.logsumexp(logits.double(), -1)
        assert float((logsumexp - exact).abs().max()) < 2e-7, scale
        assert bool(finite.all())
        assert torch.equal(maxima, d._per_block(logits, min(BLOCK, vocab), torch.amax))
        assert bool(((tokens >= 0) & (tokens < vocab)).all())


def test_bf16_logits_draw_what_their_fp32_copy_draws() -> None:
    logits = _logits(16, 3000, seed=2)
    u = torch.linspace(2**-24, 1.0, 16)
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0] * 4)
    greedy = torch.tensor([False, False, False, True] * 4)
    ours = native_draw.draw(logits, u, temperature, greedy, BLOCK)
    half = native_draw.draw(logits.bfloat16(), u, temperature, greedy, BLOCK)
    for a, b in zip(ours, half, strict=True):
        assert torch.equal(a, b)


def test_the_draw_is_the_torch_forms_but_at_rounding_boundaries() -> None:
    """Against draw.py's torch form on 128 rows x 49,152 tokens at three temperatures: the
    probabilities differ in their last bits only, so a token differs only where the row's
    uniform lies within that rounding of a boundary between two tokens. Each row where they
    part is checked to be one (against the CDF summed in fp64), and few are."""
    vocab, rows = 49_152, 128
    logits = _logits(rows, vocab, seed=3)
    works = [work(seed=s, temperature=(0.7, 1.0, 1.3)[s % 3]) for s in range(rows)]
    params = step_params(works, vocab)
    positions = torch.arange(rows) + 40
    theirs, their_lse = d.draw(logits, params, positions)
    u = d.uniforms(params.seed_lo, params.seed_hi, positions)
    tokens, logsumexp, _, _ = native_draw.draw(logits, u, params.temperature, params.greedy, BLOCK)
    parted = (tokens != theirs).nonzero()[:, 0].tolist()
    for r in parted:
        cdf = torch.softmax(logits[r].double() / float(params.temperature[r]), -1).cumsum(0)
        lo, hi = sorted((int(tokens[r]), int(theirs[r])))
        assert abs(float(u[r]) - float(cdf[lo])) < 1e-6, (r, lo, hi)  # the boundary after lo
        assert abs(float(u[r]) - float(cdf[hi - 1])) < 1e-6, (r, lo, hi)  # ... is before hi
    assert len(parted) <= 3, parted
    # two fp32 sums of 49,152 exponentials in other orders (the kernel's per lane, 8 or 16
    # lanes by the CPU's vectors): 1.006e-5 apart at a logsumexp of ~15 on an AVX2 EPYC
    assert float((logsumexp - their_lse).abs().max()) < 2e-5


def test_greedy_rows_take_the_first_of_tied_maxima() -> None:
    logits = torch.zeros(3, 1000)
    logits[0, [700, 300]] = 5.0  # tied: the first index, as torch.argmax
    logits[1, [999, 256]] = 5.0  # in different blocks
    logits[2, :] = 1.0  # all tied
    tokens, _, _, _ = native_draw.draw(
        logits, torch.ones(3), torch.ones(3), torch.ones(3, dtype=torch.bool), BLOCK
    )
    assert tokens.tolist() == [300, 256, 0] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_with_a_logit_not_finite_is_reported_and_the_others_draw_as_alone(
    bad: float,
) -> None:
    logits = _logits(4, 1000, seed=4)
    u = torch.tensor([0.3, 0.6, 0.9, 0.1])
    alone = native_draw.draw(logits, u, *_plain(4), BLOCK)
    poisoned = logits.clone()
    poisoned[2, 517] = bad
    tokens, logsumexp, finite, maxima = native_draw.draw(poisoned, u, *_plain(4), BLOCK)
    assert finite.tolist() == [True, True, False, True]
    assert torch.isnan(logsumexp[2])
    assert bool(torch.isnan(maxima[2]).all())
    keep = [0, 1, 3]
    assert torch.equal(tokens[keep], alone[0][keep])
    assert torch.equal(logsumexp[keep], alone[1][keep])


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    logits = _logits(32, 5000, seed=5)
    u = torch.rand(32, generator=torch.Generator().manual_seed(6)).clamp(min=2**-24)
    temperature = torch.rand(32, generator=torch.Generator().manual_seed(7)) + 0.5
    greedy = torch.arange(32) % 5 == 0
    together = native_draw.draw(logits, u, temperature, greedy, BLOCK)
    order = torch.randperm(32, generator=torch.Generator().manual_seed(8))
    shuffled = native_draw.draw(logits[order], u[order], temperature[order], greedy[order], BLOCK)
    for a, b in zip(together, shuffled, strict=True):
        assert torch.equal(a[order], b)
    for i in (0, 7, 31):
        one = native_draw.draw(
            logits[i : i + 1], u[i : i + 1], temperature[i : i + 1], greedy[i : i + 1], BLOCK
        )
        assert int(one[0][0]) == int(together[0][i])
        assert float(one[1][0]) == float(together[1][i])


def test_rows_of_a_strided_view_draw_as_their_copies() -> None:
    wide = _logits(6, 2000, seed=9)
    view = wide[:, :1500]  # row stride 2000
    assert native_draw.takes(view)
    u = torch.full((6,), 0.5)
    for a, b in zip(
        native_draw.draw(view, u, *_plain(6), BLOCK),
        native_draw.draw(view.contiguous(), u, *_plain(6), BLOCK),
        strict=True,
    ):
        assert torch.equal(a, b)


def _filtered_reference(
    row: Any, temperature: float, k: int, p: float, u: float
) -> tuple[int, float]:
    """draw.py's `_filtered_draw` of one row in fp64, ties in ascending token order (a stable
    sort's): the token, and how near the draw came to a boundary (of the CDF at u, of the
    top-p cut at p), relative, where fp32's exp and sums could tip it."""
    e = torch.exp((row.double() - row.double().max()) / temperature)
    v, order = torch.sort(e, descending=True, stable=True)
    kept = int((v >= v[k - 1]).sum())
    v = v[:kept]
    total = float(v.sum())
    above = (v.cumsum(0) - v) / total
    n = kept
    near = 1.0
    if p < 1.0:
        dropped = (above >= p).nonzero()
        n = int(dropped[0]) if len(dropped) else kept
        near = float((above - p).abs().min())
    cdf = v[:n].cumsum(0)
    target = u * float(cdf[-1])
    j = int(((cdf >= target) & (v[:n] > 0)).nonzero()[0]) if n else 0
    near = min(near, float(((cdf - target) / cdf[-1]).abs().min()) if n else 1.0)
    return int(order[j]), near


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("temperature", "k", "p"),
    [
        (1.0, 50, 1.0),
        (0.7, 0, 0.9),
        (1.3, 0, 0.5),
        (1.0, 20, 0.8),
        (1.0, 1, 1.0),
        (0.9, 3000, 0.999),
        (0.8, 40, 0.9),
    ],
)
def test_filtered_rows_draw_the_filters_tokens_but_at_rounding_boundaries(
    dtype: str, temperature: float, k: int, p: float
) -> None:
    """Against the filters in fp64 (`_filtered_reference`) on rows from flat to peaked, bf16
    logits with many ties among them: the same token but where the draw lies within fp32's
    rounding of a boundary, which each row that parts is checked to do."""
    vocab, rows = 3000, 48
    logits = _logits(rows, vocab, seed=k + int(p * 100))
    logits[: rows // 3] *= 3  # peaked rows: a nucleus of a few tokens
    logits = logits.to(getattr(torch, dtype))
    k = k or vocab
    u = torch.rand(rows, generator=torch.Generator().manual_seed(1)).clamp(min=2.0**-24)
    u[:2] = 1.0
    tokens = native_draw.draw_filtered(
        logits,
        torch.arange(rows),
        u,
        torch.full((rows,), temperature),
        torch.full((rows,), k),
        torch.full((rows,), p),
    )
    parted = []
    for r in range(rows):
        want, near = _filtered_reference(logits[r].float(), temperature, k, p, float(u[r]))
        if int(tokens[r]) != want:
            assert near < 1e-6, (r, int(tokens[r]), want, near)
            parted.append(r)
    assert len(parted) <= 2, parted


def test_filtered_ties_take_ascending_tokens_and_a_row_draws_as_alone() -> None:
    """Equal logits: top-k keeps every token tied with the k-th (the torch form's), and the
    uniform walks them in token order; a row's token does not depend on the rows drawn with
    it."""
    vocab = 1000
    flat = torch.zeros(4, vocab)
    flat[1, 500:] = 1.0  # 500 tied best tokens from 500 on
    flat[2, ::7] = 2.0
    flat[3] = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    n = 4
    one = torch.ones(n)
    u = torch.tensor([0.1, 0.5, 0.99, 0.3])
    tokens = native_draw.draw_filtered(
        flat,
        torch.arange(n),
        u,
        one,
        torch.tensor([3, 2, 4, 10]),
        torch.tensor([1.0, 1.0, 1.0, 0.7]),
    )
    # every token tied with the k-th is kept, walked in token order: u of 1000 equal tokens,
    # of the 500 from 500 on, of the 143 at every 7th
    assert tokens[:3].tolist() == [100, 749, 987]
    for r in range(n):
        alone = native_draw.draw_filtered(
            flat,
            torch.tensor([r]),
            u[r : r + 1],
            one[:1],
            torch.tensor([[3, 2, 4, 10][r]]),
            torch.tensor([[1.0, 1.0, 1.0, 0.7][r]]),
        )
        assert int(alone) == int(tokens[r])
    # every tied token is kept with the k-th: top-k 1 of 500 ties draws among all 500
    drawn = native_draw.draw_filtered(
        flat[1:2].expand(64, vocab),
        torch.arange(64),
        torch.linspace(0.01, 1.0, 64),
        torch.ones(64),
        torch.ones(64, dtype=torch.long),
        torch.ones(64),
    )
    assert drawn.min() >= 500
    assert drawn.max() == vocab - 1
    bad = flat.clone()
    bad[0, 7] = float("nan")
    assert native_draw.draw_filtered(
        bad, torch.tensor([0]), u[:1], one[:1], torch.tensor([3]), torch.tensor([1.0])
    ).tolist() == [-1]
    with pytest.raises(ValueError, match="top_k"):
        native_draw.draw_filtered(
            flat, torch.tensor([0]), u[:1], one[:1], torch.tensor([0]), torch.tensor([1.0])
        )
    with pytest.raises(ValueError, match="rows must index"):
        native_draw.draw_filtered(
            flat, torch.tensor([4]), u[:1], one[:1], torch.tensor([3]), torch.tensor([1.0])
        )


def test_what_it_does_not_take() -> None:
    assert not native_draw.takes(torch.zeros(2, 10, dtype=torch.float16))
    assert not native_draw.takes(torch.zeros(10))
    assert not native_draw.takes(torch.zeros(10, 2).t())  # tokens not contiguous
    assert not native_draw.takes(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="one value per row"):
        native_draw.draw(torch.zeros(2, 10), torch.ones(3), *_plain(2), BLOCK)


def test_a_step_fetched_natively_matches_the_torch_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """StepDraw.fetch with bf16 logits (the native draws) against fp32 logits through the
    torch form: plain, tempered, greedy, top-k, top-p rows, top-k logprobs and stop tokens; the
    same tokens but at rounding boundaries, and in filtered rows but where torch's sort put
    tied tokens in another order (the kernel's order, ascending tokens, is checked above)."""
    vocab, n = 3000, 60
    kinds: list[dict[str, Any]] = [
        {"temperature": 1.0},
        {"temperature": 0.6},
        {"temperature": 0.0},
        {"temperature": 0.9, "top_k": 20},
        {"temperature": 1.0, "top_p": 0.8},
        {"temperature": 0.0, "top_k": 5},
        {"temperature": 1.0, "topk_sample_logprobs": 4},
        {"temperature": 1.0, "stop_token_ids": tuple(range(0, 3000, 2))},
    ]
    works = [work(seed=s, **kinds[s % len(kinds)]) for s in range(n)]
    logits = _logits(n, vocab, seed=10, scale=2.0)
    positions = torch.arange(n) + 3
    params = step_params(works, vocab)
    native = d.StepDraw.fetch(logits.bfloat16(), params, positions)
    monkeypatch.setattr(native_draw, "takes", lambda logits: False)
    torch_form = d.StepDraw.fetch(logits, params, positions)
    # Unfiltered rows may part at a rounding boundary of their CDF (the other test above);
    # filtered and greedy rows are drawn alike.
    u = d.uniforms(params.seed_lo, params.seed_hi, positions)
    parted = [i for i in range(n) if native.tokens[i] != torch_form.tokens[i]]
    filtered = [r for r in parted if {"top_k", "top_p"} & kinds[r % len(kinds)].keys()]
    for r in filtered:  # a tie: the same probability, so the same place in the sorted row
        assert logits[r, native.tokens[r]] == logits[r, torch_form.tokens[r]], r
    for r in parted:
        kind = kinds[r % len(kinds)]
        assert kind["temperature"] > 0, kind
        if r in filtered:
            continue
        cdf = torch.softmax(logits[r].double() / kind["temperature"], -1).cumsum(0)
        lo, hi = sorted((native.tokens[r], torch_form.tokens[r]))
        assert abs(float(u[r]) - float(cdf[lo])) < 1e-6, (r, lo, hi)
        assert abs(float(u[r]) - float(cdf[hi - 1])) < 1e-6, (r, lo, hi)
    assert len(parted) - len(filtered) <= 2, parted
    same = [i for i in range(n) if i not in parted]
    assert native.finite == torch_form.finite == [True] * n
    assert [native.stop_hit[i] for i in same] == [torch_form.stop_hit[i] for i in same]
    np.testing.assert_allclose(
        [native.logprobs[i] for i in same], [torch_form.logprobs[i] for i in same], atol=1e-5
    )
    assert native.topk is not None
    assert torch_form.topk is not None
    for mine, theirs in zip(native.topk, torch_form.topk, strict=True):
        assert [i for i, _ in mine] == [i for i, _ in theirs]
        np.testing.assert_allclose([v for _, v in mine], [v for _, v in theirs], atol=1e-5)
    exact = torch.log_softmax(logits.double(), -1)
    expected = exact.gather(1, torch.tensor(native.tokens)[:, None])[:, 0]
    np.testing.assert_allclose(native.logprobs, expected.numpy(), rtol=0, atol=2e-7)
    assert any(native.stop_hit)
    assert not all(native.stop_hit)


def test_a_build_for_avx2_draws_the_bits_of_the_hosts_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """draw.cpp built for x86-64-v3 (TUNELOOP_CPU_ISA=avx2: the 16-lane loops as two 8-lane
    halves, where GCC would expand them lane by lane) draws the tokens, logsumexps, maxima and
    filtered tokens of the build for this host, bit for bit: fp32 and bf16 logits, ragged
    blocks, three temperatures, greedy rows, a NaN row, top-k, top-p and both."""
    import ctypes

    from tuneloop.server.engine import native

    if not {"avx2", "fma"} <= native.cpu_flags():
        pytest.skip("a CPU without AVX2 and FMA")
    rows, vocab = 24, 5003
    logits = _logits(rows, vocab, seed=5)
    logits[7, 4000] = float("nan")
    gen = torch.Generator().manual_seed(6)
    u = torch.rand(rows, generator=gen).clamp(min=2**-24)
    temperature = torch.tensor([1.0, 0.7, 1.3] * 8)
    greedy = torch.tensor([False, False, False, True] * 6)
    picked = torch.arange(rows)
    top_k = torch.tensor([50, vocab, 700, vocab] * 6)
    top_p = torch.tensor([1.0, 0.9, 0.95, 0.5] * 6)

    def both(x: Any) -> tuple[Any, ...]:
        plain = native_draw.draw(x, u, temperature, greedy, BLOCK)
        return (*plain, native_draw.draw_filtered(x, picked, u, temperature, top_k, top_p))

    own = {dtype: both(logits.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    native.cpu_flags.cache_clear()
    try:
        monkeypatch.setenv(native.ISA_VARIABLE, "avx2")
        built = native._build(native_draw.SOURCE)
    finally:
        monkeypatch.delenv(native.ISA_VARIABLE)
        native.cpu_flags.cache_clear()
    plain, filtered = built.draw_rows, built.draw_filtered_rows
    plain.argtypes, plain.restype = list(native_draw._SIGNATURE), None
    filtered.argtypes, filtered.restype = list(native_draw._FILTERED), ctypes.c_int
    monkeypatch.setattr(native_draw, "_kernel", lambda: plain)
    monkeypatch.setattr(native_draw, "_filtered_kernel", lambda: filtered)
    for dtype, want in own.items():
        got = both(logits.to(dtype))
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), dtype
