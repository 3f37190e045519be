"""A CPU sampling step's decoder layers as one lean loop (decode_layers.py), and as one C++ call
(native_layers.py) for steps of decode rows alone: the same bits as the modules' forward, taken
only where every piece is the native one, the modules elsewhere."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.unit.engine.conftest import adam, example, ok, seq, work  # noqa: E402
from tests.zoo import archs  # noqa: E402
from tuneloop.server.engine import compiled, decode_layers, gated_mlp, native_layers  # noqa: E402
from tuneloop.server.engine.kv import native_decode  # noqa: E402
from tuneloop.server.engine.lora import native_columns  # noqa: E402
from tuneloop.server.engine.types import AdapterSpec, SampleWork  # noqa: E402

CPU = torch.device("cpu")
BUILT = native_decode.available(4, 2, 32, 32, torch.bfloat16, CPU) and native_columns.available(
    torch.bfloat16, CPU
)
pytestmark = pytest.mark.skipif(not BUILT, reason="needs the AVX512-BF16 kernels")
LLAMA = "tuneloop/tiny-llama"


def _saved(family: str, folder: Path) -> str:
    """The zoo's tiny Qwen2 (its q/k/v projections' biases made non-zero) or Mistral, wide
    enough for the native kernels (head size 32), saved with the byte-level tokenizer."""
    model = archs.build(family, hidden_size=128, intermediate_size=384, head_dim=32)
    if family == "qwen2":
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(1)
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5)  # (zeros at init: the bias path would prove nothing)
    model.save_pretrained(folder)
    archs.copy_tokenizer(folder)
    return str(folder)


def _backend(name: str, cache: Path, **kw: Any) -> Any:
    from tuneloop.server.engine.torch_backend import TorchBackend

    options: dict[str, Any] = {"dtype": torch.bfloat16, "compile_norms": True, **kw}
    return TorchBackend([name], cache_dir=cache, device="cpu", **options)


def _runtime(be: Any) -> Any:
    [runtime] = be._runtimes.values()
    return runtime


def _trained_sampler(be: Any, name: str) -> None:
    """Sampler "s": a snapshot of an adapter on every linear layer trained a few steps (its
    LoRA columns then carry a delta the tokens depend on)."""
    be.create_adapter(AdapterSpec("A", name, rank=8, seed=3))
    data = [example(seq(24, s)) for s in range(3)]
    for _ in range(3):
        ok(be.forward_backward([work("A", data)])[0])
        be.optim_step("A", adam(5e-2))
    be.create_sampler("s", name, adapter_id="A")


def _works(prompts: int, samples: int, tokens: int) -> list[SampleWork]:
    return [
        SampleWork("s", seq(7 + 3 * i, 40 + i), samples, tokens, 1.0, -1, 1.0, 11 + i, (), ())
        for i in range(prompts)
    ]


def _outputs(be: Any, works: list[SampleWork]) -> list[tuple[list[int], list[float]]]:
    out = []
    for result in be.sample(works):
        out += [(list(s.tokens), list(s.logprobs)) for s in ok(result).sequences]
    return out


def _modules_outputs(be: Any, works: list[SampleWork], lean_runs: list[int]) -> Any:
    """`works` sampled again with the plan dropped: the modules' forward, no lean step."""
    runtime = _runtime(be)
    runtime.layers_plan = None
    runtime.decoder.runner.layers = None
    before = lean_runs[0]
    out = _outputs(be, works)
    assert lean_runs[0] == before
    return out


@pytest.fixture
def lean_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps the lean loop ran to their end (a step that raised runs again in
    halves, decoder.py, and those could take the modules)."""
    calls = [0]
    original = decode_layers.run

    def counting(*args: Any) -> Any:
        out = original(*args)
        calls[0] += 1
        return out

    monkeypatch.setattr(decode_layers, "run", counting)
    return calls


@pytest.fixture
def native_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps whose layers ran as one C++ call (native_layers.Loop.run)."""
    calls = [0]
    original = native_layers.Loop.run

    def counting(self: Any, *args: Any) -> Any:
        calls[0] += 1
        return original(self, *args)

    monkeypatch.setattr(native_layers.Loop, "run", counting)
    return calls


