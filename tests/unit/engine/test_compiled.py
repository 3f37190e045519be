"""The compiled RMSNorm (engine/compiled.py): the same math as transformers' norms, switched only
where it agrees, the model's training and sampling unchanged to rounding, eager on failure."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import (  # noqa: E402
    TINY,
    adapter_spec,
    assert_near,
    example,
    grads,
    ok,
    seq,
    work,
)
from tuneloop.server.engine import compiled, native  # noqa: E402
from tuneloop.server.engine.torch_backend import TorchBackend  # noqa: E402
from tuneloop.server.engine.types import SampleWork  # noqa: E402


def _norm_classes() -> list[type]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return [LlamaRMSNorm, Qwen3RMSNorm]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_function_is_transformers_rms_norm_bit_for_bit(dtype: str) -> None:
    for cls in _norm_classes():
        norm = cls(48, eps=1e-5).to(getattr(torch, dtype))
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(2, 7, 48).to(norm.weight.dtype)
        with torch.no_grad():
            assert torch.equal(compiled.rms_norm(x, norm.weight, 1e-5), norm(x))


def test_compiled_norm_matches_eager_forward_and_backward() -> None:
    """The compiled kernels against the eager module: values and input gradients, fp32 to
    rounding, bf16 to one unit in its last place; 2-D, 3-D and a per-head 4-D input."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for shape in ((5, 48), (1, 9, 48), (1, 9, 3, 48)):
            eager = Qwen3RMSNorm(48, eps=1e-6).to(dtype)
            with torch.no_grad():
                eager.weight.uniform_(0.5, 1.5)
            fused = Qwen3RMSNorm(48, eps=1e-6).to(dtype)
            fused.load_state_dict(eager.state_dict())
            assert compiled.install(fused) == 1
            x = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype)
            x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            y1, y2 = eager(x1), fused(x2)
            assert y2.shape == y1.shape
            assert y2.dtype == y1.dtype
            tol = atol  # bf16: one unit in the last place of the largest value
            if dtype == torch.bfloat16:
                tol = max(atol, float(y1.detach().abs().max()) * 2**-7)
            assert_near(y2.float(), y1.float(), tol, f"{dtype} {shape} values")
            g = torch.randn(shape).to(dtype)
            y1.backward(g)
            y2.backward(g)
            assert_near(x2.grad.float(), x1.grad.float(), 4 * atol, f"{dtype} {shape} grads")


def test_install_compiles_the_training_graphs_of_other_thread_counts(two_threads: None) -> None:
    """dynamo guards on the calling thread's thread count: `install` compiles the training
    graphs at the counts training's parts run at (training.py), so a part's first pass
    compiles nothing, while a count not asked for sets out to."""
    import threading

    from torch._dynamo.utils import counters

    norm = _norm_classes()[1](40, eps=3e-6)  # a kind of its own: compiled here first
    assert compiled.install(norm, training_threads=(1,)) == 1

    def compiles(threads: int) -> int:
        made: list[int] = []

        def run() -> None:
            torch.set_num_threads(threads)
            before = counters["frames"]["total"]  # frames dynamo set out to compile
            x = torch.randn(7, 40, requires_grad=True)
            norm(x).sum().backward()
            made.append(counters["frames"]["total"] - before)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return made[0]

    assert compiles(1) == 0
    assert compiles(3) > 0


