"""Steps of several keys (lora/segments.py): each key's LoRA delta of a sibling group added to its
rows of the shared base output, by the native delta kernel on CPUs with AVX512-BF16 (else two
matmuls); built once per version of a key's factors (`AdapterBank.deltas`); a row's values
depend on its own key alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.unit.engine.conftest import TINY, bank, ok, seq  # noqa: E402
from tests.unit.engine.test_decode_layers import (  # noqa: E402
    LLAMA,
    _backend,
    _outputs,
    _runtime,
    _second_sampler,
    _trained_sampler,
    _works,
)
from tests.unit.engine.test_merged_sampling import _trained  # noqa: E402
from tuneloop.server.engine.lora import bank as bank_module  # noqa: E402
from tuneloop.server.engine.lora import native_columns  # noqa: E402
from tuneloop.server.engine.lora.segments import KeyDelta, add  # noqa: E402
from tuneloop.server.engine.types import SampleWork  # noqa: E402

CPU = torch.device("cpu")
native = pytest.mark.skipif(
    not native_columns.available(torch.bfloat16, CPU), reason="needs the AVX512-BF16 kernels"
)


def _factors(sizes: list[int], rank: int, k: int, skip: int | None = None) -> list[Any]:
    gen = torch.Generator().manual_seed(rank + len(sizes))
    return [
        None
        if i == skip
        else (
            torch.randn(rank, k, generator=gen) * 0.05,
            torch.randn(n, rank, generator=gen) * 0.05,
            2.0,
        )
        for i, n in enumerate(sizes)
    ]


@native
@pytest.mark.parametrize(
    ("sizes", "rank", "rows", "skip"),
    [
        ([64, 32, 32], 8, 29, None),  # q/k/v-like; more rows than a chunk of 24
        ([96, 96], 16, 7, None),  # gate/up-like
        ([48], 4, 1, None),  # one row
        ([64, 32, 32], 7, 13, 1),  # an odd rank; a member the key does not adapt
        ([1024], 8, 40, None),  # a head's many output vectors
    ],
)
def test_the_kernel_adds_each_rows_delta_once_rounded(
    sizes: list[int], rank: int, rows: int, skip: int | None, two_threads: None
) -> None:
    """y[rows of the key] = bf16(y + low @ up) with low the LoRA columns kernel's product, in
    fp32 to a bf16 step in a few outputs (the sums' order); other rows and an unadapted
    member's outputs untouched; the same values as the two-matmul path."""
    k, start = 80, 5
    factors = _factors(sizes, rank, k, skip)
    delta = KeyDelta.build(sizes, factors, torch.bfloat16)
    matmul = KeyDelta.build(sizes, factors, torch.bfloat16, kernel=False)  # two matmuls
    assert delta is not None
    assert delta.vectors is not None
    assert delta.up is None  # (one form kept)
    assert matmul is not None
    assert matmul.up is not None
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(start + rows + 3, k, generator=gen).bfloat16()
    y0 = torch.randn(x.shape[0], sum(sizes), generator=gen).bfloat16()
    y = y0.clone()
    add(y, x, [(start, start + rows, delta)])
    low = native_columns.low(x[start : start + rows], delta.down).float()
    want = (y0[start : start + rows].float() + low @ matmul.up.float()).bfloat16()
    got = y[start : start + rows]
    step = want.float().abs().clamp(min=1e-30) * 2.0**-7  # one bf16 step, about
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.99
    assert torch.equal(y[:start], y0[:start])
    assert torch.equal(y[start + rows :], y0[start + rows :])
    if skip is not None:
        cols = slice(sum(sizes[:skip]), sum(sizes[: skip + 1]))
        assert torch.equal(y[:, cols], y0[:, cols])
    matmuls = y0.clone()
    add(matmuls, x, [(start, start + rows, matmul)])
    assert ((matmuls.float() - y.float()).abs() <= step.max()).all()


@native
def test_segments_of_two_keys_each_add_their_own() -> None:
    sizes, k = [32, 16, 16], 48
    first = KeyDelta.build(sizes, _factors(sizes, 4, k), torch.bfloat16)
    second = KeyDelta.build(sizes, _factors(sizes, 8, k), torch.bfloat16)
    assert first is not None
    assert second is not None
    x = torch.randn(10, k).bfloat16()
    y0 = torch.randn(10, 64).bfloat16()
    both = add(y0.clone(), x, [(0, 4, first), (4, 7, None), (7, 10, second)])
    alone = add(y0.clone(), x, [(0, 4, first)])
    assert torch.equal(both[:4], alone[:4])
    assert torch.equal(both[4:7], y0[4:7])  # the base model's rows
    assert torch.equal(both[7:], add(y0.clone(), x, [(7, 10, second)])[7:])
    assert not torch.equal(both[7:], y0[7:])


@native
def test_the_kernel_refuses_what_it_cannot_read() -> None:
    sizes = [32]
    delta = KeyDelta.build(sizes, _factors(sizes, 4, 16), torch.bfloat16)
    assert delta is not None
    assert delta.vectors is not None
    x, y = torch.randn(4, 16).bfloat16(), torch.zeros(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside"):
        native_columns.add_delta(y, x, delta.down, delta.vectors, 2, 6)
    with pytest.raises(ValueError, match="width"):
        native_columns.add_delta(y[:, :16], x, delta.down, delta.vectors, 0, 4)
    assert not y.any()


def test_layouts_the_kernel_does_not_take_keep_the_matmuls() -> None:
    """Members of different ranks, or widths not a multiple of 16: the two-matmul path."""
    ranks = [torch.ones(32, 4), torch.ones(32, 8)]
    assert native_columns.pack_up([32, 32], ranks, torch.bfloat16) is None  # type: ignore[arg-type]
    assert native_columns.pack_up([24], [torch.ones(24, 4)], torch.bfloat16) is None
    delta = KeyDelta.build([24], _factors([24], 4, 16), torch.bfloat16)
    assert delta is not None
    assert delta.vectors is None
    with pytest.raises(ValueError, match="one form"):
        KeyDelta(delta.down, None)
    x, y0 = torch.randn(3, 16).bfloat16(), torch.randn(3, 24).bfloat16()
    y = add(y0.clone(), x, [(1, 3, delta)])
    assert torch.equal(y[0], y0[0])
    assert not torch.equal(y[1:], y0[1:])


def test_the_bank_keeps_a_key_s_deltas_per_version(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    be = _trained(backend)
    held = bank(be)
    assert held.deltas(None) == {}
    assert held.deltas(None) is held.deltas(None)
    assert held.deltas("A") is None  # trainable: its factors change at every optimizer step
    assert held.deltas("nobody") is None
    first = held.deltas("sA")
    assert first
    assert held.deltas("sA") is first
    assert held.lone_bytes >= sum(d.nbytes for d in {id(d): d for d in first.values()}.values())
    be.delete_sampler("sA")
    assert held.deltas("sA") is None
    be.create_sampler("sA", TINY, adapter_id="A")
    again = held.deltas("sA")
    assert again
    assert again is not first
    monkeypatch.setattr(bank_module, "DELTA_KEYS", 1)
    assert held.deltas("sB")
    assert list(held._deltas) == ["sB"]  # the least recently used dropped


@native
def test_a_tenant_s_rows_do_not_depend_on_the_other_keys(tmp_path: Path) -> None:
    """Sampler "s" beside "t" (another adapter) or beside "u" (the base model) with the same
    requests: every token and logprob of "s" is the same, bit for bit; beside "n" (NaN
    up-projections), the same as beside a tenant that leaves when "n"'s requests fail."""
    be = _backend(LLAMA, tmp_path / "cache")
    try:
        _trained_sampler(be, LLAMA)
        _second_sampler(be, LLAMA)
        be.create_sampler("u", LLAMA)
        mine = _works(3, 4, 8)

        def beside(other: str) -> list[Any]:
            theirs = [
                SampleWork(other, seq(6 + i, 70 + i), 4, 8, 1.0, -1, 1.0, 5 + i, (), ())
                for i in range(2)
            ]
            return _outputs(be, [*mine, *theirs])[: 3 * 4]

        with_t, with_u = beside("t"), beside("u")
        assert with_t == with_u
        assert ok(be.sample(mine)[0]).sequences  # (and alone, on its lone weights)
        # A snapshot whose up-projections are NaN beside "s": its requests fail with the
        # engine's error at their first token, and "s" goes on alone from there. Its values
        # are those beside a tenant whose requests end after one token: the same steps, the
        # NaN never in them.
        be.create_sampler("n", LLAMA, adapter_id="B")
        with torch.no_grad():
            for module in _runtime(be).bank.modules.values():
                found = module.lookup("n")
                if found is not None:
                    found[1].fill_(float("nan"))

        def requests(other: str, tokens: int) -> list[SampleWork]:
            return [
                SampleWork(other, seq(6 + i, 70 + i), 4, tokens, 1.0, -1, 1.0, 5 + i, (), ())
                for i in range(2)
            ]

        results = be.sample([*mine, *requests("n", 8)])
        assert all(isinstance(r, Exception) and "non-finite" in str(r) for r in results[3:])
        got = [(list(s.tokens), list(s.logprobs)) for r in results[:3] for s in ok(r).sequences]
        assert got == _outputs(be, [*mine, *requests("t", 1)])[: 3 * 4]
    finally:
        be.close()
