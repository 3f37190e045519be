"""The batched on-device draw: counter-based per-row randomness, filters, one host copy."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.overrides import TorchFunctionMode  # noqa: E402

from tests.unit.engine.test_sampler import sw  # noqa: E402
from tuneloop.server.engine import draw as d  # noqa: E402
from tuneloop.server.engine import sampler  # noqa: E402
from tuneloop.server.engine.types import SampleWork  # noqa: E402

V = 50


def work(**kw: Any) -> SampleWork:
    return sw("s", np.arange(3, dtype=np.int64), **{"max_tokens": 100, **kw})


def rows_of(works: list[SampleWork]) -> list[sampler.Row]:
    return [sampler.Row(w, sampler.row_seed(w.seed, 0)) for w in works]


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2


def params(rows: list[sampler.Row]) -> d.DrawParams:
    return sampler.draw_params(rows, V, torch.device("cpu"))


def test_uniforms_are_uniform_and_differ_by_seed_and_position() -> None:
    seeds = torch.arange(4000, dtype=torch.long)
    zeros = torch.zeros_like(seeds)
    u = d.uniforms(seeds, zeros, torch.full_like(seeds, 7))
    assert float(u.min()) > 0.0
    assert float(u.max()) <= 1.0
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float(((counts - 400) ** 2 / 400).sum()) < 30  # chi-square, 9 dof: p ~ 0.0004
    next_pos = d.uniforms(seeds, zeros, torch.full_like(seeds, 8))
    other_hi = d.uniforms(seeds, torch.ones_like(seeds), torch.full_like(seeds, 7))
    assert float((u == next_pos).float().mean()) < 0.01
    assert float((u == other_hi).float().mean()) < 0.01
    # consecutive positions of one seed are not correlated
    one = d.uniforms(zeros[:1].expand(4000), zeros, torch.arange(4000))
    assert abs(float(torch.corrcoef(torch.stack([one[:-1], one[1:]]))[0, 1])) < 0.05


def joint_chi2(a: torch.Tensor, b: torch.Tensor, bins: int = 5) -> float:
    """Chi-square of the pairs (a, b) of uniforms against independence, bins x bins cells."""
    cell = (a * bins).long().clamp(max=bins - 1) * bins + (b * bins).long().clamp(max=bins - 1)
    counts = torch.bincount(cell, minlength=bins * bins).double()
    expect = len(a) / bins**2
    return float(((counts - expect) ** 2 / expect).sum())


def test_a_requests_rows_and_a_rows_positions_draw_independently() -> None:
    """A request's rows have neighbouring seeds (row_seed(seed, j)) and draw at the same position
    in every step, and the recipes give neighbouring requests neighbouring seeds (seed * 1000 +
    j): the pairs of uniforms they draw must be independent, not merely each uniform."""
    seeds = [sampler.row_seed(base, j) for base in range(2500) for j in range(2)]
    s = torch.tensor(seeds, dtype=torch.long)
    lo, hi = s & 0xFFFFFFFF, s >> 32
    u = torch.stack([d.uniforms(lo, hi, torch.full_like(s, p)) for p in range(3)], 1)
    rows = u.reshape(2500, 2, 3)
    # 24 degrees of freedom: 60 is exceeded with probability ~6e-5 by independent pairs
    assert joint_chi2(rows[:, 0, 1], rows[:, 1, 1]) < 60  # rows 0 and 1 of one request
    assert joint_chi2(rows[:-1, 0, 2], rows[1:, 0, 2]) < 60  # row 0 of neighbouring requests
    assert joint_chi2(u[:, 0], u[:, 1]) < 60  # positions 0 and 1 of one row
    assert joint_chi2(u[:, 0], (u[:, 0] + 0.01) % 1) > 1000  # the check sees dependence


def test_a_rows_draw_depends_on_its_seed_position_and_logits_only() -> None:
    target = work(seed=11, top_p=0.9, top_k=20, temperature=0.8)
    others = [work(seed=s, temperature=t) for s, t in ((1, 1.0), (2, 0.0), (3, 1.3))]
    logits = logits_for(4, seed=3)
    alone_rows = rows_of([target])
    alone, _ = d.draw(logits[:1], params(alone_rows), torch.tensor([5]))
    for order in ([0, 1, 2, 3], [2, 0, 3, 1], [3, 2, 1, 0]):
        works = [target, *others]
        rows = rows_of([works[i] for i in order])
        batch_logits = torch.cat([logits[:1], logits_for(3, seed=9)])[order]
        positions = torch.tensor([5, 9, 0, 2])[order]
        tokens, _ = d.draw(batch_logits, params(rows), positions)
        assert int(tokens[order.index(0)]) == int(alone[0])
    moved, _ = d.draw(logits[:1].repeat(64, 1), params(alone_rows * 64), torch.arange(64))
    assert len(set(moved.tolist())) > 1  # the position moves the stream


def test_draws_follow_the_tempered_distribution() -> None:
    logits = logits_for(1, seed=5)
    n = 6000
    rows = rows_of([work(seed=s, temperature=0.7) for s in range(n)])
    tokens, _ = d.draw(logits.expand(n, V), params(rows), torch.zeros(n, dtype=torch.long))
    probs = torch.softmax(logits[0] / 0.7, -1).numpy()
    seen = Counter(tokens.tolist())
    for token in np.argsort(-probs)[:5]:  # the likely tokens, within 5 standard deviations
        expect = probs[token] * n
        assert abs(seen[int(token)] - expect) < 5 * np.sqrt(expect) + 5, (token, seen, expect)


def reference_support(probs: torch.Tensor, k: int, p: float) -> set[int]:
    """The tokens top-k then top-p keep, computed plainly, token by token."""
    order = sorted(range(V), key=lambda i: -float(probs[i]))
    if 0 < k < V:
        kth = float(probs[order[k - 1]])
        order = [i for i in order if float(probs[i]) >= kth]
    total = sum(float(probs[i]) for i in order)
    kept, mass = [], 0.0
    for i in order:
        if mass / total >= p:
            break
        kept.append(i)
        mass += float(probs[i])
    return set(kept)


@pytest.mark.parametrize(("k", "p"), [(5, 1.0), (-1, 0.6), (8, 0.5), (1, 1.0), (0, 0.3)])
def test_top_k_and_top_p_draw_only_what_they_keep(k: int, p: float) -> None:
    logits = logits_for(1, seed=7)
    n = 3000
    rows = rows_of([work(seed=s, top_k=k, top_p=p) for s in range(n)])
    # unfiltered rows between them: they draw from the whole vocabulary as before
    rows += rows_of([work(seed=s) for s in range(n)])
    tokens, _ = d.draw(logits.expand(2 * n, V), params(rows), torch.zeros(2 * n, dtype=torch.long))
    support = reference_support(torch.softmax(logits[0], -1), k, p)
    assert set(tokens[:n].tolist()) == support
    assert len(set(tokens[n:].tolist())) > len(support)


def test_greedy_rows_take_the_argmax() -> None:
    logits = logits_for(3, seed=2)
    rows = rows_of([work(temperature=0.0), work(temperature=1e-30, top_p=0.5), work(top_k=1)])
    tokens, _ = d.draw(logits, params(rows), torch.tensor([0, 4, 8]))
    assert tokens.tolist() == logits.argmax(-1).tolist()


class HostReads(TorchFunctionMode):
    """Counts the calls that copy a tensor's values to the host."""

    READS = frozenset({"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"})

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_a_step_reads_the_device_once_and_fails_poisoned_requests_alone() -> None:
    poisoned = work(seed=4, num_samples=2)
    works = [work(seed=1, topk_sample_logprobs=3, stop_token_ids=(7, 9)), poisoned, poisoned]
    works.append(work(seed=2, temperature=0.0))
    rows = [sampler.Row(w, sampler.row_seed(w.seed, i), index=i) for i, w in enumerate(works)]
    logits = logits_for(4, seed=1)
    logits[2, 3] = float("nan")  # one row of the poisoned request: both its rows draw nothing
    prepared = params(rows)
    with HostReads() as mode:
        going = sampler.sample_rows(logits, rows, lambda tokens: "", prepared)
    assert mode.reads == ["tolist"]
    assert going[1] is None
    assert going[2] is None
    assert rows[1].tokens == rows[2].tokens == []
    assert going[0] is True
    assert going[3] is True
    clean = rows_of([works[0], works[3]])
    clean[0].seed, clean[1].seed = rows[0].seed, rows[3].seed
    sampler.sample_rows(logits[[0, 3]], clean, lambda tokens: "")
    assert [rows[0].tokens, rows[3].tokens] == [clean[0].tokens, clean[1].tokens]
    logprobs = torch.log_softmax(logits[0], -1)
    assert rows[0].logprobs == [pytest.approx(float(logprobs[rows[0].tokens[0]]), abs=1e-6)]
    assert [i for i, _ in rows[0].topk[0]] == torch.topk(logprobs, 3).indices.tolist()