def test_a_norm_that_computes_something_else_keeps_its_forward() -> None:
    """Gemma's norm scales by 1 + weight: the probe disagrees, so it is not switched."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    model = torch.nn.Sequential(GemmaRMSNorm(32), _norm_classes()[0](32))
    assert compiled.install(model) == 1
    assert "forward" not in vars(model[0])
    assert "forward" in vars(model[1])
    assert compiled.uninstall(model) == 1
    assert "forward" not in vars(model[1])


def test_a_compile_failure_leaves_the_model_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled, "_compiled_norm", broken)
    norm = _norm_classes()[0](32)
    assert compiled.install(norm) == 0
    assert "forward" not in vars(norm)


class _AsIfCuda(torch.Tensor):
    """A CPU tensor that reports itself on CUDA: the norm's device switch, without a GPU."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_one_thread_at_a_time_calls_the_compiled_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """dynamo's frame evaluation is not safe for two threads at once (a guard failing on one
    that passes on a second look made graphs past the limit): training's two parts' norms
    enter the compiled function one at a time, and each gets its own result."""
    import threading
    import time

    monkeypatch.setattr(compiled, "_NATIVE_TRAINING", False)  # (else the C++ loops run it)
    norm = _norm_classes()[0](32)
    assert compiled.install(norm) == 1
    inside: list[int] = []
    most = [0]

    def slow(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        inside.append(1)
        most[0] = max(most[0], len(inside))
        time.sleep(0.01)  # long enough for the other thread to arrive
        inside.pop()
        return compiled.rms_norm(x, weight, eps)

    monkeypatch.setattr(compiled, "_compiled_norm", lambda: slow)
    inputs = [torch.randn(3, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    results: dict[int, torch.Tensor] = {}
    start = threading.Barrier(2)

    def call(i: int) -> None:
        start.wait()
        for _ in range(5):
            with torch.no_grad():
                results[i] = norm(inputs[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1
    for i in range(2):
        with torch.no_grad():
            assert torch.equal(results[i], compiled.rms_norm(inputs[i], norm.weight, 1e-6))


def test_on_cuda_the_compiled_norm_runs_inside_graph_captures_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Op by op, a compiled call costs the host more than the kernels it saves on a GPU: there
    the norm keeps its own forward outside `graph_capture()` and runs the compiled kernel
    inside it; on a CPU it runs the C++ loops where they are built, else the compiled kernel."""
    norm = _norm_classes()[0](32)
    assert compiled.install(norm) == 1
    calls: list[str] = []

    def counted(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        calls.append(type(x).__name__)
        return compiled.rms_norm(x, weight, eps)

    monkeypatch.setattr(compiled, "_compiled_norm", lambda: counted)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        expected = compiled.rms_norm(x, norm.weight, norm.variance_epsilon)
        cuda = x.as_subclass(_AsIfCuda)
        assert torch.equal(norm(cuda), expected)
        assert calls == []  # the module's own forward
        with compiled.graph_capture():
            assert torch.equal(norm(cuda), expected)
        assert calls == ["_AsIfCuda"]
        on_cpu = norm(x)  # a CPU tensor: the C++ loops outside captures too (or compiled)
        torch.testing.assert_close(on_cpu, expected, atol=0.0, rtol=8 * 2.0**-24)
        if compiled.training_kernels(torch.float32) is not None:
            assert calls == ["_AsIfCuda"]
        else:
            assert calls == ["_AsIfCuda", "Tensor"]


def test_the_default_compiles_wide_models_on_a_cpu_or_a_gpu() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    def model(hidden: int) -> torch.nn.Module:
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=hidden,
            intermediate_size=hidden,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
        return LlamaForCausalLM(config)

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not compiled.wanted(model(64), cpu)  # the tiny test models: nothing to gain
    wide = model(compiled.MIN_HIDDEN)
    assert compiled.wanted(wide, cpu)
    assert compiled.wanted(wide, cuda)  # Triton kernels inside the decode graphs


def test_a_backend_with_compiled_kernels_trains_and_samples_as_the_eager_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tiny Qwen3 (fp32) with every norm compiled (hidden, final, per-head q/k) and the
    compiled decode attention: the same logprobs, loss and LoRA gradients as the eager backend
    to fp32 rounding, and the same sampled tokens and their logprobs. Its two norm widths take
    twelve graphs: none falls back to eager past dynamo's limit of graphs per function."""
    caplog.set_level(logging.WARNING, logger="torch._dynamo")
    torch._dynamo.reset()  # the graphs earlier tests compiled outside `install` count too
    backends = {
        flag: TorchBackend([TINY], cache_dir=tmp_path / "cache", device="cpu", compile_norms=flag)
        for flag in (False, True)
    }
    model = next(iter(backends[True].resident_models().values()))
    assert [r.compiled_decode for r in backends[True]._runtimes.values()] == [True]
    assert [r.compiled_decode for r in backends[False]._runtimes.values()] == [False]
    layers = model.config.num_hidden_layers
    switched = sum("forward" in vars(m) for m in model.modules())
    assert switched == 4 * layers + 1  # two norms and q/k norms per layer, and the final norm
    data = [example(seq(12, 1)), example(seq(7, 2))]
    out = {}
    for flag, be in backends.items():
        be.create_adapter(adapter_spec("A", seed=3))
        [r] = be.forward_backward([work("A", data)])
        be.create_sampler("s", TINY, adapter_id="A")
        prompt = seq(6, 9)
        [s] = be.sample([SampleWork("s", prompt, 2, 8, 1.0, -1, 1.0, 5, (), ())])
        out[flag] = (ok(r), grads(be, "A"), ok(s))
    (eager, eager_grads, eager_sample), (fused, fused_grads, fused_sample) = out[False], out[True]
    assert fused.metrics["loss:sum"] == pytest.approx(eager.metrics["loss:sum"], rel=1e-5)
    for a, b in zip(fused.logprobs, eager.logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(fused_grads, eager_grads, strict=True):
        assert_near(a, b, 1e-4, "LoRA gradient", relative=True)
    assert [q.tokens for q in fused_sample.sequences] == [q.tokens for q in eager_sample.sequences]
    for a, b in zip(fused_sample.sequences, eager_sample.sequences, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    for be in backends.values():
        be.close()
    limits = [r.getMessage() for r in caplog.records if "limit" in r.getMessage()]
    assert not limits


NATIVE = compiled.native_norm() is not None


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler here")
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (128, 576), (7, 64), (300, 1536)])
def test_the_native_norm_is_the_functions_arithmetic(rows: int, width: int) -> None:
    """A sampling step's C++ norm against `rms_norm` eager (bf16): the same bits but where the
    order of the fp32 sum of squares flips a rounding, and then by one bf16 step."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=gen) * 3).bfloat16()
    weight = torch.randn(width, generator=gen).bfloat16()
    with torch.no_grad():
        native = compiled._native_rms_norm(x, weight, 1e-5)
        eager = compiled.rms_norm(x, weight, 1e-5)
    assert native is not None
    _assert_native_agrees(native, eager)


def _assert_native_agrees(native: torch.Tensor, eager: torch.Tensor) -> None:
    """The C++ norm's stated agreement with `rms_norm` eager: the same bits but where the order of
    the fp32 sum of squares flips a rounding, and there by one bf16 step at most."""
    differ = native != eager
    assert differ.float().mean().item() < 1e-3
    step = eager.float().abs() * 2.0**-7  # one bf16 step at the value's scale, at most
    assert ((native.float() - eager.float()).abs() <= step)[differ].all()


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler here")
def test_the_native_norm_runs_in_sampling_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed norms take the C++ loop inside native.py's `sampling_step` for bf16 and fp32
    CPU inputs without autograd even where the loops of other passes are switched off
    (`_NATIVE_TRAINING`); outside a step and for an input that requires grad they then keep
    the compiled kernel."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.setattr(compiled, "_NATIVE_TRAINING", False)

    calls: list[torch.dtype] = []
    real_norm = compiled.native_norm

    def counting(dtype: torch.dtype = torch.bfloat16) -> Any:
        real = real_norm(dtype)

        def call(*args: object) -> None:
            calls.append(dtype)
            real(*args)

        return call

    monkeypatch.setattr(compiled, "native_norm", counting)
    norms = {}
    for dtype in (torch.bfloat16, torch.float32):
        norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
        assert compiled.install(norm) == 1
        norms[dtype] = norm
    x = torch.randn(1, 5, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.no_grad():
        outside = norms[torch.bfloat16](x)
        assert not calls
        with native.sampling_step():
            inside = norms[torch.bfloat16](x)
            assert calls == [torch.bfloat16]
            inside_fp32 = norms[torch.float32](x.float())
            assert calls == [torch.bfloat16, torch.float32]
    with native.sampling_step():
        trained = norms[torch.bfloat16](x.clone().requires_grad_(True))
    assert trained.requires_grad
    assert len(calls) == 2
    # The sum of squares' order may differ from the compiled kernel's (the host's vector width
    # decides it), so a rounding may flip: the native norm's stated agreement, not equality.
    with torch.no_grad():
        _assert_native_agrees(inside, compiled.rms_norm(x, norms[torch.bfloat16].weight, 1e-5))
    torch.testing.assert_close(inside, outside, atol=0.0, rtol=2.0**-7)
    with torch.no_grad():
        eager_fp32 = compiled.rms_norm(x.float(), norms[torch.float32].weight, 1e-5)
    torch.testing.assert_close(inside_fp32, eager_fp32, atol=0.0, rtol=8 * 2.0**-24)


@pytest.mark.skipif(compiled.native_norm(torch.float32) is None, reason="no C++ compiler here")
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (128, 576), (7, 64), (300, 1536)])
def test_the_native_fp32_norm_is_the_functions_arithmetic(rows: int, width: int) -> None:
    """The fp32 C++ norm against `rms_norm` eager: the products rounded as eager's, so only the
    order of the sum of squares differs (a row's factor 1/sqrt then a step apart, and with it
    most of the row's values): within eight fp32 steps at the value's scale."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=gen) * 3
    weight = torch.randn(width, generator=gen)
    with torch.no_grad():
        native = compiled._native_rms_norm(x, weight, 1e-5)
        eager = compiled.rms_norm(x, weight, 1e-5)
    assert native is not None
    torch.testing.assert_close(native, eager, atol=0.0, rtol=8 * 2.0**-24)


NATIVE_TRAINING = {
    dtype: compiled.training_kernels(dtype) is not None for dtype in compiled._TRAINING_NAMES
}


def _assert_training_grads_agree(native: torch.Tensor, eager: torch.Tensor) -> None:
    """The C++ backward's stated agreement with eager autograd through `rms_norm`: the same
    chain of roundings, only the row's fp32 sum of d hb * h in another order; bf16: the same
    bits but for rare flipped roundings, each within a bf16 step of the largest gradient;
    fp32: within a millionth of the largest."""
    scale = float(eager.float().abs().max())
    diff = (native.float() - eager.float()).abs()
    if native.dtype == torch.bfloat16:
        assert (native != eager).float().mean().item() < 1e-3
        assert float(diff.max()) <= scale * 2.0**-7
    else:
        assert float(diff.max()) <= scale * 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 720, 576), (7, 64), (300, 1536), (1, 1, 576), (1, 9, 3, 64)])
