"""Every datum of a request in one pass: batch_losses against the per-datum losses, and the fused
fp32 log-softmax of the LM head against plain log_softmax + gather, values and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.engine.test_losses import RL_LOSSES, make_inputs
from tuneloop.server.engine.logprobs import _TargetLogprobs
from tuneloop.server.engine.losses import Segments, batch_losses, compute_loss
from tuneloop.server.engine.types import EngineError, Example, ForwardBackwardWork


def _work(name: str, config: dict[str, float] | None = None) -> ForwardBackwardWork:
    return ForwardBackwardWork(
        "a", (Example(np.zeros(1, dtype=np.int64), {}),), name, config or {}, False
    )


def _datums(name: str, two_d: bool) -> tuple[list[np.ndarray], list[dict[str, np.ndarray]]]:
    """Three datums of different lengths (one with a single token)."""
    lps, inputs = [], []
    for seed, length in ((0, 24), (1, 1), (2, 17)):
        lp, inp = make_inputs(name, seed, two_d)
        lps.append(lp[:length])
        inputs.append({k: v[:length] for k, v in inp.items()})
    return lps, inputs


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("name", ["cross_entropy", *RL_LOSSES])
def test_batched_losses_equal_each_datum_alone(name: str, two_d: bool) -> None:
    lps, inputs = _datums(name, two_d)
    config = {"beta": 0.3} if name == "dro" else {}
    work = _work(name, config)
    alone, alone_grads = [], []
    for lp, inp in zip(lps, inputs, strict=True):
        lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
        floats = {k: torch.tensor(v, dtype=torch.float32) for k, v in inp.items()}
        loss = compute_loss(name, lp_t, floats, config)
        (grad,) = torch.autograd.grad(loss, lp_t)
        alone.append(loss.item())
        alone_grads.append(grad.numpy())
    tensors = [torch.tensor(lp, dtype=torch.float32, requires_grad=True) for lp in lps]
    losses, metrics = batch_losses(work, tensors, inputs)
    assert losses.shape == (3,)
    assert losses.dtype == torch.float32
    assert metrics == [{}, {}, {}]
    np.testing.assert_allclose(losses.detach().numpy(), alone, rtol=1e-5, atol=1e-5)
    # Datum i's loss depends on datum i's logprobs only (GSPO: its own sequence ratio).
    weights = torch.tensor([1.0, -2.0, 0.5])
    grads = torch.autograd.grad((losses * weights).sum(), tensors)
    for w, grad, want in zip(weights.tolist(), grads, alone_grads, strict=True):
        np.testing.assert_allclose(grad.numpy(), w * want, rtol=1e-5, atol=1e-6)


def test_datums_that_cannot_be_laid_end_to_end_run_alone_with_the_same_values() -> None:
    lps, inputs = _datums("cross_entropy", False)
    del inputs[1]["weights"]  # one datum without weights: all ones
    tensors = [torch.tensor(lp, dtype=torch.float32) for lp in lps]
    losses, _ = batch_losses(_work("cross_entropy"), tensors, inputs)
    want = [
        -(inputs[0]["weights"] * lps[0]).sum(),
        -lps[1].sum(),
        -(inputs[2]["weights"] * lps[2]).sum(),
    ]
    np.testing.assert_allclose(losses.numpy(), want, rtol=1e-5)


def test_an_unknown_loss_is_a_user_error() -> None:
    lps, inputs = _datums("cross_entropy", False)
    with pytest.raises(EngineError) as info:
        batch_losses(_work("nope"), [torch.tensor(lp) for lp in lps], inputs)
    assert info.value.category == "user"


def test_segments_sum_and_spread_per_datum() -> None:
    segments = Segments.of_lengths([2, 1, 3], None)
    x = torch.arange(6, dtype=torch.float32)
    torch.testing.assert_close(segments.sums(x), torch.tensor([1.0, 2.0, 12.0]))
    torch.testing.assert_close(
        segments.sums(torch.stack([x, x], 1)), torch.tensor([2.0, 4.0, 24.0])
    )
    spread = segments.spread(torch.tensor([10.0, 20.0, 30.0]), torch.zeros(6, 2))
    assert spread.shape == (6, 1)
    assert spread[:, 0].tolist() == [10.0, 10.0, 20.0, 30.0, 30.0, 30.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_fused_target_logprobs_equal_log_softmax_and_gather(
    dtype: torch.dtype, softcap: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tuneloop.server.engine.logprobs as logprobs_module

    monkeypatch.setattr(logprobs_module, "_FP32_ELEMENTS_PER_PIECE", 3 * 50)  # several pieces
    torch.manual_seed(0)
    logits = (torch.randn(2, 7, 50) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (2, 7, 3))
    targets[..., 2] = targets[..., 0]  # a repeated target (the 0-padded top-K form)
    weights = torch.randn(2, 7, 3)
    x = logits.float()
    x = torch.tanh(x / softcap) * softcap if softcap else x
    want = torch.log_softmax(x, -1).gather(-1, targets)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), logits)
    got = _TargetLogprobs.apply(logits, targets, softcap)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), logits)
    assert got.dtype == torch.float32
    assert got_grad.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the forward values are exact
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=tol, atol=tol)