def test_stop_tokens_are_checked_on_the_device() -> None:
    logits = torch.full((2, V), -10.0)
    logits[:, 7] = 10.0
    rows = rows_of([work(stop_token_ids=(3, 7)), work(stop_token_ids=(3,))])
    going = sampler.sample_rows(logits, rows, lambda tokens: "")
    assert going == [False, True]
    assert rows[0].stop_reason == "stop"
    assert rows[1].stop_reason is None


# ---- the blocked search: the flat inverse CDF's tokens, a few passes over the logits ----------


def uniforms_for(n: int, position: int = 0) -> torch.Tensor:
    seeds = torch.arange(n, dtype=torch.long)
    return d.uniforms(seeds, torch.zeros_like(seeds), torch.full_like(seeds, position))


def step_params(works: list[SampleWork], vocab: int) -> d.DrawParams:
    return sampler.draw_params(rows_of(works), vocab, torch.device("cpu"))


@pytest.mark.parametrize("vocab", [50, 256, 1000, 3000])
def test_the_blocked_inverse_cdf_draws_the_flat_cdfs_token(vocab: int) -> None:
    """Against the flat inverse CDF summed exactly (fp64): the blocked search adds in fp32 and
    in another order, so the two may part only where u * total lies within rounding of the
    boundary between their two tokens; each such row is checked to be one (1e-5 of the total:
    fp32 sums of at most 3,000 terms in (0, 1] err by far less). A uniform lands that close
    with probability ~ 2 * rounding * V per row at most (none of these rows did when this was
    written); the count allowed is far above that, the check on each row is the test."""
    n = 4000
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    logits[: n // 4] *= 4  # peaked rows: most of the mass in a few tokens
    probs = torch.softmax(logits, -1)
    u = uniforms_for(n)
    u[:8], u[8:16] = 1.0, 2.0**-24  # the ends of the uniforms' range
    ours = d._inverse_cdf(probs, u)
    cdf = probs.double().cumsum(-1)
    target = u.double() * cdf[:, -1]
    flat = torch.searchsorted(cdf, target[:, None])[:, 0].clamp(max=vocab - 1)
    parted = (ours != flat).nonzero()[:, 0].tolist()
    for r in parted:
        lo, hi = sorted((int(ours[r]), int(flat[r])))
        tol = 1e-5 * float(cdf[r, -1])
        assert abs(float(target[r] - cdf[r, lo])) <= tol, (r, lo, hi)
        assert abs(float(target[r] - cdf[r, hi - 1])) <= tol, (r, lo, hi)
    assert len(parted) <= n // 200, len(parted)
    assert bool((probs.gather(1, ours[:, None]) > 0).all())


SUPPORTS = [[0], [255], [255, 256], [511, 999], [3, 700], [767], [999], [990], [256, 300, 511]]


def zero_outside(supports: list[list[int]], vocab: int, repeat: int) -> torch.Tensor:
    """Rows whose logits are -1e4 outside a few tokens: exp underflows to exactly 0 there
    (an infinity would make the row not finite, and such rows draw nothing)."""
    logits = torch.full((len(supports) * repeat, vocab), -1e4)
    values = torch.randn(len(logits), vocab, generator=torch.Generator().manual_seed(1))
    for i, support in enumerate(supports * repeat):
        logits[i, support] = values[i, support] * 2
    return logits


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_tokens_of_probability_zero_are_never_drawn(temperature: float) -> None:
    """Supports at the ends of blocks of 256 and in the ragged last block of a 1,000-token
    vocabulary, with zero-probability tokens after them up to the end (u = 1 must stop at the
    last token that has mass, not at the vocabulary's end), drawn many times."""
    vocab, repeat = 1000, 300
    logits = zero_outside(SUPPORTS, vocab, repeat)
    works = [work(seed=i, temperature=temperature) for i in range(len(logits))]
    step = d.StepDraw.fetch(logits, step_params(works, vocab), torch.zeros(len(logits)).long())
    for i, token in enumerate(step.tokens):
        assert token in SUPPORTS[i % len(SUPPORTS)], (i, token)
    assert all(step.finite)
    reference = torch.log_softmax(logits, -1)
    expected = reference.gather(1, torch.tensor(step.tokens)[:, None])[:, 0]
    assert step.logprobs == pytest.approx(expected.tolist(), abs=1e-6)
    probs = torch.softmax(logits / temperature, -1)
    for u in (2.0**-24, 0.5, 1.0):  # both ends of the uniforms' range and between
        chosen = d._inverse_cdf(probs, torch.full((len(logits),), u))
        assert bool((probs.gather(1, chosen[:, None]) > 0).all()), u


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_either_infinity_anywhere_makes_a_row_not_finite(bad: float) -> None:
    vocab = 600  # two blocks of 256 and a ragged third
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(2))
    for row, col in enumerate([0, 255, 256, 511, 599]):
        logits[row, col] = bad
    logits[5] = bad  # every logit
    logits[6, :3] = torch.tensor([3e38, -3e38, 1e30])  # large but finite
    works = [
        work(seed=i, temperature=0.0 if i % 2 else 0.7, topk_sample_logprobs=3) for i in range(8)
    ]
    step = d.StepDraw.fetch(logits, step_params(works, vocab), torch.zeros(8, dtype=torch.long))
    assert step.finite == [False] * 6 + [True, True]
    assert all(0 <= t < vocab for t in step.tokens)
    assert step.topk is not None
    assert all(0 <= i < vocab for row in step.topk for i, _ in row)


