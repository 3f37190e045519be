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
