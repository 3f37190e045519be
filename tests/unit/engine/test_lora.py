"""LoRALinear and AdapterBank: per-row routing, PEFT-style init, targets, snapshots, load checks."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from tests.unit.engine.conftest import adapter_spec  # noqa: E402
from tuneloop.server.engine.lora import (  # noqa: E402
    ATTENTION_TARGETS,
    MLP_TARGETS,
    AdapterBank,
    inject,
    ops,
    targets_of,
)
from tuneloop.server.engine.types import EngineError  # noqa: E402

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(6, 5, bias=True)
        self.up_proj = nn.Linear(6, 5, bias=False)
        self.other = nn.Linear(6, 6)  # not a target: never wrapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) + self.up_proj(self.other(x))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()
        self.lm_head = nn.Linear(5, 7, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.block(x))


def make() -> tuple[Tiny, AdapterBank]:
    model = Tiny().requires_grad_(False)
    return model, AdapterBank(inject(model, refuse_uncovered=False))


def randomise(bank: AdapterBank, key: str, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bank.parameters(key):
            p.copy_(0.3 * torch.randn(p.shape, generator=generator))


def reference(model: Tiny, bank: AdapterBank, key: str | None, x: torch.Tensor) -> torch.Tensor:
    """The model with `key`'s deltas folded into dense weights (or the base for None)."""

    def lin(name: str, inp: torch.Tensor) -> torch.Tensor:
        module = bank.modules[name]
        weight = module.base.weight
        if key is not None and key in module.factors:
            a, b, scale = module.factors[key]
            weight = weight + scale * b @ a
        return nn.functional.linear(inp, weight, module.base.bias)

    block = model.block
    h = lin("block.q_proj", x) + lin("block.up_proj", block.other(x))
    return lin("lm_head", h)


def test_inject_wraps_only_targets_and_keeps_the_base_output() -> None:
    model, bank = make()
    assert set(bank.modules) == {"block.q_proj", "block.up_proj", "lm_head"}
    assert isinstance(model.block.other, nn.Linear)
    x = torch.randn(3, 4, 6)
    expected = reference(model, bank, None, x)
    assert torch.equal(model(x), expected)  # no routing: the base
    with bank.routed([None, None, None]):
        assert torch.equal(model(x), expected)


def test_targets_follow_the_spec() -> None:
    assert targets_of(adapter_spec("a", train_mlp=False, train_unembed=False)) == ATTENTION_TARGETS
    assert targets_of(adapter_spec("a", train_attn=False, train_unembed=False)) == MLP_TARGETS
    _, bank = make()
    assert bank.module_names(adapter_spec("a", train_attn=False)) == ["block.up_proj", "lm_head"]
    with pytest.raises(EngineError, match="targets no module") as info:
        bank.create(adapter_spec("x", train_attn=False, train_mlp=False, train_unembed=False), CPU)
    assert info.value.category == "user"


def test_create_initialises_like_peft_seeded() -> None:
    _, bank = make()
    _, bank2 = make()
    params = bank.create(adapter_spec("a", rank=3, seed=11, alpha=12.0), CPU)
    again = bank2.create(adapter_spec("a", rank=3, seed=11, alpha=12.0), CPU)
    other = bank2.create(adapter_spec("b", rank=3, seed=12), CPU)
    assert len(params) == 6
    assert all(torch.equal(p, q) for p, q in zip(params, again, strict=True))
    assert not torch.equal(params[0], other[0])
    for name in bank.modules:
        a, b, scale = bank.modules[name].factors["a"]
        assert a.shape == (3, bank.modules[name].in_features)
        assert b.shape == (bank.modules[name].out_features, 3)
        assert scale == 4.0
        assert float(a.detach().abs().max()) <= 1 / math.sqrt(a.shape[1])
        assert float(a.detach().abs().max()) > 0
        assert torch.count_nonzero(b) == 0
    with pytest.raises(EngineError, match="already exists"):
        bank.create(adapter_spec("a"), CPU)


