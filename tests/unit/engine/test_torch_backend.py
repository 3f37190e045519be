"""TorchBackend training path: adapter isolation, batch composition, losses, NaN, optimizer."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import (  # noqa: E402
    TINY,
    VOCAB,
    adam,
    adapter_spec,
    assert_near,
    example,
    forward,
    grads,
    ok,
    params,
    seq,
    train,
    work,
)
from tuneloop.server.engine import logprobs as logprobs_module  # noqa: E402
from tuneloop.server.engine import packing, training  # noqa: E402
from tuneloop.server.engine.torch_backend import TorchBackend  # noqa: E402
from tuneloop.server.engine.types import AdapterSpec, EngineError, Example  # noqa: E402

DATA_A = [example(seq(12, 1)), example(seq(7, 2))]
DATA_B = [example(seq(9, 3)), example(seq(15, 4), weights=np.linspace(0, 2, 14))]
DATA_C = [example(seq(5, 5))]


def changed(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before)


# ---- 1. adapter isolation ---------------------------------------------------------------------


@pytest.mark.parametrize("rank_b", [4, 8])
def test_training_one_adapter_leaves_another_untouched(backend, rank_b: int) -> None:
    backend.create_adapter(adapter_spec("A", rank=4, seed=1))
    backend.create_adapter(adapter_spec("B", rank=rank_b, seed=2))
    train(backend, "B", DATA_B, 2)  # B non-trivial (B factors != 0)
    lp_b, p_b = forward(backend, "B", DATA_B), params(backend, "B")
    p_a = params(backend, "A")

    train(backend, "A", DATA_A, 3)

    for before, after in zip(lp_b, forward(backend, "B", DATA_B), strict=True):
        assert np.array_equal(before, after)  # bit-identical
    p_b2 = params(backend, "B")
    assert not changed(p_b, p_b2)
    assert changed(p_a, params(backend, "A"))


@pytest.mark.parametrize("rank_b", [4, 2])
def test_mixed_batch_gradients_equal_separate_runs(tmp_path: Path, rank_b: int) -> None:
    def setup() -> TorchBackend:
        be = TorchBackend([TINY], cache_dir=tmp_path, device="cpu")
        be.create_adapter(adapter_spec("A", rank=4, seed=1))
        be.create_adapter(adapter_spec("B", rank=rank_b, seed=2))
        # One step each first so that B != 0 and the A factors get gradients too.
        train(be, "A", DATA_A[:1], 1)
        train(be, "B", DATA_B[:1], 1)
        return be

    separate = setup()
    ok(separate.forward_backward([work("A", DATA_A)])[0])
    ok(separate.forward_backward([work("B", DATA_B)])[0])
    g_sep = {k: grads(separate, k) for k in "AB"}

    mixed = setup()
    results = mixed.forward_backward([work("B", DATA_B), work("A", DATA_A)])
    for r in results:
        ok(r)
    g_mix = {k: grads(mixed, k) for k in "AB"}
    assert all(float(g.abs().max()) > 0 for g in g_mix["A"] + g_mix["B"])
    # (fp32 sums whose matmul blocking follows the batch's rows: 1.004e-6 of the largest
    # gradient apart with MKL's sgemm on an AVX2 EPYC)
    assert_near(g_mix, g_sep, 2e-6, "mixed vs separate grads", relative=True)

    for be in (separate, mixed):
        be.optim_step("A", adam(1e-3, eps=1e-4))
        be.optim_step("B", adam(1e-3, eps=1e-4))
    for key in "AB":
        assert_near(params(mixed, key), params(separate, key), 1e-6, "mixed vs separate params")


# ---- 2. batch composition and micro-batches ---------------------------------------------------


def test_logprobs_do_not_depend_on_batch_composition(tmp_path: Path) -> None:
    def build(budget: int) -> TorchBackend:
        be = TorchBackend([TINY], cache_dir=tmp_path, device="cpu", token_budget=budget)
        for i, key in enumerate("ABC"):
            be.create_adapter(adapter_spec(key, rank=2 + 2 * i, seed=i))
        train(be, "A", DATA_A, 2)
        train(be, "B", DATA_B, 2)
        return be

    be = build(8192)
    alone = {key: forward(be, key, data) for key, data in zip("AB", (DATA_A, DATA_B), strict=True)}
    together = be.forward_backward(
        [
            work("C", DATA_C, forward_only=True),
            work("B", DATA_B, forward_only=True),
            work("A", DATA_A, forward_only=True),
        ]
    )
    assert_near(ok(together[2]).logprobs, alone["A"], 1e-5, "A alone vs mixed")
    assert_near(ok(together[1]).logprobs, alone["B"], 1e-5, "B alone vs mixed")

    # Training runs, unsplit and split into one-row micro-batches, give the same results.
    runs = {}
    for budget in (8192, 16):
        be = build(budget)
        results = be.forward_backward([work("A", DATA_A), work("B", DATA_B), work("C", DATA_C)])
        for key in "AB":
            be.optim_step(key, adam(1e-3, eps=1e-4))
        runs[budget] = (
            [ok(r).logprobs for r in results],
            [ok(r).metrics["loss:sum"] for r in results],
            {key: params(be, key) for key in "AB"},
        )
    (lp1, loss1, p1), (lp2, loss2, p2) = runs[8192], runs[16]
    assert_near(lp2, lp1, 1e-5, "split vs unsplit logprobs")
    assert_near(loss2, loss1, 1e-4, "split vs unsplit loss")
    assert_near(p2, p1, 1e-5, "split vs unsplit params")
    assert_near(lp1[0], alone["A"], 1e-5, "training pass vs forward-only")


def test_chunked_lm_head_matches_unchunked(backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head module's own path (a sharded head's): in one piece, or in checkpointed chunks
    of positions; both give the same logprobs and gradients."""
    monkeypatch.setattr(logprobs_module, "head_parts", lambda head, hidden: None)
    backend.create_adapter(adapter_spec("A"))
    train(backend, "A", DATA_A, 1)
    ok(backend.forward_backward([work("A", DATA_A)])[0])
    whole_lp, whole_g = forward(backend, "A", DATA_A), grads(backend, "A")
    for p in backend._adapters["A"].optimizer._params:
        p.grad = None
    # Chunks of 3 positions: several chunks per row, each checkpointed.
    monkeypatch.setattr(logprobs_module, "LOGIT_ELEMENTS_PER_CHUNK", VOCAB * 2 * 3)
    monkeypatch.setattr(logprobs_module, "LOGIT_ELEMENTS_UNCHUNKED", 0)
    calls = []
    monkeypatch.setattr(
        logprobs_module,
        "checkpoint",
        lambda *a, **k: calls.append(1) or torch.utils.checkpoint.checkpoint(*a, **k),
    )
    ok(backend.forward_backward([work("A", DATA_A)])[0])
    assert len(calls) > 2  # the chunked, recomputing path really ran
    assert_near(forward(backend, "A", DATA_A), whole_lp, 1e-6, "chunked logprobs")
    assert_near(grads(backend, "A"), whole_g, 1e-6, "chunked grads", relative=True)