def test_the_training_norm_node_is_eager_autograd_to_rounding(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """A training pass's norm by the C++ loops as one autograd node (`_NativeNorm`): values as
    the sampling steps' loop gives them, the input's gradient as eager autograd's through
    `rms_norm` (`_assert_training_grads_agree`); 2-D, 3-D and a per-head 4-D input (Qwen3's q/k
    norms), a gradient arriving non-contiguous."""
    if not NATIVE_TRAINING[dtype]:
        pytest.skip("no C++ compiler here")
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    g = torch.randn((*shape[:-1], 2 * shape[-1]), generator=gen).to(dtype)[..., ::2]
    x_eager, x_native = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    eager = compiled.rms_norm(x_eager, weight, 1e-5)
    native = compiled._native_trained(x_native, weight, 1e-5)
    assert native is not None
    assert native.shape == eager.shape
    assert native.dtype == eager.dtype
    nodes = [type(native.grad_fn).__name__] + [
        type(n).__name__ for n, _ in native.grad_fn.next_functions if n is not None
    ]
    assert "_NativeNormBackward" in nodes
    if dtype == torch.bfloat16:
        _assert_native_agrees(native.detach(), eager.detach())
    else:
        torch.testing.assert_close(native, eager, atol=0.0, rtol=8 * 2.0**-24)
    eager.backward(g)
    native.backward(g)
    _assert_training_grads_agree(x_native.grad, x_eager.grad)


@pytest.mark.skipif(not NATIVE_TRAINING[torch.bfloat16], reason="no C++ compiler here")
def test_installed_norms_train_through_the_loops_unless_the_weight_trains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An installed norm on a CPU: an input autograd records takes the C++ node, an input
    without grad the forward loop alone (no node: nothing to record); a weight that takes a
    gradient (the loops make none) or the loops switched off take the compiled kernel."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(576, eps=1e-5).to(torch.bfloat16).requires_grad_(False)
    trainable = LlamaRMSNorm(576, eps=1e-5).to(torch.bfloat16)
    off = LlamaRMSNorm(576, eps=1e-5).to(torch.bfloat16).requires_grad_(False)
    # (each installed as it will run, so that its compiled graphs, where it takes them, are
    # made here: dynamo guards on whether the weight takes a gradient)
    assert compiled.install(norm) == 1
    assert compiled.install(trainable) == 1
    with monkeypatch.context() as switch:
        switch.setattr(compiled, "_NATIVE_TRAINING", False)
        assert compiled.install(off) == 1
    compiled_calls: list[bool] = []
    real = compiled._compiled_norm()

    def counted(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        compiled_calls.append(weight.requires_grad)
        return real(x, weight, eps)

    monkeypatch.setattr(compiled, "_compiled_norm", lambda: counted)
    x = torch.randn(1, 6, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    trained = norm(x.clone().requires_grad_(True))
    assert trained.grad_fn is not None
    assert "_NativeNormBackward" in [type(n).__name__ for n, _ in trained.grad_fn.next_functions]
    first_layer = norm(x)  # grad mode on, nothing to record (a first layer's input)
    assert first_layer.grad_fn is None
    assert torch.equal(first_layer, trained.detach())
    assert compiled_calls == []
    with monkeypatch.context() as switch:
        switch.setattr(compiled, "_NATIVE_TRAINING", False)
        off(x.clone().requires_grad_(True))
    assert compiled_calls == [False]
    weighted = trainable(x.clone().requires_grad_(True))
    assert compiled_calls == [False, True]
    weighted.sum().backward()
    assert trainable.weight.grad is not None


@pytest.mark.skipif(not NATIVE_TRAINING[torch.bfloat16], reason="no C++ compiler here")
def test_install_compiles_nothing_for_norms_the_loops_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen norm on a CPU at bf16 runs the C++ loops in every pass, so `install` switches it
    without compiling (seconds of a model's load); one whose weight trains, or any with the
    loops switched off, gets its graphs at install."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    made: list[int] = []
    real = compiled._compiled_norm

    def counted() -> Any:
        made.append(1)
        return real()

    monkeypatch.setattr(compiled, "_compiled_norm", counted)
    frozen = LlamaRMSNorm(576, eps=1e-5).to(torch.bfloat16).requires_grad_(False)
    assert compiled.install(frozen) == 1
    assert made == []
    assert compiled.switched(frozen)
    assert compiled.install(LlamaRMSNorm(576, eps=1e-5).to(torch.bfloat16)) == 1
    assert made
    made.clear()
    monkeypatch.setattr(compiled, "_NATIVE_TRAINING", False)
    assert compiled.install(LlamaRMSNorm(576, eps=1e-5).to(torch.bfloat16).requires_grad_(False))
    assert made


class _Subclass(torch.Tensor):
    """A tensor subclass (as a sharded DTensor is): the loops read no such tensor's pointer."""


@pytest.mark.skipif(not NATIVE_TRAINING[torch.bfloat16], reason="no C++ compiler here")
def test_the_loops_leave_tensor_subclasses_to_the_compiled_kernel() -> None:
    x = torch.randn(3, 64).bfloat16().requires_grad_(True)
    weight = torch.randn(64).bfloat16()
    assert compiled._native_trained(x, weight, 1e-5) is not None
    assert compiled._native_trained(x, weight.as_subclass(_Subclass), 1e-5) is None
    assert compiled._native_trained(x.as_subclass(_Subclass), weight, 1e-5) is None
    norm = _norm_classes()[0](64).to(torch.bfloat16).requires_grad_(False)
    assert compiled._loops_take(norm)
    norm.weight = torch.nn.Parameter(norm.weight.detach().as_subclass(_Subclass), False)
    assert not compiled._loops_take(norm)