def test_each_row_uses_its_own_adapter_and_gradients_stay_there() -> None:
    model, bank = make()
    bank.create(adapter_spec("a", rank=2, seed=1), CPU)
    bank.create(adapter_spec("b", rank=4, seed=2, train_attn=False), CPU)
    randomise(bank, "a", 1)
    randomise(bank, "b", 2)
    x = torch.randn(4, 3, 6)
    keys = ["b", None, "a", "b"]
    with bank.routed(keys):
        out = model(x)
    for i, key in enumerate(keys):
        torch.testing.assert_close(out[i], reference(model, bank, key, x[i : i + 1])[0])

    # Row 2 alone drives a's gradient; b's gradient comes from rows 0 and 3 only.
    with bank.routed(keys):
        model(x)[2].sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in bank.parameters("a"))
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in bank.parameters("b"))
    for p in bank.parameters("a"):
        p.grad = None
    with bank.routed(keys):
        (model(x)[1].sum() + model(x)[2].sum() * 0).backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in bank.parameters("a"))


def test_routing_is_cleared_even_on_errors() -> None:
    model, bank = make()
    bank.create(adapter_spec("a"), CPU)
    randomise(bank, "a", 3)
    with pytest.raises(RuntimeError), bank.routed(["a"]):
        raise RuntimeError("boom")
    assert all(m.routing is None for m in bank.modules.values())
    x = torch.randn(1, 2, 6)
    assert torch.equal(model(x), reference(model, bank, None, x))


def test_snapshot_state_load_and_delete() -> None:
    model, bank = make()
    bank.create(adapter_spec("a", rank=2), CPU)
    randomise(bank, "a", 4)
    bank.snapshot("a", "snap")
    frozen = {k: v.clone() for k, v in bank.state("snap").items()}
    assert set(frozen) == {f"{m}.lora_{f}.weight" for m in bank.modules for f in "AB"}
    with pytest.raises(EngineError, match="frozen sampler"):
        bank.parameters("snap")
    randomise(bank, "a", 5)  # the snapshot does not follow
    assert all(torch.equal(bank.state("snap")[k], v) for k, v in frozen.items())

    ids = [id(p) for p in bank.parameters("a")]
    bank.load("a", frozen)  # in place: the optimizer's Parameter objects stay valid
    assert [id(p) for p in bank.parameters("a")] == ids
    x = torch.randn(1, 3, 6).expand(2, 3, 6)
    with bank.routed(["a", "snap"]):
        out = model(x)
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-5)

    bad = dict(frozen)
    bad["lm_head.lora_A.weight"] = torch.zeros(3, 5)
    with pytest.raises(EngineError, match="shape"):
        bank.load("a", bad)
    missing = {k: v for k, v in frozen.items() if not k.startswith("lm_head")}
    with pytest.raises(EngineError, match="lacks"):
        bank.load("a", missing)

    bank.delete("snap")
    assert "snap" not in bank.specs
    assert all("snap" not in m.factors for m in bank.modules.values())
    assert "a" in bank.specs


def test_frozen_factors_are_fresh_aligned_copies() -> None:
    """Factors read from a file keep their offset in it; the bank copies them, so a saved
    sampler computes with the alignment (and so the rounding) of an in-memory snapshot."""
    _, bank = make()
    bank.create(adapter_spec("a", rank=2), CPU)
    randomise(bank, "a", 4)
    state = bank.state("a")
    misaligned = {}
    for key, value in state.items():  # views 4 bytes into a buffer, as a file's tensors can be
        buffer = torch.empty(value.numel() + 1)
        misaligned[key] = buffer[1:].view(value.shape).copy_(value)
    bank.add_frozen("disk", bank.specs["a"], misaligned)
    for name, module, a, b in bank._layers("disk"):
        for factor, source in zip((a, b), bank._read(name, module, misaligned), strict=True):
            assert torch.equal(factor, source)
            assert factor.data_ptr() % 64 == 0
            assert factor.data_ptr() != source.data_ptr()


