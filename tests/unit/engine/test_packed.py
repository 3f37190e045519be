"""Frozen weights packed for oneDNN's half-precision kernels give `functional.linear`'s bits, fp32
ones (x86-64) its values to fp32 rounding; what cannot be packed (no native kernels, fp32 on
other machines) stays a plain tensor; a lone snapshot's fused or merged weights are packed where
the CPU can, and sample as they did unpacked."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.unit.engine.conftest import TINY, adapter_spec, bank, ok, train  # noqa: E402
from tests.unit.engine.test_sampler import TRAIN_DATA, prompt, sw  # noqa: E402
from tuneloop.server.engine import packed  # noqa: E402
from tuneloop.server.engine.torch_backend import TorchBackend  # noqa: E402

BF16 = torch.bfloat16
native = pytest.mark.skipif(
    not packed.packable(torch.zeros(2, 2, dtype=BF16)), reason="no native bf16 kernels here"
)


X86 = platform.machine().lower() in ("x86_64", "amd64")
x86 = pytest.mark.skipif(not X86, reason="fp32 is packed on x86-64 only")


def test_one_dimensional_and_integer_weights_stay_plain() -> None:
    assert not packed.packable(torch.zeros(4, dtype=BF16))
    assert not packed.packable(torch.zeros(4))
    w = torch.ones(8, 4, dtype=torch.int64)
    assert packed.pack(w) is w


def test_fp32_stays_plain_off_x86(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed.platform, "machine", lambda: "aarch64")
    w = torch.randn(8, 4)
    assert packed.pack(w) is w
    x = torch.randn(3, 4)
    assert torch.equal(packed.linear(x, w, None), x @ w.t())


@x86
@pytest.mark.parametrize("rows", [1, 7, 128, 300])
@pytest.mark.parametrize("shape", [(1536, 576), (192, 576), (576, 1536)])
def test_packed_fp32_linear_is_functional_linear_to_fp32_rounding(
    rows: int, shape: tuple[int, int]
) -> None:
    """Within the textbook bound of a K-term fp32 dot product's rounding, K eps (|x| @ |w|.T):
    a bf16 product (or any kernel rounding its inputs) would be ~2^16 times past it."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(shape, generator=g)
    bias = torch.randn(shape[0], generator=g)
    p = packed.pack(w)
    assert p.is_mkldnn
    assert p.shape == w.shape
    eps = torch.finfo(torch.float32).eps
    for x in (
        torch.randn(rows, shape[1], generator=g),
        torch.randn(1, rows, shape[1], generator=g),
        torch.randn(rows, shape[1] + 5, generator=g)[:, : shape[1]],
    ):
        exact = x.double() @ w.double().t()
        bound = (shape[1] + 1) * eps * (x.double().abs() @ w.double().abs().t() + bias.abs())
        for b in (None, bias):
            got = packed.linear(x, p, b).double()
            want = exact if b is None else exact + b.double()
            assert got.shape == want.shape
            assert bool(((got - want).abs() <= bound).all())


def test_without_native_kernels_nothing_is_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    w = torch.randn(8, 4, dtype=BF16)
    assert packed.pack(w) is w


@x86
def test_bf16_is_packed_only_on_cpus_with_bf16_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN calls bf16 supported on AVX-512 CPUs without bf16 units, where it emulates it
    (and its packed sums round apart from functional.linear's): those keep plain bf16
    weights; fp32 packs there as before."""
    if not packed._kernels():
        pytest.skip("no oneDNN linear here")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(packed.native, "cpu_flags", lambda: frozenset({"avx512f", "avx512bw"}))
    w = torch.randn(8, 4, dtype=BF16)
    assert not packed.packable(w)
    assert packed.pack(w) is w
    assert packed.packable(w.float())
    for units in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(packed.native, "cpu_flags", lambda units=units: frozenset({units}))
        assert packed.packable(w)


@native
@pytest.mark.parametrize("rows", [1, 7, 128, 300])
@pytest.mark.parametrize("shape", [(1536, 576), (192, 576), (576, 1536)])
def test_packed_linear_gives_functional_linear_bits(rows: int, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(shape, generator=g).to(BF16)
    bias = torch.randn(shape[0], generator=g).to(BF16)
    p = packed.pack(w)
    assert p.is_mkldnn
    assert p.shape == w.shape
    for x in (
        torch.randn(rows, shape[1], generator=g).to(BF16),
        torch.randn(1, rows, shape[1], generator=g).to(BF16),  # a packed row [1, N, d]
        torch.randn(rows, shape[1] + 5, generator=g).to(BF16)[:, : shape[1]],  # strided
    ):
        assert torch.equal(packed.linear(x, p, None), torch.nn.functional.linear(x, w))
        assert torch.equal(packed.linear(x, p, bias), torch.nn.functional.linear(x, w, bias))


def _lone_sampler(tmp_path: Path, dtype: torch.dtype) -> TorchBackend:
    be = TorchBackend([TINY], cache_dir=tmp_path, device="cpu", dtype=dtype)
    be.create_adapter(adapter_spec("A", rank=4, seed=1))
    train(be, "A", TRAIN_DATA, 3, lr=2e-2)
    be.create_sampler("sA", TINY, adapter_id="A")
    return be


def _packed_then_plain(
    be: TorchBackend, monkeypatch: pytest.MonkeyPatch, merge: bool
) -> tuple[Any, Any]:
    """A lone snapshot's samples on its packed copy, then on a plain one (`packable` off);
    oneDNN's packing, not the native linear kernel's layout (test_native_linear.py)."""
    monkeypatch.setenv("TUNELOOP_NATIVE_LINEAR", "0")
    works = [sw("sA", prompt(5, 1), num_samples=3, seed=4, max_tokens=10)]
    got = ok(be.sample(works)[0])
    weights = bank(be).lone_weights("sA", merge=merge)
    assert weights
    assert all(group.weight.is_mkldnn for group, _ in weights.values())
    bank(be).release_lone()
    monkeypatch.setattr(packed, "packable", lambda weight: False)
    plain = ok(be.sample(works)[0])
    held = bank(be).lone_weights("sA", merge=merge) or {}
    assert held
    assert not any(group.weight.is_mkldnn for group, _ in held.values())
    for a, b in zip(got.sequences, plain.sequences, strict=True):
        assert a.tokens == b.tokens
    return got, plain


@native
@pytest.mark.parametrize("merge", [False, True])
def test_a_lone_bf16_snapshot_samples_on_packed_weights_as_unpacked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, merge: bool
) -> None:
    be = _lone_sampler(tmp_path, BF16)
    be.merge_lone_adapter = merge  # fused by default here; merged with `serve --merged-sampling`
    be.fuse_lone_key = True  # (the default follows `packable`, switched off half-way)
    got, plain = _packed_then_plain(be, monkeypatch, merge)
    for a, b in zip(got.sequences, plain.sequences, strict=True):
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    be.close()


@x86
def test_a_lone_fp32_snapshot_samples_on_packed_merged_weights_as_on_sgemm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 on a CPU: merged by default, the merged copy packed; the same tokens as on plain
    weights (MKL's sgemm) and logprobs within a few fp32 roundings of theirs."""
    be = _lone_sampler(tmp_path, torch.float32)
    got, plain = _packed_then_plain(be, monkeypatch, merge=True)
    assert all(
        group.a is None for group, _ in (bank(be).lone_weights("sA", merge=True) or {}).values()
    )
    for a, b in zip(got.sequences, plain.sequences, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    be.close()
