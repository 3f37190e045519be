"""fp32 products by frozen weights on a CPU by oneDNN or torch's matmul (cpu_fp32_matmul.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine import cpu_fp32_matmul  # noqa: E402

needs_onednn = pytest.mark.skipif(
    not cpu_fp32_matmul._kernels_present(), reason="torch without oneDNN's linear here"
)


@pytest.fixture(autouse=True)
def own_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's measured choice kept in its own folder, not the host's."""
    record = tmp_path / "fp32-matmul.json"
    monkeypatch.setattr(cpu_fp32_matmul, "_record", lambda: record)
    return record


def _bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The textbook bound of an fp32 dot product's rounding, K eps sum |a||b|, per output."""
    k = a.shape[-1]
    return k * torch.finfo(torch.float32).eps * (a.double().abs() @ b.double().abs())


class _Marked(torch.Tensor):
    """A tensor subclass, as a sharded DTensor is one."""


@pytest.fixture(params=[False, True], ids=["torch", "onednn"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param and not cpu_fp32_matmul._kernels_present():
        pytest.skip("torch without oneDNN's linear here")
    monkeypatch.setattr(cpu_fp32_matmul, "_forced", request.param)
    return bool(request.param)


@pytest.mark.parametrize("rows", [0, 1, 7, 130])
def test_linear_and_its_forms_are_fp32_products_within_rounding(kernel: bool, rows: int) -> None:
    """linear (with and without a bias), matmul, addmm_ and linear_into against fp64, on
    inputs with strided rows and a transposed weight, each within K eps sum |x||w|."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(rows, 200, generator=gen)
    x = wide[:, 30:130]  # rows strided
    weight = torch.randn(70, 100, generator=gen)
    bias = torch.randn(70, generator=gen)
    want = x.double() @ weight.double().t()
    bound = _bound(x, weight.t()) + 1e-30

    got = cpu_fp32_matmul.linear(x, weight)
    assert got.dtype == torch.float32
    assert got.shape == (rows, 70)
    assert ((got.double() - want).abs() <= bound).all()
    got = cpu_fp32_matmul.linear(x, weight, bias)
    assert ((got.double() - want - bias.double()).abs() <= bound + 1e-6).all()

    dy = torch.randn(rows, 70, generator=gen)
    got = cpu_fp32_matmul.matmul(dy, weight)  # dy @ W: an input gradient's product
    assert ((got.double() - dy.double() @ weight.double()).abs() <= _bound(dy, weight)).all()

    into = torch.randn(rows, 100, generator=gen)
    before = into.double().clone()
    out = cpu_fp32_matmul.addmm_(into, dy, weight)
    assert out.data_ptr() == into.data_ptr()
    added = before + dy.double() @ weight.double()
    assert ((into.double() - added).abs() <= _bound(dy, weight) + 1e-5 * added.abs() + 1e-6).all()

    logits = torch.zeros(rows, 250)
    cpu_fp32_matmul.linear_into(x, weight, logits[:, 100:170])
    assert ((logits[:, 100:170].double() - want).abs() <= bound).all()
    assert logits[:, :100].abs().sum() == 0
    assert logits[:, 170:].abs().sum() == 0


def test_other_inputs_keep_torch_s_own_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 products (oneDNN's already) and a tensor subclass's (a sharded DTensor's, say)
    give functional.linear's bits; inputs autograd records keep torch's path, whose backward
    reaches them."""
    monkeypatch.setattr(cpu_fp32_matmul, "_forced", True)

    def refused(*args: object) -> None:
        raise AssertionError("these inputs must not reach oneDNN's call")

    monkeypatch.setattr(cpu_fp32_matmul, "_onednn", refused)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 32, generator=gen).bfloat16()
    w = torch.randn(16, 32, generator=gen).bfloat16()
    assert torch.equal(cpu_fp32_matmul.linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(cpu_fp32_matmul.matmul(x, w.t()), x @ w.t())
    sub = torch.Tensor._make_subclass(_Marked, torch.randn(16, 32, generator=gen))
    x32 = torch.randn(9, 32, generator=gen)
    assert torch.equal(cpu_fp32_matmul.linear(x32, sub), torch.nn.functional.linear(x32, sub))
    trained = torch.randn(9, 32, generator=gen, requires_grad=True)
    out = cpu_fp32_matmul.linear(trained, w.float())
    out.sum().backward()
    assert trained.grad is not None
    assert torch.allclose(trained.grad, w.float().sum(0).expand(9, 32))


@needs_onednn
def test_the_kernel_is_measured_once_and_can_be_forced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first call measures both kernels and logs the ratio; `choose` overrides it both
    ways and None returns to the measurement."""
    monkeypatch.setattr(cpu_fp32_matmul, "_forced", None)
    monkeypatch.delenv(cpu_fp32_matmul.VARIABLE, raising=False)
    cpu_fp32_matmul._measured.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="tuneloop.server.engine.cpu_fp32_matmul"):
            measured = cpu_fp32_matmul.onednn_chosen()
        assert "oneDNN's fp32 linear is" in caplog.text
        assert cpu_fp32_matmul.onednn_chosen() is measured  # cached: no second probe
        assert caplog.text.count("oneDNN's fp32 linear is") == 1
        cpu_fp32_matmul.choose(not measured)
        assert cpu_fp32_matmul.onednn_chosen() is (not measured)
        cpu_fp32_matmul.choose(None)
        assert cpu_fp32_matmul.onednn_chosen() is measured
    finally:
        cpu_fp32_matmul.choose(None)


def test_the_environment_sets_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """TUNELOOP_FP32_ONEDNN=0 keeps torch's matmul, =1 takes oneDNN where torch has it, any
    other value is refused by name; `choose` overrides it."""
    monkeypatch.setattr(cpu_fp32_matmul, "_forced", None)
    monkeypatch.setenv(cpu_fp32_matmul.VARIABLE, "0")
    assert cpu_fp32_matmul.onednn_chosen() is False
    monkeypatch.setenv(cpu_fp32_matmul.VARIABLE, "1")
    assert cpu_fp32_matmul.onednn_chosen() is cpu_fp32_matmul._kernels_present()
    monkeypatch.setattr(cpu_fp32_matmul, "_forced", False)
    assert cpu_fp32_matmul.onednn_chosen() is False
    monkeypatch.setattr(cpu_fp32_matmul, "_forced", None)
    monkeypatch.setenv(cpu_fp32_matmul.VARIABLE, "yes")
    with pytest.raises(ValueError, match=cpu_fp32_matmul.VARIABLE):
        cpu_fp32_matmul.onednn_chosen()


@needs_onednn
@pytest.mark.parametrize("slow_form", ["forward", "input gradient", None])
def test_the_probe_weighs_both_forms_of_a_step_s_products(
    monkeypatch: pytest.MonkeyPatch, slow_form: str | None
) -> None:
    """A oneDNN that runs one of a training step's forms (x @ W.T, or dy @ W on a transposed
    weight) slowly is not taken, however fast it runs the other: the probe times both. One
    fast in both is taken."""
    real = cpu_fp32_matmul._onednn

    def uneven(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        form = "forward" if w.is_contiguous() else "input gradient"  # dy @ W: a W.T view
        if form == slow_form:
            # the product 16 times over: a slow kernel, same result (4 times over was not
            # slow enough where oneDNN's fp32 kernel runs 2.2x torch's: a Zen 5 EPYC)
            for _ in range(16):
                out = real(x, w, bias)
            return out
        return torch.empty(x.shape[0], w.shape[0])  # the other form as fast as can be

    monkeypatch.setattr(cpu_fp32_matmul, "_onednn", uneven)
    cpu_fp32_matmul._measured.cache_clear()
    try:
        assert cpu_fp32_matmul._measured() is (slow_form is None)
    finally:
        cpu_fp32_matmul._measured.cache_clear()


@needs_onednn
def test_the_choice_is_kept_for_later_processes(
    own_record: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first measurement is written down; a later process (the cache cleared) reads it
    without probing, and an unreadable record is measured again."""
    probes = []

    def probe() -> tuple[bool, float]:
        probes.append(1)
        return True, 1.5

    monkeypatch.setattr(cpu_fp32_matmul, "_probe", probe)
    cpu_fp32_matmul._measured.cache_clear()
    try:
        assert cpu_fp32_matmul._measured() is True
        assert json.loads(own_record.read_text()) == {"onednn": True, "speedup": 1.5}
        own_record.write_text(json.dumps({"onednn": False, "speedup": 0.9}))
        cpu_fp32_matmul._measured.cache_clear()
        assert cpu_fp32_matmul._measured() is False  # as recorded: no second probe
        assert len(probes) == 1
        own_record.write_text("{")
        cpu_fp32_matmul._measured.cache_clear()
        assert cpu_fp32_matmul._measured() is True
        assert len(probes) == 2
    finally:
        cpu_fp32_matmul._measured.cache_clear()


@needs_onednn
def test_a_record_that_cannot_be_kept_leaves_the_choice_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_fp32_matmul, "_record", lambda: tmp_path / "missing" / "r.json")
    monkeypatch.setattr(cpu_fp32_matmul, "_probe", lambda: (True, 1.2))
    cpu_fp32_matmul._measured.cache_clear()
    try:
        assert cpu_fp32_matmul._measured() is True
    finally:
        cpu_fp32_matmul._measured.cache_clear()
