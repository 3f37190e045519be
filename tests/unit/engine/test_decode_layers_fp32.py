"""An fp32 model's sampling steps through the lean loop (decode_layers.py): the kernels' fp32 forms
(norm, rotary embedding, KV writes, decode attention, the fp32 linear kernel or oneDNN's packed
weights) and eager's SiLU product, the same bits as the modules' forward, on every x86-64 CPU
with AVX2 and FMA; on the fp32 kernel's layout the layers as one C++ call (native_layers.py,
decode_layers_fp32.cpp), the same bits again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.unit.engine import test_decode_layers as bf16_tests  # noqa: E402
from tests.unit.engine.conftest import seq  # noqa: E402
from tuneloop.server.engine import (  # noqa: E402
    compiled,
    decode_layers,
    gated_mlp,
    native_layers,
    native_linear,
    rotary,
)
from tuneloop.server.engine.kv import native_decode  # noqa: E402
from tuneloop.server.engine.native_linear import NativeWeight  # noqa: E402
from tuneloop.server.engine.types import SampleWork  # noqa: E402

CPU = torch.device("cpu")
BUILT = (
    native_decode.available(4, 2, 32, 32, torch.float32, CPU)
    and compiled.native_norm(torch.float32) is not None
    and rotary.native_kernel(torch.float32) is not None
)
pytestmark = pytest.mark.skipif(not BUILT, reason="needs the fp32 kernels (AVX2 and FMA)")
LLAMA = bf16_tests.LLAMA
lean_runs = bf16_tests.lean_runs  # (the fixture: steps the lean loop ran to their end)
native_calls = bf16_tests.native_calls  # (the fixture: steps the layers' C++ call ran)


@pytest.fixture(params=["fp32 kernel", "oneDNN"])
def linear_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The lone copy's weights in the fp32 kernel's layout or packed for oneDNN
    (`TUNELOOP_NATIVE_LINEAR=0`)."""
    if request.param == "oneDNN":
        monkeypatch.setenv("TUNELOOP_NATIVE_LINEAR", "0")
    elif native_linear.fp32_kernel() is None:
        pytest.skip("the fp32 linear kernel is not built here")
    return str(request.param)


def _backend(name: str, cache: Path, **kw: Any) -> Any:
    return bf16_tests._backend(name, cache, dtype=torch.float32, **kw)


def _warm(be: Any, works: list[SampleWork]) -> None:
    """Sample `works` once, so that the compared runs both find their prompts' blocks in the
    prefix cache: at fp32 a prompt's prefill over cached blocks rounds apart from the whole
    prompt's (the modules' own outputs differ between a first and a second call)."""
    bf16_tests._outputs(be, works)


def _same_as_modules(be: Any, works: list[SampleWork], lean_runs: list[int], steps: int) -> None:
    """`works` (sampled once already: `_warm`) through the lean loop, at least `steps` of its
    steps, then through the modules: the same tokens and logprobs."""
    before = lean_runs[0]
    lean = bf16_tests._outputs(be, works)
    assert lean_runs[0] - before >= steps
    assert lean == bf16_tests._modules_outputs(be, works, lean_runs)


def _lone_groups(be: Any, key: str | None, merge: bool) -> list[Any]:
    runtime = bf16_tests._runtime(be)
    weights = runtime.layers_plan.weights(runtime.bank.lone_weights(key, merge=merge))
    assert weights is not None
    return weights


