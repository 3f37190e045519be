"""The gated MLP's native SiLU product (engine/gated_mlp.py, silu_mul.cpp): eager torch's bits
for every input, forward and backward, switched only in MLPs that compute it, and a model's
logits, samples, loss and gradients unchanged by it."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import TINY, adapter_spec, example, ok, seq, train  # noqa: E402
from tuneloop.server.engine import gated_mlp, native  # noqa: E402
from tuneloop.server.engine.torch_backend import TorchBackend  # noqa: E402
from tuneloop.server.engine.types import SampleWork  # noqa: E402

NATIVE = gated_mlp.native_kernel() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="no C++ compiler here")


@pytest.fixture(params=["gathers", "one at a time", "measured"])
def form(request: pytest.FixtureRequest) -> Any:
    """The loops with their tables read by AVX-512 gathers (where the CPU has them), one
    element at a time, and each in the form it measured faster on this CPU (the default): all
    run on one CPU."""
    if request.param == "gathers" and not gated_mlp.gathers(True):
        pytest.skip("no AVX-512 gathers on this CPU")
    gated_mlp.gathers({"gathers": True, "one at a time": False}.get(request.param))
    yield request.param
    gated_mlp.gathers(None)  # (the default: each loop's form measured on this CPU)


def _eager(gate: Any, up: Any) -> Any:
    return torch.nn.functional.silu(gate) * up


def _same_bits(a: Any, b: Any) -> bool:
    """Equal bit for bit, any NaN counting as any other (torch keeps no payload either)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]))


def _llama(**config: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    settings: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
    }
    settings.update(config)
    return LlamaForCausalLM(LlamaConfig(**settings)).to(torch.bfloat16)


def _counting(monkeypatch: pytest.MonkeyPatch, kernel: str = "native_kernel") -> list[int]:
    """Counts the calls of the loop `kernel` names (taken for products of any size: the tiny
    models' are below `MIN_ELEMENTS`)."""
    monkeypatch.setattr(gated_mlp, "MIN_ELEMENTS", 0)
    real = getattr(gated_mlp, kernel)()
    calls: list[int] = []

    def counting(*args: object) -> None:
        calls.append(1)
        real(*args)

    monkeypatch.setattr(gated_mlp, kernel, lambda: counting)
    return calls


@needs_native
def test_the_loop_is_eagers_silu_product_for_every_bf16_gate(form: str) -> None:
    """Every bf16 bit pattern as the gate (±0, subnormals, ±inf, NaN, the largest values): the
    same bits as eager silu then product, by ups of each sign and magnitude."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for up in (
        torch.ones_like(every),
        (torch.randn(every.shape, generator=gen) * 100).bfloat16(),
        torch.full_like(every, -3.0e38),
    ):
        gate = every.view(64, 1024)
        with torch.no_grad():
            out = gated_mlp.silu_mul(gate, up.view(64, 1024))
        assert out is not None
        assert _same_bits(out, _eager(gate, up.view(64, 1024)))


@needs_native
@pytest.mark.parametrize(("rows", "width"), [(1, 7), (128, 7), (1, 1000), (128, 1000), (128, 1536)])
def test_the_loop_reads_the_halves_of_one_matmuls_output(rows: int, width: int, form: str) -> None:
    """gate and up as split views of one [1, rows, 2 width] tensor (rows strided, not
    contiguous) with large magnitudes and zeros among them: eager's bits, no copy needed."""
    gen = torch.Generator().manual_seed(rows * width)
    both = torch.randn(1, rows, 2 * width, generator=gen) * 4
    special = torch.tensor([80.0, -80.0, 1.0e4, -1.0e4, 0.0, -0.0, 17.0, -17.0, 89.0, -89.0])
    picks = torch.randint(0, both.numel(), (both.numel() // 8,), generator=gen)
    both.view(-1)[picks] = special[picks % len(special)]
    gate, up = both.bfloat16().split([width, width], -1)
    assert rows == 1 or not gate.is_contiguous()
    with torch.no_grad():
        out = gated_mlp.silu_mul(gate, up)
    assert out is not None
    assert out.shape == gate.shape
    assert _same_bits(out, _eager(gate, up))


@needs_native
@pytest.mark.parametrize(
    "take",
    [
        lambda t: t[:, :, :40],  # [2, 3, 40] of [2, 3, 80]: rows evenly spaced across batches
        lambda t: t[:, :2, :40],  # [2, 2, 40]: a gap between the batches, copied
        lambda t: t[:1, 1:2, :40],  # one row
        lambda t: t[:, :, None, :40],  # a size-1 dimension among the rows
        lambda t: t[:, :, ::2],  # rows not contiguous, copied
        lambda t: t.transpose(0, 1)[:, :, 40:],  # batches and tokens swapped
    ],
)
def test_the_loop_reads_rows_of_any_layout(take: Any) -> None:
    """Rows read in place where they are evenly spaced with each contiguous, else from a
    contiguous copy; the output contiguous in the inputs' shape."""
    gen = torch.Generator().manual_seed(4)
    whole = (torch.randn(2, 3, 80, generator=gen) * 4).bfloat16()
    gate, up = take(whole), take(whole.flip(-1))
    with torch.no_grad():
        out = gated_mlp.silu_mul(gate, up)
    assert out is not None
    assert out.is_contiguous()
    assert torch.equal(out, _eager(gate, up))


@needs_native
def test_threads_split_the_rows_alike() -> None:
    """Past the size where the loop runs on several threads, the rows come out the same."""
    kernel = gated_mlp.native_kernel()
    gen = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(128, 2 * 1536, generator=gen) * 4).bfloat16().split(1536, -1)
    outs = []
    for threads in (1, 2):
        out = torch.empty(128, 1536, dtype=torch.bfloat16)
        kernel(gate.data_ptr(), 3072, up.data_ptr(), 3072, 128, 1536, out.data_ptr(), threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], _eager(gate, up))