def test_grouped_application_equals_one_adapter_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal-size runs of same-rank adapters take the batched path; values and grads agree."""
    model, bank = make()
    keys = ["a", "b", "c"]
    for i, key in enumerate(keys):
        bank.create(adapter_spec(key, rank=2, seed=i), CPU)
        randomise(bank, key, seed=10 + i)
    x = torch.randn(6, 4, 6, generator=torch.Generator().manual_seed(3))
    rows = ["a", "a", "b", "b", "c", "c"]

    from tuneloop.server.engine.lora import ops

    used = []
    original = ops._grouped

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = original(*args, **kwargs)
        used.append(result is not None)
        return result

    monkeypatch.setattr(ops, "_grouped", spy)
    with bank.routed(rows):
        grouped = model(x)
        grouped.square().sum().backward()
    assert used
    assert all(used)
    grouped_grads = {k: [p.grad.clone() for p in bank.parameters(k)] for k in keys}
    for k in keys:
        for p in bank.parameters(k):
            p.grad = None

    pieces = []
    for start, key in zip(range(0, 6, 2), keys, strict=True):
        with bank.routed([key, key]):
            piece = model(x[start : start + 2])
            piece.square().sum().backward()
        pieces.append(piece)
    torch.testing.assert_close(grouped, torch.cat(pieces), rtol=1e-5, atol=1e-6)
    for k in keys:
        for got, want in zip(grouped_grads[k], bank.parameters(k), strict=True):
            torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-6)


def test_adapters_are_parameters_of_the_model_and_come_and_go_without_rewrapping() -> None:
    model, bank = make()
    wrappers = {name: id(m) for name, m in model.named_modules()}
    bank.create(adapter_spec("a", rank=2), CPU)
    bank.snapshot("a", "snap")
    bank.create(adapter_spec("b", rank=3, train_attn=False), CPU)
    names = {n for n, _ in model.named_parameters() if "lora_" in n}
    # Slots 0 (a), 1 (snap) and 2 (b) on every layer each targets; b skips the attention.
    assert "block.q_proj.lora_A.0" in names
    assert "block.q_proj.lora_A.1" in names
    assert "block.q_proj.lora_A.2" not in names
    assert "lm_head.lora_B.2" in names
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in bank.parameters("a") + bank.parameters("b")}
    bank.delete("a")
    assert not any(n.endswith(".0") for n, _ in model.named_parameters() if "lora_" in n)
    bank.create(adapter_spec("c", rank=2), CPU)  # reuses the freed slot
    assert "block.q_proj.lora_A.0" in {n for n, _ in model.named_parameters()}
    assert {n: id(m) for n, m in model.named_modules() if "lora_" not in n} == {
        n: i for n, i in wrappers.items() if "lora_" not in n
    }


def test_a_registered_kernel_serves_its_devices_with_the_reference_values() -> None:
    from tuneloop.server.engine.lora import ops

    model, bank = make()
    for i, key in enumerate(("a", "b")):
        bank.create(adapter_spec(key, rank=2 + i, seed=i), CPU)
        randomise(bank, key, 20 + i)
    x = torch.randn(3, 4, 6)
    with bank.routed(["a", "b", "a"]):
        want = model(x)
    calls = []

    def kernel(*args):  # type: ignore[no-untyped-def]
        calls.append(args[2])
        return ops.add_lora_torch(*args)

    ops.register_kernel(kernel, devices=("cpu",))
    try:
        with bank.routed(["a", "b", "a"]):
            got = model(x)
    finally:
        ops.register_kernel(None)
    assert calls
    assert all(list(sizes) == [4, 4, 4] for sizes in calls)
    assert torch.equal(got, want)


def test_models_with_layers_it_cannot_adapt_are_refused_by_name() -> None:
    from tuneloop.server.engine.lora import inject

    model = Tiny().requires_grad_(False)
    with pytest.raises(EngineError, match=r"Linear \(e\.g\. block\.other\.weight\)") as info:
        inject(model)
    assert info.value.category == "user"


def test_bf16_activations_multiply_bf16_casts_and_train_the_fp32_masters() -> None:
    """Mixed precision: on a bf16 model the products run in bf16 from fp32 masters, each
    layer's cast is made once per routed block, and the gradients land in fp32 as the fp32
    computation's to bf16 rounding."""
    model, bank = make()
    bank.create(adapter_spec("a", rank=2, seed=1), CPU)
    randomise(bank, "a", 1)
    x = torch.randn(4, 3, 6)
    with bank.routed(["a"] * 4):
        model(x).square().sum().backward()
    fp32_grads = [p.grad.clone() for p in bank.parameters("a")]  # type: ignore[union-attr]
    for p in bank.parameters("a"):
        p.grad = None
    model.to(torch.bfloat16)
    for p in bank.parameters("a"):  # the masters stay fp32 whatever the base weights are
        p.data = p.data.float()
    with bank.routed(["a"] * 4):
        out = model(x.bfloat16())
        routing = bank.injected.context.routing
        assert routing is not None
        casts = dict(routing.cast)
        assert len(casts) == len(bank.module_names(bank.specs["a"]))
        assert {t.dtype for pair in casts.values() for t in pair} == {torch.bfloat16}
        model(x.bfloat16())  # a second pass in the block reuses the casts
        assert all(routing.cast[k][0] is casts[k][0] for k in casts)
        out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16
    for p, want in zip(bank.parameters("a"), fp32_grads, strict=True):
        assert p.dtype == torch.float32
        assert p.grad is not None
        assert p.grad.dtype == torch.float32
        scale = want.abs().max().item()
        assert (p.grad - want).abs().max().item() <= 0.05 * scale


