"""Sibling linears of one adapter as one autograd node (lora/siblings.py)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import (  # noqa: E402
    adapter_spec,
    example,
    grads,
    ok,
    seq,
    train,
    work,
)
from tuneloop.server.engine import cpu_fp32_matmul  # noqa: E402
from tuneloop.server.engine.lora import fused, ops, siblings  # noqa: E402

SIZES = (24, 8, 8)  # q, k, v of a grouped-query attention
WIDTH, RANK = 16, 4


def _layers(dtype: torch.dtype) -> tuple[list[Any], list[Any], list[Any]]:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, WIDTH, generator=gen).to(dtype) for n in SIZES]
    # q and v with a bias, k without: the group adds zeros for k
    biases = [
        torch.randn(n, generator=gen).to(dtype) if i != 1 else None for i, n in enumerate(SIZES)
    ]
    masters = [
        (
            torch.randn(RANK, WIDTH, generator=gen).requires_grad_(),
            torch.randn(n, RANK, generator=gen).requires_grad_(),
            scale,
        )
        for n, scale in zip(SIZES, (2.0, 0.5, 1.0), strict=True)
    ]
    return weights, biases, masters


def _run(
    dtype: torch.dtype, grouped: bool, used: tuple[int, ...], with_bias: bool
) -> tuple[list[Any], list[Any]]:
    """Outputs of the siblings and the gradients of x and every factor master, of a loss that
    reads the outputs `used` (the others get no gradient)."""
    weights, biases, masters = _layers(dtype)
    if not with_bias:
        biases = [None] * len(weights)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, WIDTH, generator=gen).to(dtype).requires_grad_()
    factors = [(a.to(dtype), b.to(dtype), s) for a, b, s in masters]
    if grouped:
        outs = list(siblings.sibling_linears(x, weights, factors, biases))
    else:
        layers = zip(weights, biases, factors, strict=True)
        outs = [ops.one_adapter_linear(x, w, bias, f) for w, bias, f in layers]
    probe = torch.Generator().manual_seed(2)
    loss = sum((outs[i].float() * torch.randn(outs[i].shape, generator=probe)).sum() for i in used)
    loss.backward()  # type: ignore[union-attr]
    found = [x.grad] + [
        t.grad if t.grad is not None else torch.zeros_like(t) for a, b, _ in masters for t in (a, b)
    ]
    return [o.detach().float() for o in outs], [g.float() for g in found]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("onednn", [False, True])
def test_the_group_node_equals_each_layer_own_node(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, used: tuple, with_bias: bool, onednn: bool
) -> None:
    """Outputs and gradients (input, every A and B) as the one-adapter node of each layer, with
    biases on some siblings or none; an output the loss does not read gives its factors zero
    gradients. fp32's products by the frozen weights by either kernel (cpu_fp32_matmul.py)."""
    monkeypatch.setattr(cpu_fp32_matmul, "_forced", onednn)
    got_out, got_grads = _run(dtype, True, used, with_bias)
    want_out, want_grads = _run(dtype, False, used, with_bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: each product rounded once
    for got, want in zip(got_out + got_grads, want_out + want_grads, strict=True):
        assert got.shape == want.shape
        scale = want.abs().max().item() or 1.0
        assert (got - want).abs().max().item() <= tol * scale
    if 1 not in used:
        assert got_grads[3].abs().max() == 0
        assert got_grads[4].abs().max() == 0


def test_take_computes_a_group_once_per_input() -> None:
    """Each sibling takes its output of the group made for this input; a sibling asking twice
    or another input computes the group again; nothing is held once all took theirs."""
    calls = []

    def compute(x: torch.Tensor) -> Any:
        calls.append(1)
        return [x + i for i in range(3)]

    held: dict = {}
    x, y = torch.zeros(2), torch.ones(2)
    assert [fused.take(held, 7, i, x, lambda: compute(x))[0].item() for i in range(3)] == [
        0.0,
        1.0,
        2.0,
    ]
    assert len(calls) == 1
    assert held == {}
    fused.take(held, 7, 0, x, lambda: compute(x))
    fused.take(held, 7, 0, x, lambda: compute(x))  # asked twice: made again
    assert len(calls) == 3
    assert fused.take(held, 7, 1, y, lambda: compute(y))[0].item() == 2.0  # another input
    assert len(calls) == 4
    assert held[7][0] is y


@pytest.mark.parametrize("with_bias", [False, True])
def test_a_training_pass_runs_q_k_v_and_gate_up_as_groups(
    backend: Any, monkeypatch: pytest.MonkeyPatch, with_bias: bool
) -> None:
    """The tiny Qwen3's attention projections and gated MLP run one node a group in training,
    with the logprobs and gradients of one node a layer (fp32: to 1e-5); with frozen biases
    on q/k/v (as Qwen2's) too."""
    model = backend._runtimes[next(iter(backend._runtimes))].model
    if with_bias:
        gen = torch.Generator().manual_seed(4)
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                base = getattr(layer.self_attn, name).base
                values = torch.randn(base.out_features, generator=gen) * 0.1
                base.bias = torch.nn.Parameter(values, requires_grad=False)
    backend.create_adapter(adapter_spec("A", seed=3))
    data = [example(seq(12, 1)), example(seq(7, 2))]
    train(backend, "A", data, 1)  # B != 0: every delta counts
    calls = [0]
    real = siblings.SiblingLinears.apply

    def counting(*args: Any) -> Any:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(siblings.SiblingLinears, "apply", counting)

    def scored() -> tuple[list, list]:
        for p in backend._adapters["A"].optimizer._params:
            p.grad = None
        result = ok(backend.forward_backward([work("A", data)])[0])
        return result.logprobs, grads(backend, "A")

    grouped = scored()
    layers = model.config.num_hidden_layers
    assert calls[0] == 2 * layers
    monkeypatch.setattr(siblings, "_GROUPED", False)
    single = scored()
    assert calls[0] == 2 * layers
    for got, want in zip(grouped[0], single[0], strict=True):
        assert abs(got - want).max() <= 1e-5
    for got, want in zip(grouped[1], single[1], strict=True):
        assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def _linears(sizes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[Any]:
    gen = torch.Generator().manual_seed(5)
    layers = [torch.nn.Linear(WIDTH, n, dtype=dtype) for n in sizes]
    for layer in layers:
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))
        layer.requires_grad_(False)
    return layers