def test_the_loop_refuses_what_it_does_not_compute() -> None:
    """fp32, mismatched shapes, no elements and inputs that record a graph: None (the module's
    own arithmetic runs)."""
    gate = torch.randn(3, 8).bfloat16()
    assert gated_mlp.silu_mul(gate.float(), gate.float()) is None
    assert gated_mlp.silu_mul(gate, gate[:, :4]) is None
    assert gated_mlp.silu_mul(gate[:0], gate[:0]) is None
    assert gated_mlp.silu_mul(gate.clone().requires_grad_(True), gate) is None


@needs_native
def test_a_llama_samples_the_same_logits_with_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 Llama's two MLPs switched: inside a sampling step its logits are the eager
    model's bit for bit, through the loop (products below `MIN_ELEMENTS` stay eager);
    uninstalled, every module has its own forward."""
    model = _llama().eval()
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids).logits
    assert gated_mlp.install(model) == 2
    assert gated_mlp.install(model) == 0  # switched already
    calls = _counting(monkeypatch)
    with torch.no_grad(), native.sampling_step():
        inside = model(ids).logits
    assert len(calls) == 2
    assert torch.equal(inside, before)
    monkeypatch.setattr(gated_mlp, "MIN_ELEMENTS", 9 * 160 + 1)  # one token short
    with torch.no_grad(), native.sampling_step():
        assert torch.equal(model(ids).logits, before)
    assert len(calls) == 2
    assert gated_mlp.uninstall(model) == 2
    assert not any("forward" in vars(m) for m in model.modules())
    monkeypatch.setattr(gated_mlp, "MIN_ELEMENTS", 0)
    with torch.no_grad(), native.sampling_step():
        assert torch.equal(model(ids).logits, before)
    assert len(calls) == 2


@needs_native
def test_training_takes_the_loops_with_eagers_loss_and_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With autograd (outside a sampling step, or inside one with grad on) the product and its
    backward run the loops (`_SiluMul`): the loss and every weight's gradient are the
    uninstalled model's bit for bit. Without the backward loop the module's product runs."""
    eager = _llama()
    switched = copy.deepcopy(eager)
    assert gated_mlp.install(switched) == 2
    calls = _counting(monkeypatch)
    backward_calls = _counting(monkeypatch, "backward_kernel")
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))

    def loss_and_grads(model: Any) -> tuple[Any, list[Any]]:
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want, want_grads = loss_and_grads(eager)
    for step in (False, True):
        with native.sampling_step() if step else contextlib.nullcontext():
            loss, got_grads = loss_and_grads(switched)
        assert torch.equal(loss, want)
        for a, b in zip(got_grads, want_grads, strict=True):
            assert torch.equal(a, b)
    assert len(calls) == len(backward_calls) == 4  # two MLPs, two passes
    monkeypatch.setattr(gated_mlp, "backward_kernel", lambda: None)
    loss, got_grads = loss_and_grads(switched)
    assert torch.equal(loss, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
    assert len(calls) == 4


@needs_native
@pytest.mark.parametrize(("rows", "width", "halves"), [(300, 1536, True), (37, 64, False)])
def test_the_backward_loop_is_eagers_for_every_bf16_gate(
    rows: int, width: int, halves: bool, form: str
) -> None:
    """The product's gradients by the loop against eager autograd's (silu saved, two products,
    silu_backward): every bf16 bit pattern among the gates (±0, subnormals, ±inf, NaN), gate
    and up as the halves of one matmul's output or separate tensors."""
    gen = torch.Generator().manual_seed(rows)
    both = (torch.randn(rows, 2 * width, generator=gen) * 4).bfloat16()
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    flat = both[:, :width].reshape(-1)
    flat[: min(flat.numel(), every.numel())] = every[: flat.numel()]
    both[:, :width] = flat.view(rows, width)
    grad = (torch.randn(rows, width, generator=gen) * 0.1).bfloat16()

    def leaves() -> tuple[Any, Any, list[Any]]:
        if halves:
            whole = both.clone().requires_grad_(True)
            return whole[:, :width], whole[:, width:], [whole]
        gate, up = (
            both[:, i * width : (i + 1) * width].clone().requires_grad_(True) for i in (0, 1)
        )
        return gate, up, [gate, up]

    gate, up, inputs = leaves()
    got = gated_mlp._trained_product(gate, up)
    assert got is not None
    got_grads = torch.autograd.grad(got, inputs, grad)
    gate, up, inputs = leaves()
    want = _eager(gate, up)
    want_grads = torch.autograd.grad(want, inputs, grad)
    for a, b in zip((got, *got_grads), (want, *want_grads), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # (NaN's payload aside)


def test_an_mlp_that_computes_something_else_keeps_its_forward() -> None:
    """A GELU MLP, one that gates the other projection, and an fp32 one (where the loop never
    runs) are not switched."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    assert gated_mlp.install(_llama(hidden_act="gelu")) == 0
    assert gated_mlp.install(_llama().float()) == 0

    class Swapped(LlamaMLP):
        def forward(self, x: Any) -> Any:
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    model = _llama()
    for layer in model.model.layers:
        mlp = Swapped(model.config).to(torch.bfloat16)
        layer.mlp = mlp
    assert gated_mlp.install(model) == 0
    assert not any("forward" in vars(m) for m in model.modules())


@needs_native
def test_a_bf16_backend_samples_as_before_with_lora_adapted_projections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny Qwen3 at bf16 with a trained adapter, its projections LoRA-adapted and its gate
    and up one matmul: the same sampled tokens and logprobs with the MLPs switched as without,
    the loop taken in the sampling steps."""
    be = TorchBackend([TINY], cache_dir=tmp_path / "cache", device="cpu", dtype=torch.bfloat16)
    try:
        model = next(iter(be.resident_models().values()))
        be.create_adapter(adapter_spec("A", seed=3))
        train(be, "A", [example(seq(12, 1))], steps=1, lr=5e-2)
        be.create_sampler("s", TINY, adapter_id="A")
        request = SampleWork("s", seq(6, 9), 2, 6, 1.0, -1, 1.0, 5, (), ())
        [before] = be.sample([request])
        assert gated_mlp.install(model) == model.config.num_hidden_layers
        calls = _counting(monkeypatch)
        [after] = be.sample([request])
        assert calls
        for a, b in zip(ok(after).sequences, ok(before).sequences, strict=True):
            assert a.tokens == b.tokens
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
    finally:
        be.close()


def _fp32_call(kernel: Any, gate: Any, up: Any, stride: int, threads: int = 1) -> tuple[int, Any]:
    out = torch.empty(gate.shape[0], gate.shape[1])
    code = kernel(
        gate.data_ptr(), stride, up.data_ptr(), stride, gate.shape[0], gate.shape[1],
        out.data_ptr(), threads,
    )  # fmt: skip
    return code, out


@pytest.mark.skipif(gated_mlp.fp32_kernel() is None, reason="no fp32 SiLU loop here")
@pytest.mark.parametrize(("rows", "width"), [(1, 16), (5, 1536), (130, 272)])
def test_the_fp32_loop_is_eagers_silu_product(rows: int, width: int) -> None:
    """silu_mul_fp32.cpp with torch's own exp: eager's `silu(gate) * up` bit for bit, the rows
    read as one matmul's halves, over the range where exp rounds, underflows to subnormals and
    zero and overflows (rows split between threads alike); a width off 16 is refused (eager
    computes a row's last width % 16 by its scalar exp)."""
    kernel = gated_mlp.fp32_kernel()
    gen = torch.Generator().manual_seed(rows)
    both = torch.randn(rows, 2 * width, generator=gen) * torch.tensor([1.0, 30.0]).repeat(width)
    both[0, :8] = torch.tensor([0.0, -0.0, 87.5, -87.5, -103.0, -110.0, 89.0, -1e-40])
    gate, up = both[:, :width], both[:, width:]
    for threads in (1, 2):
        code, out = _fp32_call(kernel, gate, up, both.stride(0), threads)
        assert code == 0
        assert torch.equal(out.view(torch.int32), _eager(gate, up).view(torch.int32))
    assert _fp32_call(kernel, gate[:, :-8], up[:, :-8], both.stride(0))[0] == 1


def test_an_fp32_loop_whose_exp_rounds_otherwise_is_not_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop takes the exp it is given; one that rounds apart from torch's (SLEEF's
    expf8_u10 without FMA) fails the probe against eager, and eager's product is kept."""
    if gated_mlp.fp32_kernel() is None:
        pytest.skip("no fp32 SiLU loop here")
    monkeypatch.setattr(gated_mlp, "_TORCH_EXP", "Sleef_expf8_u10avx")
    gated_mlp.fp32_kernel.cache_clear()
    try:
        assert gated_mlp.fp32_kernel() is None
    finally:
        monkeypatch.undo()
        gated_mlp.fp32_kernel.cache_clear()
    assert gated_mlp.fp32_kernel() is not None  # (its exp set back to torch's)