def _nodes(out: torch.Tensor) -> set[str]:
    """The names of the autograd nodes behind `out`."""
    seen: set[str] = set()
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or type(node).__name__ in seen:
            continue
        seen.add(type(node).__name__)
        stack += [n for n, _ in node.next_functions]
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_adapter_over_every_row_trains_through_one_node_with_the_same_gradients(
    dtype: torch.dtype,
) -> None:
    """A batch of one adapter records base + delta as one node; its values and the gradients of
    the input and the fp32 masters are those of the base layer plus `add_lora`'s delta (fp32:
    to fp32 rounding; bf16: to a few bf16 units). A bias, a 3-D input and an input without
    gradient (the first layer's) included."""
    model, bank = make()
    bank.create(adapter_spec("a", rank=2, seed=1), CPU)
    randomise(bank, "a", 1)
    model.to(dtype)
    for p in bank.parameters("a"):
        p.data = p.data.float()
    x = torch.randn(4, 3, 6).to(dtype)
    runs: dict[str, tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]] = {}
    for name, node in (("fused", True), ("two nodes", False)):
        q = bank.modules["block.q_proj"]
        if not node:  # the path every other batch takes: base layer, then add_lora
            q._one_adapter = lambda x, routing: None  # type: ignore[method-assign]
        xg = x.clone().requires_grad_()
        with bank.routed(["a"] * 4):
            out = q(xg)
        if node:
            assert "_OneAdapterLinearBackward" in _nodes(out)
        else:
            assert "_OneAdapterLinearBackward" not in _nodes(out)
            del q._one_adapter
        out.float().square().sum().backward()
        masters = q.factors["a"][:2]  # A and B, fp32
        runs[name] = (out.detach(), [p.grad.clone() for p in masters], xg.grad)
        for p in bank.parameters("a"):
            p.grad = None
    (out_f, grads_f, x_f), (out_t, grads_t, x_t) = runs["fused"], runs["two nodes"]
    bound = 1e-6 if dtype == torch.float32 else 2.0**-6
    for got, want in [(out_f, out_t), (x_f, x_t), *zip(grads_f, grads_t, strict=True)]:
        assert got.dtype == want.dtype
        error = (got.float() - want.float()).abs().max().item()
        assert error <= bound * max(1.0, want.float().abs().max().item()), error
    with bank.routed(["a"] * 4):  # the first layer's input: no input gradient to make
        bank.modules["block.q_proj"](x).float().sum().backward()
    assert all(p.grad is not None for p in bank.modules["block.q_proj"].factors["a"][:2])