def test_a_groups_weights_are_stacked_as_views_of_one_tensor_with_their_values() -> None:
    layers = _linears(SIZES)
    before = [layer.weight.detach().clone() for layer in layers]
    x = torch.randn(3, WIDTH)
    outputs = [layer(x) for layer in layers]
    assert siblings.stacked_view([layer.weight for layer in layers]) is None
    assert siblings.stack_weights(layers)
    weights = [layer.weight for layer in layers]
    for layer, w, old, out in zip(layers, weights, before, outputs, strict=True):
        assert isinstance(w, torch.nn.Parameter)
        assert not w.requires_grad
        assert torch.equal(w, old)
        assert torch.equal(layer(x), out)
    whole = siblings.stacked(weights)
    assert whole.data_ptr() == weights[0].data_ptr()  # no copy
    assert torch.equal(whole, torch.cat(before))
    assert siblings.stack_weights(layers)  # (again: already stacked, left as it is)
    assert siblings.stacked(weights).data_ptr() == whole.data_ptr()


def test_weights_apart_concatenate_and_mixed_groups_stay_apart() -> None:
    layers = _linears(SIZES)
    weights = [layer.weight for layer in layers]
    whole = siblings.stacked(weights)
    assert torch.equal(whole, torch.cat([w.detach() for w in weights]))
    assert whole.data_ptr() not in {w.data_ptr() for w in weights}
    # out of order, or another dtype: no view
    assert siblings.stack_weights(layers)
    assert siblings.stacked_view(weights[::-1]) is None
    mixed = _linears((8,)) + _linears((8,), torch.float64)
    assert not siblings.stack_weights(mixed)
    assert mixed[0].weight.data_ptr() != mixed[1].weight.data_ptr()


def test_the_bank_stacks_each_groups_weights(backend: Any) -> None:
    """The tiny Qwen3's q/k/v and gate/up weights, once adapters can be made, are each group's
    rows of one tensor."""
    model = backend._runtimes[next(iter(backend._runtimes))].model
    for layer in model.model.layers:
        attention = [
            getattr(layer.self_attn, n).base.weight for n in ("q_proj", "k_proj", "v_proj")
        ]
        mlp = [getattr(layer.mlp, n).base.weight for n in ("gate_proj", "up_proj")]
        for group in (attention, mlp):
            assert siblings.stacked_view(group) is not None