@pytest.mark.parametrize("tiles", ["one", "many", "many, recomputed"])
def test_fused_lm_head_matches_the_head_module(
    backend, monkeypatch: pytest.MonkeyPatch, tiles: str
) -> None:
    """A plain head runs fused over vocabulary tiles (fused_head.py): the same logprobs and
    gradients as the head module followed by a log-softmax, in one tile or in tiles of 3 rows
    by a quarter of the vocabulary (a ragged last one), the logits kept for the backward pass
    or recomputed there, two adapters in one batch."""
    from tuneloop.server.engine import fused_head

    for i, key in enumerate("AB"):
        backend.create_adapter(adapter_spec(key, seed=i))
        train(backend, key, DATA_A if key == "A" else DATA_B, 1)
    batch = [work("A", DATA_A), work("B", DATA_B), work("A", DATA_C)]

    def run() -> tuple[list, list]:
        for key in "AB":
            for p in backend._adapters[key].optimizer._params:
                p.grad = None
        results = backend.forward_backward(batch)
        return [ok(r).logprobs for r in results], [grads(backend, k) for k in "AB"]

    calls = []
    real = fused_head._FusedHead.apply
    monkeypatch.setattr(
        fused_head._FusedHead, "apply", lambda *a: calls.append(len(a[0].segments)) or real(*a)
    )
    if tiles != "one":
        monkeypatch.setattr(fused_head, "ROWS", 3)
        monkeypatch.setattr(fused_head, "COLUMNS", VOCAB // 4 + 1)
    if tiles.endswith("recomputed"):
        monkeypatch.setattr(fused_head, "SAVED_LOGITS_BYTES", 0)
    made, summed = [], []  # tiles of logits made, and made in the forward pass
    # (a forward tile's statistics by the torch code or, where the CPU has them, the C++ loops)
    places = ((fused_head, "_tile", made), (fused_head, "_forward_tile", summed))
    for owner, name, into in (*places, (fused_head.native_head, "forward_tile", summed)):
        real_fn = getattr(owner, name)
        monkeypatch.setattr(
            owner, name, lambda *a, f=real_fn, into=into, **kw: into.append(1) or f(*a, **kw)
        )
    fused_lp, fused_g = run()
    assert calls  # the fused path ran
    assert max(calls) == 3  # with the head adapted: A, B, A
    # the backward pass made its tiles again, or read the forward's; a tile whose rows get no
    # gradient (all a bucket's padding) is not made again
    if tiles.endswith("recomputed"):
        assert len(summed) < len(made) <= 2 * len(summed)
    else:
        assert len(made) == len(summed)
    with monkeypatch.context() as m:
        m.setattr(logprobs_module, "head_parts", lambda head, hidden: None)
        module_lp, module_g = run()
    assert_near(fused_lp, module_lp, 1e-5, "fused logprobs")
    assert_near(fused_g, module_g, 1e-5, "fused grads", relative=True)


def _two_adapters(tmp_path: Path, model: str) -> tuple[TorchBackend, Any, list[Any]]:
    """A backend with adapters A and B (B != 0: each changes the outputs its own way) and a
    batch of both, one request forward only."""
    be = TorchBackend([model], cache_dir=tmp_path, device="cpu")
    runtime = be._runtimes[model]
    for i, key in enumerate("AB"):
        be.create_adapter(AdapterSpec(key, model, 4, i))
        with torch.no_grad():
            for p in runtime.bank.parameters(key):
                p.normal_(0, 0.05)
    batch = [work("A", DATA_A), work("B", DATA_B), work("A", DATA_C, forward_only=True)]
    return be, runtime, batch


def _scored(be: TorchBackend, runtime: Any, batch: list[Any]) -> tuple[Any, ...]:
    """The batch's logprobs, losses and both adapters' gradients, from zero gradients."""
    for key in "AB":
        for p in runtime.bank.parameters(key):
            p.grad = None
    results = [ok(r) for r in be.forward_backward(batch)]
    return (
        [r.logprobs for r in results],
        [r.metrics["loss:sum"] for r in results],
        {key: grads(be, key) for key in "AB"},
    )


@pytest.mark.parametrize("model", ["tuneloop/tiny-qwen3", "tuneloop/tiny-llama"])
def test_packed_batches_equal_padded_ones(tmp_path: Path, model: str) -> None:
    """Sequences packed end to end give the padded batch's logprobs, losses and gradients."""
    be, runtime, batch = _two_adapters(tmp_path, model)
    assert runtime.packed  # SDPA models pack by default
    runs = {}
    for packed in (True, False):
        runtime.packed = packed
        runs[packed] = _scored(be, runtime, batch)
    (lp_p, loss_p, g_p), (lp_u, loss_u, g_u) = runs[True], runs[False]
    assert_near(lp_p, lp_u, 1e-5, "packed vs padded logprobs")
    assert_near(loss_p, loss_u, 1e-4, "packed vs padded loss", relative=True)
    assert_near(g_p, g_u, 1e-5, "packed vs padded grads", relative=True)
    be.close()


def test_a_packed_row_padded_to_its_bucket_scores_as_unpadded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pad segment that takes a packed row to its bucket length changes no logprob, loss
    or gradient: it attends only to itself, and no loss reads it."""
    be, runtime, batch = _two_adapters(tmp_path, TINY)
    total = sum(len(ex.tokens) for w in batch for ex in w.examples)
    seen: list[list[int]] = []
    real = packing.packed_segments
    monkeypatch.setattr(training, "packed_segments", lambda n: seen.append(list(n)) or real(n))
    runs = {}
    for buckets in (0, 16):
        monkeypatch.setattr(packing, "BUCKETS_PER_OCTAVE", buckets)
        runs[buckets] = _scored(be, runtime, batch)
    unpadded, padded = seen
    assert sum(unpadded) == total
    assert sum(padded) == packing.bucketed(total) > total  # (the data is not a bucket length)
    assert padded[: len(unpadded)] == unpadded
    (lp_p, loss_p, g_p), (lp_u, loss_u, g_u) = runs[16], runs[0]
    assert_near(lp_p, lp_u, 1e-5, "bucketed vs unpadded logprobs")
    assert_near(loss_p, loss_u, 1e-4, "bucketed vs unpadded loss", relative=True)
    assert_near(g_p, g_u, 1e-5, "bucketed vs unpadded grads", relative=True)
    be.close()


def test_packed_attention_stays_within_each_sequence(tmp_path: Path) -> None:
    """A sequence's logprobs do not change with what it is packed next to."""
    be = TorchBackend([TINY], cache_dir=tmp_path, device="cpu")
    be.create_adapter(adapter_spec("A"))
    alone = forward(be, "A", DATA_A[1:])
    after_other = forward(be, "A", [DATA_B[1], DATA_A[1]])
    assert_near(after_other[1:], alone, 1e-5, "packed after another sequence vs alone")
    be.close()


# ---- 3. losses through the engine -------------------------------------------------------------


def test_a_cpu_pass_offers_its_freed_memory_back(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After each forward_backward on a CPU the engine asks the allocator to give back what
    fragmentation piled up (host_allocator.release_fragmentation: a no-op off jemalloc)."""
    from tuneloop.server.engine import host_allocator

    calls: list[int] = []
    monkeypatch.setattr(host_allocator, "release_fragmentation", lambda: calls.append(1) or False)
    backend.create_adapter(adapter_spec("A"))
    ok(backend.forward_backward([work("A", DATA_B)])[0])
    assert calls == [1]


def test_cross_entropy_loss_is_weighted_sum_of_logprobs(backend) -> None:
    backend.create_adapter(adapter_spec("A"))
    [r] = backend.forward_backward([work("A", DATA_B)])
    result = ok(r)
    expected = -sum(
        float((ex.inputs["weights"] * lp).sum())
        for ex, lp in zip(DATA_B, result.logprobs, strict=True)
    )
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert all(
        lp.dtype == np.float32 and lp.shape == (len(ex.tokens),)
        for ex, lp in zip(DATA_B, result.logprobs, strict=True)
    )
    assert all(np.all(lp < 0) for lp in result.logprobs)


def test_importance_sampling_on_policy_has_unit_ratios(backend) -> None:
    backend.create_adapter(adapter_spec("A"))
    train(backend, "A", DATA_A, 2)
    q = forward(backend, "A", DATA_A)
    rl = [
        Example(
            ex.tokens,
            {
                "target_tokens": ex.inputs["target_tokens"],
                "logprobs": qi.astype(np.float32),
                "advantages": np.ones_like(qi, dtype=np.float32),
            },
        )
        for ex, qi in zip(DATA_A, q, strict=True)
    ]
    result = ok(backend.forward_backward([work("A", rl, loss_fn="importance_sampling")])[0])
    n = sum(len(ex.tokens) for ex in rl)
    assert result.metrics["loss:sum"] == pytest.approx(-n, abs=1e-4)
    assert_near(result.logprobs, q, 1e-6, "IS logprobs vs forward")
    # Gradient is that of -sum(lp): the same as cross entropy with unit weights.
    g_is = grads(backend, "A")
    for p in backend._adapters["A"].optimizer._params:
        p.grad = None
    ok(backend.forward_backward([work("A", DATA_A)])[0])
    assert_near(g_is, grads(backend, "A"), 1e-6, "IS grad vs CE grad on-policy", relative=True)


def test_topk_targets_give_each_columns_logprobs(backend) -> None:
    backend.create_adapter(adapter_spec("A"))
    train(backend, "A", DATA_A, 2)
    base = DATA_A[0]
    n = len(base.tokens)
    cols = np.stack(
        [base.inputs["target_tokens"], seq(n + 1, 9)[1:], np.full(n, 258), np.arange(n) % VOCAB],
        axis=1,
    )
    weights = np.random.default_rng(0).random((n, 4)).astype(np.float32)
    ex2d = Example(base.tokens, {"target_tokens": cols, "weights": weights})
    per_col = [Example(base.tokens, {"target_tokens": cols[:, k].copy()}) for k in range(4)]
    result = ok(backend.forward_backward([work("A", [ex2d], forward_only=True)])[0])
    lp2d = result.logprobs[0]
    assert lp2d.shape == (n, 4)
    one_d = forward(backend, "A", per_col)
    assert_near(lp2d, np.stack(one_d, axis=1), 1e-6, "top-K columns vs 1-D")
    assert result.metrics["loss:sum"] == pytest.approx(-float((weights * lp2d).sum()), rel=1e-5)


def test_cross_entropy_steps_lower_the_loss(backend) -> None:
    backend.create_adapter(adapter_spec("A"))
    losses = []
    for _ in range(4):
        losses.append(ok(backend.forward_backward([work("A", DATA_A[:1])])[0]).metrics["loss:sum"])
        backend.optim_step("A", adam(1e-2))
    assert all(b < a for a, b in itertools.pairwise(losses))
    assert losses[-1] < losses[0] - 1.0


# ---- 4. non-finite losses ---------------------------------------------------------------------


def _rl(ex: Example, q: float) -> Example:
    n = len(ex.tokens)
    return Example(
        ex.tokens,
        {
            "target_tokens": ex.inputs["target_tokens"],
            "logprobs": np.full(n, q, dtype=np.float32),
            "advantages": np.ones(n, dtype=np.float32),
        },
    )


@pytest.mark.parametrize("budget", [8192, 16])
def test_non_finite_loss_fails_only_its_work(tmp_path: Path, budget: int) -> None:
    backend = TorchBackend([TINY], cache_dir=tmp_path, device="cpu", token_budget=budget)
    backend.create_adapter(adapter_spec("A", seed=1))
    backend.create_adapter(adapter_spec("B", seed=2))
    train(backend, "A", DATA_A, 1)
    p_a = params(backend, "A")
    # The bad work's first datum is fine, its second overflows: exp(lp + 1e30) = inf (in a later
    # micro-batch when split).
    bad = work("A", [_rl(DATA_A[0], -5.0), _rl(DATA_A[1], -1e30)], loss_fn="importance_sampling")
    results = backend.forward_backward([work("B", DATA_B), bad, work("A", DATA_C)])
    assert isinstance(results[1], EngineError)
    assert results[1].category == "user"
    ok(results[0])
    ok(results[2])

    # The failed work contributed no gradient: A's grads are exactly those of DATA_C alone.
    g_after_batch = grads(backend, "A")
    for p in backend._adapters["A"].optimizer._params:
        p.grad = None
    ok(backend.forward_backward([work("A", DATA_C)])[0])
    assert_near(
        g_after_batch, grads(backend, "A"), 1e-6, "grads of the failed work leaked", relative=True
    )

    metrics = backend.optim_step("A", adam())
    assert np.isfinite(metrics["grad_norm"])
    p_a2 = params(backend, "A")
    assert changed(p_a, p_a2)
    assert all(bool(torch.isfinite(v).all()) for v in p_a2.values())
    train(backend, "A", DATA_A, 1)
    assert all(np.isfinite(lp).all() for lp in forward(backend, "A", DATA_A))


def test_unknown_adapter_and_loss_fail_alone(backend) -> None:
    backend.create_adapter(adapter_spec("A"))
    results = backend.forward_backward(
        [work("nope", DATA_A), work("A", DATA_A, loss_fn="bogus"), work("A", DATA_C)]
    )
    assert isinstance(results[0], EngineError)
    assert results[0].category == "user"
    assert isinstance(results[1], EngineError)
    assert results[1].category == "user"
    assert "bogus" in str(results[1])
    ok(results[2])


# ---- 5. optimizer through the engine ----------------------------------------------------------


def test_optim_step_reports_pre_clip_norm_and_lr(backend) -> None:
    backend.create_adapter(adapter_spec("A"))
    train(backend, "A", DATA_A, 1)
    ok(backend.forward_backward([work("A", DATA_A)])[0])
    expected = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads(backend, "A"))))
    before = params(backend, "A")
    metrics = backend.optim_step("A", adam(3e-3, grad_clip_norm=expected / 10))
    assert metrics["learning_rate"] == 3e-3
    assert metrics["grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert changed(before, params(backend, "A"))
    assert all(g.abs().max() == 0 for g in grads(backend, "A"))  # cleared


def test_gradient_accumulation_equals_one_big_batch(tmp_path: Path) -> None:
    def setup() -> TorchBackend:
        be = TorchBackend([TINY], cache_dir=tmp_path, device="cpu")
        be.create_adapter(adapter_spec("A", seed=3))
        train(be, "A", DATA_A, 1)
        return be

    split, whole = setup(), setup()
    ok(split.forward_backward([work("A", DATA_A[:1])])[0])
    ok(split.forward_backward([work("A", DATA_A[1:])])[0])
    ok(whole.forward_backward([work("A", DATA_A)])[0])
    assert_near(grads(split, "A"), grads(whole, "A"), 1e-6, "accumulated grads", relative=True)
    m_split = split.optim_step("A", adam(1e-3, eps=1e-4))
    m_whole = whole.optim_step("A", adam(1e-3, eps=1e-4))
    assert m_split["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-5)
    assert_near(params(split, "A"), params(whole, "A"), 1e-6, "accumulated params")


# ---- 10. the control plane does not import torch ----------------------------------------------


def test_control_plane_import_does_not_pull_torch() -> None:
    code = (
        "import sys, tuneloop.server.app; "
        "bad = [m for m in ('torch', 'transformers', 'tuneloop.server.engine.torch_backend') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{root / 'src'}:{root}", "HF_HUB_OFFLINE": "1"},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