def test_the_one_adapter_node_is_left_to_mixed_batches_inference_and_trained_bases() -> None:
    _, bank = make()
    bank.create(adapter_spec("a", rank=2, seed=1), CPU)
    bank.create(adapter_spec("b", rank=2, seed=2), CPU)
    q = bank.modules["block.q_proj"]
    x = torch.randn(4, 3, 6, requires_grad=True)
    with bank.routed(["a", "a", "b", "b"]):
        assert "_OneAdapterLinearBackward" not in _nodes(q(x))
    with bank.routed(["a"] * 4), torch.no_grad():
        assert q(x).grad_fn is None
    q.base.weight.requires_grad_(True)
    with bank.routed(["a"] * 4):
        assert "_OneAdapterLinearBackward" not in _nodes(q(x))
    q.base.weight.requires_grad_(False)
    with bank.routed(["a"] * 4):
        assert "_OneAdapterLinearBackward" in _nodes(q(x))


def _kept(out: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> float:
    """The share of `delta` that `out` carries over `base` (a projection; fp64)."""
    return float(((out.double() - base) * delta).sum() / (delta * delta).sum())


def test_at_half_precision_the_one_adapter_node_keeps_a_delta_below_the_outputs_last_bit() -> None:
    """A young adapter's delta is far below a bf16 output's last bit: added to the rounded base
    output it is mostly lost; the node sums it with the base in one matmul and keeps it (as a
    decode step's fused weights do, lora/fused.py)."""
    g = torch.Generator().manual_seed(0)
    rows, inp, out, rank = 256, 64, 48, 8
    x = torch.randn(rows, inp, generator=g).bfloat16()
    w = (torch.randn(out, inp, generator=g) * inp**-0.5).bfloat16()
    a = (torch.randn(rank, inp, generator=g) * inp**-0.5).bfloat16()
    b = (torch.randn(out, rank, generator=g) * 1e-3 / rank**0.5).bfloat16()
    base = x.double() @ w.double().t()
    delta = 2.0 * (x.double() @ a.double().t()) @ b.double().t()
    node = ops.one_adapter_linear(x, w, None, (a, b, 2.0))
    products = ops.add_lora(x @ w.t(), x, [rows], [(a, b, 2.0)], {})
    assert _kept(node, base, delta) == pytest.approx(1.0, abs=0.05)
    assert _kept(products, base, delta) < 0.8
    # fp32 has the bits to spare: the node adds the delta to the base output as before
    x32, w32 = x.float(), w.float()
    node32 = ops.one_adapter_linear(x32, w32, None, (a.float(), b.float(), 2.0))
    torch.testing.assert_close(
        node32, ops.add_lora(x32 @ w32.t(), x32, [rows], [(a.float(), b.float(), 2.0)], {})
    )


def test_the_node_runs_in_bf16_inference_passes_but_not_in_sampling_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sampling step runs per token: there a copy of each weight per call would cost more
    than the step (it takes the lone key's fused weights or the products instead)."""
    model, bank = make()
    bank.create(adapter_spec("a", rank=2, seed=1), CPU)
    randomise(bank, "a", 1)
    model.bfloat16()
    calls = [0]
    original = ops.one_adapter_linear

    def counting(*args: object) -> torch.Tensor:
        calls[0] += 1
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "one_adapter_linear", counting)
    q = bank.modules["block.q_proj"]
    x = torch.randn(4, 6).bfloat16()
    with torch.no_grad():
        with bank.routed(["a"] * 4):
            q(x)
        assert calls[0] == 1
        with bank.routed(["a"] * 4):
            assert q.routing is not None
            q.routing.steps = True  # type: ignore[attr-defined]
            q(x)
        assert calls[0] == 1
        model.float()
        with bank.routed(["a"] * 4):
            q(x.float())
        assert calls[0] == 1  # fp32 inference: the products, as before