def native_against_python(
    be: Any,
    works: list[SampleWork],
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
    lean_runs: list[int],
    native_calls: list[int],
) -> None:
    """`works` with the layers as one C++ call in at least 8 steps, then with
    TUNELOOP_NATIVE_LAYERS=0 through the Python loop alone: the same tokens and logprobs."""
    before = native_calls[0]
    native = _outputs(be, works)
    assert native_calls[0] - before >= 8  # (11 decode steps, fewer if rows stop early)
    assert native_layers.enabled(dtype)
    monkeypatch.setenv("TUNELOOP_NATIVE_LAYERS", "0")
    assert not native_layers.enabled(dtype)
    before, lean_before = native_calls[0], lean_runs[0]
    python = _outputs(be, works)
    assert native_calls[0] == before
    assert lean_runs[0] >= lean_before + 8
    assert native == python


def _model(family: str, folder: Path) -> str:
    if family in ("qwen2", "mistral"):
        folder.mkdir()
        return _saved(family, folder)
    return {"llama": LLAMA, "qwen3": "tuneloop/tiny-qwen3"}[family]


@pytest.mark.parametrize(
    ("family", "prompts", "samples"),
    [("llama", 6, 4), ("qwen2", 6, 4), ("qwen3", 6, 4), ("llama", 2, 2), ("qwen3", 1, 1)],
)
def test_decode_steps_give_the_modules_bits(
    family: str, prompts: int, samples: int, tmp_path: Path, lean_runs: list[int]
) -> None:
    """A trained adapter's snapshot: every decode step runs the loop, and every token and
    logprob equals the modules' own (Qwen3's per-head q/k norms included); 24 rows take the
    native SiLU product, 4 rows and 1 row eager's two operations, as the modules do below
    gated_mlp.MIN_ELEMENTS."""
    name = _model(family, tmp_path / family)
    be = _backend(name, tmp_path / "cache")
    try:
        runtime = _runtime(be)
        assert runtime.layers_plan is not None
        layer = runtime.model.get_decoder().layers[0]
        assert compiled.switched(layer.input_layernorm)
        assert gated_mlp.switched(layer.mlp)
        _trained_sampler(be, name)
        works = _works(prompts, samples, 12)
        lean = _outputs(be, works)
        weights = runtime.layers_plan.weights(runtime.bank.lone_weights("s"))
        assert all(isinstance(w.qkv.a, native_columns.DownPairs) for w in weights)
        assert lean_runs[0] >= 8  # (12 tokens: 11 decode steps, fewer if rows stop early)
        assert lean == _modules_outputs(be, works, lean_runs)
    finally:
        be.close()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_native_loop_gives_the_python_loops_bits(
    family: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    lean_runs: list[int],
    native_calls: list[int],
) -> None:
    """Decode steps on one key's weights in the native linear's layout run the layers as one
    C++ call; with TUNELOOP_NATIVE_LAYERS=0 the Python loop makes the same kernel calls: the
    same tokens and logprobs, bit for bit (Qwen2's biases, Qwen3's per-head norms)."""
    calls = native_calls
    name = _model(family, tmp_path / family)
    be = _backend(name, tmp_path / "cache")
    try:
        _trained_sampler(be, name)
        native_against_python(be, _works(6, 4, 12), torch.bfloat16, monkeypatch, lean_runs, calls)
    finally:
        be.close()


def test_the_plans_loop_keeps_no_deleted_samplers_copy(tmp_path: Path) -> None:
    """The plan keeps its last native loop, which points into a sampler's fused copy, and the
    runner its last routing, which holds the copy: neither keeps it alive once the sampler
    is deleted (the bank holds one copy of a key's weights at a time, and frees the last
    before making the next)."""
    be = _backend(LLAMA, tmp_path / "cache")
    try:
        runtime = _runtime(be)
        _trained_sampler(be, LLAMA)
        _outputs(be, _works(6, 4, 4))
        plan = runtime.layers_plan
        weights = plan.weights(runtime.bank.lone_weights("s"))
        assert plan.native_loop is not None
        assert plan.native_loop.matches(weights)
        group = weakref.ref(weights[0].qkv)
        del weights
        be.delete_sampler("s")
        gc.collect()
        assert group() is None
        assert plan.native_loop is not None  # (the loop itself stays, matching nothing)
    finally:
        be.close()