@pytest.mark.parametrize(
    ("family", "prompts", "samples"),
    [("llama", 6, 4), ("qwen2", 6, 4), ("qwen3", 6, 4), ("llama", 1, 1), ("qwen3", 1, 1)],
)
def test_fp32_decode_steps_give_the_modules_bits(
    family: str,
    prompts: int,
    samples: int,
    linear_kernel: str,
    tmp_path: Path,
    lean_runs: list[int],
) -> None:
    """A trained adapter's snapshot (merged: an fp32 lone copy's default): every decode step
    runs the loop, and every token and logprob equals the modules' own (Qwen2's biases,
    Qwen3's per-head q/k norms included), on either linear kernel."""
    name = bf16_tests._model(family, tmp_path / family)
    be = _backend(name, tmp_path / "cache")
    try:
        runtime = bf16_tests._runtime(be)
        plan = runtime.layers_plan
        assert plan is not None
        assert plan.dtype == torch.float32
        layer = runtime.model.get_decoder().layers[0]
        assert compiled.switched(layer.input_layernorm)
        assert not gated_mlp.switched(layer.mlp)
        assert gated_mlp.eager_silu(layer.mlp)
        bf16_tests._trained_sampler(be, name)
        works = bf16_tests._works(prompts, samples, 12)
        _warm(be, works)
        groups = _lone_groups(be, "s", merge=True)
        assert all(w.qkv.a is None for w in groups)  # merged: no LoRA columns
        native = isinstance(groups[0].qkv.weight, NativeWeight)
        assert native == (linear_kernel == "fp32 kernel")
        # the layers as one C++ call on the fp32 kernel's layout, the Python loop on oneDNN's
        taken = native_layers.loop(plan, groups) is not None
        assert taken == (native and native_layers.enabled(torch.float32))
        _same_as_modules(be, works, lean_runs, 8)  # (12 tokens: 11 decode steps, or fewer)
    finally:
        be.close()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_fp32_native_loop_gives_the_python_loops_bits(
    family: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    lean_runs: list[int],
    native_calls: list[int],
) -> None:
    """fp32 decode steps on a merged lone copy in the fp32 kernel's layout run the layers as
    one C++ call; with TUNELOOP_NATIVE_LAYERS=0 the Python loop makes the same kernel calls
    and eager's SiLU product: the same tokens and logprobs, bit for bit (Qwen2's biases,
    Qwen3's per-head norms)."""
    if native_linear.fp32_kernel() is None or not native_layers.enabled(torch.float32):
        pytest.skip("the fp32 layer loop is not built here")
    name = bf16_tests._model(family, tmp_path / family)
    be = _backend(name, tmp_path / "cache")
    try:
        bf16_tests._trained_sampler(be, name)
        works = bf16_tests._works(6, 4, 12)
        _warm(be, works)
        bf16_tests.native_against_python(
            be, works, torch.float32, monkeypatch, lean_runs, native_calls
        )
    finally:
        be.close()


def test_fp32_unmerged_columns_give_the_modules_bits(tmp_path: Path, lean_runs: list[int]) -> None:
    """An fp32 lone copy asked to fuse and not to merge keeps its adapter's down-projections
    in extra columns (oneDNN's products, fused.py): the loop makes the same calls."""
    be = _backend(LLAMA, tmp_path / "cache", merge_lone_adapter=False, fuse_lone_key=True)
    try:
        bf16_tests._trained_sampler(be, LLAMA)
        works = bf16_tests._works(6, 4, 8)
        _warm(be, works)
        groups = _lone_groups(be, "s", merge=False)
        assert all(isinstance(w.qkv.a, torch.Tensor) for w in groups)
        _same_as_modules(be, works, lean_runs, 4)
    finally:
        be.close()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp32_steps_of_several_keys_give_the_modules_bits(
    family: str, linear_kernel: str, tmp_path: Path, lean_runs: list[int]
) -> None:
    """Two trained snapshots and the base model's sampler in one batch at fp32: the shared
    base weights with each key's delta added to its rows, the modules' bits."""
    name = bf16_tests._model(family, tmp_path / family)
    be = _backend(name, tmp_path / "cache")
    try:
        bf16_tests._trained_sampler(be, name)
        bf16_tests._second_sampler(be, name)
        be.create_sampler("base", name)
        works = [
            *bf16_tests._works(3, 4, 10),
            SampleWork("t", seq(9, 3), 4, 10, 1.0, -1, 1.0, 1, (), ()),
            SampleWork("base", seq(5, 8), 2, 10, 1.0, -1, 1.0, 2, (), ()),
        ]
        _warm(be, works)
        _same_as_modules(be, works, lean_runs, 8)
    finally:
        be.close()


def test_fp32_steps_with_prompt_chunks_give_the_modules_bits(
    tmp_path: Path, lean_runs: list[int]
) -> None:
    """Requests joining while others decode (a small KV pool, prompts in chunks of 4): steps
    with prompt chunks call the modules' attention function from the loop, the modules'
    bits."""
    be = _backend(LLAMA, tmp_path / "cache", sample_token_budget=320, prefill_chunk=4)
    try:
        bf16_tests._trained_sampler(be, LLAMA)
        works = [
            SampleWork("s", seq(7 + 3 * i, 40 + i), 4, 4 + 3 * i, 1.0, -1, 1.0, 11, (), ())
            for i in range(6)
        ]
        _warm(be, works)
        _same_as_modules(be, works, lean_runs, 8)
    finally:
        be.close()


def test_an_fp32_plan_needs_its_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No plan where an fp32 kernel is missing (the norm's here) or the MLP's forward is not
    the eager product's (a switched or replaced forward)."""
    be = _backend(LLAMA, tmp_path / "cache")
    try:
        model = bf16_tests._runtime(be).model
        assert decode_layers.plan(model) is not None
        norm = compiled.native_norm
        monkeypatch.setattr(compiled, "native_norm", lambda dtype=torch.bfloat16: None)
        assert decode_layers.plan(model) is None
        monkeypatch.setattr(compiled, "native_norm", norm)
        mlp = model.get_decoder().layers[1].mlp
        mlp.forward = lambda x: x
        assert not gated_mlp.eager_silu(mlp)
        assert decode_layers.plan(model) is None
    finally:
        be.close()
