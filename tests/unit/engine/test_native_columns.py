"""A lone adapter's LoRA columns by the native kernel (lora/native_columns.py): [x | x @ A.T]
with x copied bit for bit and the product as exact as oneDNN's bf16 matmul, a row's values
blind to the rows beside it, any rank and input size, and the fused decode weights built on
it where the CPU has AVX512-BF16. Skipped elsewhere (fused.py keeps oneDNN's product there,
tested in test_fused_sampling.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from tuneloop.server.engine.lora import fused, native_columns  # noqa: E402

CPU = torch.device("cpu")
BUILT = native_columns.available(torch.bfloat16, CPU)
pytestmark = pytest.mark.skipif(not BUILT, reason="no AVX512-BF16 or no C++ compiler here")
TILES = BUILT and native_columns.tiles(True)


@pytest.fixture(
    params=[
        "blocks",
        pytest.param("tiles", marks=pytest.mark.skipif(not TILES, reason="no AMX here")),
    ]
)
def form(request: pytest.FixtureRequest) -> Iterator[str]:
    """The product on the AVX-512 blocks, and on the AMX tile unit where the CPU has one."""
    native_columns.tiles(request.param == "tiles")
    yield request.param
    native_columns.tiles(True)


def _inputs(rows: int, k: int, r: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).mul(3).bfloat16()
    a = torch.randn(r, k, generator=gen).mul(0.05).bfloat16()
    return x, a


# (rows, input size, rank): SmolLM2's four groups at 128 rows; odd input sizes (a pair with a
# zero), ranks off 16 (masked stores), more outputs than a block's 64, one row, tails of rows
SHAPES = [
    (128, 576, 96),
    (128, 576, 32),
    (128, 576, 64),
    (128, 1536, 32),
    (1, 8, 3),
    (5, 7, 6),
    (13, 33, 17),
    (29, 1001, 200),
]


@pytest.mark.parametrize(("rows", "k", "r"), SHAPES)
def test_columns_are_the_input_then_its_product_as_exact_as_onednn(
    rows: int, k: int, r: int, form: str
) -> None:
    x, a = _inputs(rows, k, r, seed=rows + k + r)
    got = native_columns.extend(x, native_columns.pack(a))
    assert got.shape == (rows, k + r)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[:, :k], x)
    exact = x.double() @ a.double().t()
    ours = (got[:, k:].double() - exact).abs()
    theirs = (nn.functional.linear(x, a).double() - exact).abs()
    # each output is the fp32 sum rounded once: within half a bf16 step of the exact value
    # (plus the fp32 sum's error), as oneDNN's, which it equals but for the order of the sums
    assert ours.max() <= theirs.max() * 1.01 + 1e-6
    step = exact.abs().clamp_min(1e-30) * 2.0**-8
    assert bool((ours <= step + 1e-6).all())
    differs = (got[:, k:] != nn.functional.linear(x, a)).float().mean()
    assert differs <= 0.01


def test_a_row_does_not_depend_on_the_rows_beside_it_or_on_the_thread_count(form: str) -> None:
    x, a = _inputs(128, 576, 96, seed=3)
    down = native_columns.pack(a)
    alone = torch.cat([native_columns.extend(x[i : i + 1], down) for i in range(0, 128, 9)])
    batch = native_columns.extend(x, down)[::9]
    assert torch.equal(alone, batch)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = native_columns.extend(x, down)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, native_columns.extend(x, down))


def test_strided_and_empty_inputs(form: str) -> None:
    x, a = _inputs(16, 64, 32, seed=5)
    down = native_columns.pack(a)
    wide = torch.cat([x, torch.full((16, 7), float("nan")).bfloat16()], dim=1)
    view = wide[:, :64]  # rows 71 apart: read in place, the NaNs beside them never
    assert torch.equal(native_columns.extend(view, down), native_columns.extend(x, down))
    columns = wide.t().contiguous().t()[:, :64]  # column-major: copied first
    assert torch.equal(native_columns.extend(columns, down), native_columns.extend(x, down))
    assert native_columns.extend(x[:0], down).shape == (0, 96)


def test_refuses_what_it_cannot_read() -> None:
    x, a = _inputs(4, 64, 32, seed=7)
    down = native_columns.pack(a)
    with pytest.raises(ValueError, match="bf16"):
        native_columns.extend(x.float(), down)
    with pytest.raises(ValueError, match="features"):
        native_columns.extend(x[:, :32], down)
    with pytest.raises(ValueError, match="bf16"):
        native_columns.pack(a.float())


def test_fused_bf16_weights_carry_their_lora_columns_natively() -> None:
    gen = torch.Generator().manual_seed(11)
    layers = []
    for out in (96, 32, 32):
        layer = nn.Linear(64, out, bias=False).bfloat16().requires_grad_(False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(out, 64, generator=gen).mul(0.1))
        layers.append(layer)
    factors = [
        (torch.randn(8, 64, generator=gen).bfloat16(), torch.randn(o, 8, generator=gen), 0.5)
        for o in (96, 32, 32)
    ]
    group = fused.FusedLinear.build(layers, factors)
    assert isinstance(group.a, native_columns.DownPairs)
    assert group.nbytes > group.a.pairs.numel() * 2
    x = torch.randn(1, 10, 64, generator=gen).bfloat16()
    for index, (layer, (a, b, scale)) in enumerate(zip(layers, factors, strict=True)):
        got = group.output(index, x).double()
        want = x.double() @ layer.weight.double().t()
        want += scale * (x.double() @ a.double().t()) @ b.bfloat16().double().t()
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


@pytest.mark.skipif(not TILES, reason="no AMX here")
def test_the_tile_unit_and_the_blocks_sum_alike() -> None:
    """Both forms sum each output pair by pair in fp32 and round once: on SmolLM2's groups
    they differ from each other no more than each differs from oneDNN's (a bf16 step, rarely),
    and the tiles take input sizes of whole tiles alone (the rest stays on the blocks)."""
    for rows, k, r in [(128, 576, 96), (37, 1536, 32), (29, 1001, 200)]:
        x, a = _inputs(rows, k, r, seed=k + r)
        down = native_columns.pack(a)
        tiles = native_columns.extend(x, down)
        native_columns.tiles(False)
        try:
            blocks = native_columns.extend(x, down)
        finally:
            native_columns.tiles(True)
        assert torch.equal(tiles[:, :k], blocks[:, :k])
        if k % 32:
            assert torch.equal(tiles, blocks)
        differ = (tiles[:, k:] != blocks[:, k:]).float().mean()
        assert differ <= 0.01
        step = blocks[:, k:].float().abs() * 2.0**-7
        assert bool(((tiles[:, k:].float() - blocks[:, k:].float()).abs() <= step).all())