@pytest.mark.parametrize("weights", ["merged", "base"])
def test_weights_without_columns_give_the_modules_bits(
    weights: str, tmp_path: Path, lean_runs: list[int]
) -> None:
    """A snapshot on merged weights (`serve --merged-sampling`) and the base model's sampler:
    groups without LoRA columns, the same bits as the modules."""
    merged = weights == "merged"
    be = _backend(LLAMA, tmp_path / "cache", merge_lone_adapter=merged)
    try:
        runtime = _runtime(be)
        if merged:
            _trained_sampler(be, LLAMA)
        else:
            be.create_sampler("s", LLAMA)
        works = _works(6, 4, 8)
        lean = _outputs(be, works)
        table = runtime.bank.lone_weights("s" if merged else None, merge=merged)
        groups = runtime.layers_plan.weights(table)
        assert all(w.qkv.a is None and w.down.a is None for w in groups)
        assert lean_runs[0] >= 4
        runtime.layers_plan = None
        runtime.decoder.runner.layers = None
        assert _outputs(be, works) == lean
    finally:
        be.close()


def test_steps_with_prompt_chunks_give_the_modules_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KV pool that holds about two requests and prompts cut into chunks of 4 tokens:
    requests join while others decode, so steps mix decode rows and prompt chunks; they run
    the loop too (the modules' attention function for their attention), with the modules'
    bits."""
    kinds: list[tuple[bool, bool]] = []  # per lean step: (prompt chunks in it, decode rows)
    original = decode_layers.run

    def recording(plan: Any, weights: Any, ids: Any, positions: Any, step: Any) -> Any:
        out = original(plan, weights, ids, positions, step)
        kinds.append((bool(step.prefills), step.decoding > 0))
        return out

    monkeypatch.setattr(decode_layers, "run", recording)
    be = _backend(LLAMA, tmp_path / "cache", sample_token_budget=320, prefill_chunk=4)
    try:
        runtime = _runtime(be)
        _trained_sampler(be, LLAMA)
        # requests of different lengths: one's rows stop and free blocks while another decodes
        works = [
            SampleWork("s", seq(7 + 3 * i, 40 + i), 4, 4 + 3 * i, 1.0, -1, 1.0, 11, (), ())
            for i in range(6)
        ]
        lean = _outputs(be, works)
        assert (True, True) in kinds  # decode rows and a joining prompt's chunk in one step
        assert (True, False) in kinds  # the first step: prompts alone
        assert (False, True) in kinds
        runtime.layers_plan = None
        runtime.decoder.runner.layers = None
        count = len(kinds)
        modules = _outputs(be, works)
        assert len(kinds) == count
        assert lean == modules
    finally:
        be.close()


def _second_sampler(be: Any, name: str) -> None:
    """Sampler "t": a snapshot of another adapter (rank 4, not on the MLPs) trained a step."""
    be.create_adapter(AdapterSpec("B", name, rank=4, seed=5, train_mlp=False, alpha=8.0))
    ok(be.forward_backward([work("B", [example(seq(20, 7))])])[0])
    be.optim_step("B", adam(5e-2))
    be.create_sampler("t", name, adapter_id="B")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_steps_of_several_keys_give_the_modules_bits(
    family: str, tmp_path: Path, lean_runs: list[int]
) -> None:
    """Two trained snapshots of different ranks and targets and the base model's sampler in
    one batch: every step runs the loop on the shared base weights with each key's delta
    added to its rows (segments.py), with the modules' bits."""
    name = _model(family, tmp_path / family)
    be = _backend(name, tmp_path / "cache")
    try:
        runtime = _runtime(be)
        _trained_sampler(be, name)
        _second_sampler(be, name)
        be.create_sampler("base", name)
        works = [
            *_works(3, 4, 10),
            SampleWork("t", seq(9, 3), 4, 10, 1.0, -1, 1.0, 1, (), ()),
            SampleWork("base", seq(5, 8), 2, 10, 1.0, -1, 1.0, 2, (), ()),
            SampleWork("t", seq(12, 60), 2, 10, 1.0, -1, 1.0, 3, (), ()),
        ]
        lean = _outputs(be, works)
        assert lean_runs[0] >= 8
        deltas = runtime.bank.deltas("t")
        layers = runtime.model.get_decoder().layers
        attention = [deltas.get(id(layer.self_attn.q_proj)) for layer in layers]
        assert all(d is not None and d.vectors is not None for d in attention)  # the kernel's
        assert all(id(layer.mlp.up_proj) not in deltas for layer in layers)  # (no MLP delta)
        assert lean == _modules_outputs(be, works, lean_runs)
    finally:
        be.close()


def test_steps_it_does_not_take_run_the_modules(tmp_path: Path, lean_runs: list[int]) -> None:
    """A backend without the fused or shared weights: the modules."""
    unfused = _backend(LLAMA, tmp_path / "cache2", fuse_lone_key=False)
    try:
        _trained_sampler(unfused, LLAMA)
        unfused.create_sampler("t", LLAMA)
        mixed = [*_works(6, 4, 6), SampleWork("t", seq(9, 3), 2, 6, 1.0, -1, 1.0, 1, (), ())]
        _outputs(unfused, _works(6, 4, 6))
        _outputs(unfused, mixed)
        assert lean_runs[0] == 0
    finally:
        unfused.close()


def test_models_it_does_not_take(tmp_path: Path) -> None:
    """No plan for norms left to their own forward, or for a family whose layers it does not
    make (a Mistral, its attention taking the native kernel alone). (fp32 weights get a plan
    of their own: test_decode_layers_fp32.py.)"""
    eager = _backend(LLAMA, tmp_path / "b", compile_norms=False)
    layer = _runtime(eager).model.get_decoder().layers[0]
    assert not compiled.switched(layer.input_layernorm)
    assert not gated_mlp.switched(layer.mlp)
    assert _runtime(eager).layers_plan is None
    eager.close()
    mistral = _backend(_model("mistral", tmp_path / "mistral"), tmp_path / "c")
    try:
        runtime = _runtime(mistral)
        assert runtime.decode_kernel is native_decode.attend
        assert runtime.layers_plan is None
        assert decode_layers.plan(runtime.model) is None
    finally:
        mistral.close()


def test_a_pool_slot_out_of_range_is_refused(tmp_path: Path) -> None:
    """The kernels read raw memory: a decode row's slot outside the pool raises before any
    layer attends (the attention's own check, made once per step)."""
    be = _backend(LLAMA, tmp_path / "cache")
    try:
        _trained_sampler(be, LLAMA)
        _outputs(be, _works(6, 4, 2))  # the pools exist
        runtime = _runtime(be)
        plan = runtime.layers_plan
        runner = runtime.decoder.runner
        lone = runtime.bank.lone_weights("s")
        weights = plan.weights(lone)
        assert weights is not None
        from tuneloop.server.engine.kv.paged_attention import PagedStep

        pool = runner.pool
        rows, width = 24, 4
        slots = torch.full((rows, width), pool.pad_slot + 5, dtype=torch.long)
        mask = torch.ones((rows, 1, 1, width), dtype=torch.bool)
        step = PagedStep(
            pool, torch.arange(rows), rows, slots, mask, [], None, native_decode.attend
        )
        ids = torch.arange(rows)[None] % 200
        with pytest.raises(ValueError, match="outside the pool"):
            decode_layers.run(plan, weights, ids, torch.full((1, rows), 3), step)
        # a new key's slot past the pool: the KV write refuses it inside the native loop
        past = torch.full((rows,), pool.scratch_slot + 7)
        slots = torch.full((rows, width), pool.pad_slot, dtype=torch.long)
        step = PagedStep(pool, past, rows, slots, mask, [], None, native_decode.attend)
        assert native_layers.loop(plan, weights) is not None
        with pytest.raises(ValueError, match="KV write refused"):
            decode_layers.run(plan, weights, ids, torch.full((1, rows), 3), step)
    finally:
        be.close()