@pytest.mark.parametrize("vocab", [50, 256, 1000, 5000])
def test_the_blocked_max_argmax_and_top_logits_are_torchs(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(64, vocab, generator=generator) * 4).round()  # many ties
    top, top_at, maxima = d._row_max(logits)
    assert torch.equal(top, logits.amax(-1))
    assert torch.equal(top_at, logits.argmax(-1))  # the first of equal maxima
    for width in (1, 5, 64):
        width = min(width, vocab)
        values, ids = d._top_logits(logits, maxima, width)
        assert torch.equal(values, torch.topk(logits, width, dim=-1).values)
        assert torch.equal(logits.gather(1, ids), values)
        assert all(len(set(row)) == width for row in ids.tolist())


def test_tempered_greedy_filtered_and_plain_rows_mixed_draw_as_each_kind_alone() -> None:
    """One batch interleaving temperatures 0.5, 1 and 2, greedy rows and filtered rows: each
    row's draw is the one it makes in a batch of its own kind (the rows at temperature 1
    alone skip the tempered softmax: the same bits), the draws follow each temperature, the
    greedy rows take the argmax, and every row reports the model's own logprob (temperature
    1)."""
    logits = logits_for(1, seed=5)
    n = 3000
    kinds: list[dict[str, Any]] = [
        {"temperature": 0.5},
        {"temperature": 1.0},
        {"temperature": 2.0},
        {"temperature": 0.0},
        {"temperature": 0.8, "top_k": 10},
    ]
    works = [work(seed=s, **kinds[s % len(kinds)]) for s in range(n * len(kinds))]
    batch = logits.expand(len(works), V)
    positions = torch.zeros(len(works), dtype=torch.long)
    step = d.StepDraw.fetch(batch, step_params(works, V), positions)
    tokens = torch.tensor(step.tokens)
    for k, kind in enumerate(kinds):
        mine = [w for i, w in enumerate(works) if i % len(kinds) == k]
        alone = d.StepDraw.fetch(logits.expand(n, V), step_params(mine, V), positions[:n])
        assert tokens[k :: len(kinds)].tolist() == alone.tokens, kind
    assert set(tokens[3 :: len(kinds)].tolist()) == {int(logits.argmax())}
    for k in range(3):
        temperature = kinds[k]["temperature"]
        probs = torch.softmax(logits[0] / temperature, -1).numpy()
        seen = Counter(tokens[k :: len(kinds)].tolist())
        for token in np.argsort(-probs)[:5]:
            expect = probs[token] * n
            assert abs(seen[int(token)] - expect) < 5 * np.sqrt(expect) + 5, (temperature, token)
    expected = torch.log_softmax(logits[0], -1)[tokens]
    assert step.logprobs == pytest.approx(expected.tolist(), abs=1e-6)
