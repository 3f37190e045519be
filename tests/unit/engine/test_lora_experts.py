"""Expert LoRA on fused MoE weights: values and gradients against a per-token dense reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from tests.unit.engine.conftest import adapter_spec  # noqa: E402
from tests.zoo.archs import build  # noqa: E402
from tuneloop.server.engine.lora import AdapterBank, LoRAExperts, inject  # noqa: E402
from tuneloop.server.engine.lora.experts import ExpertFactors  # noqa: E402

CPU = torch.device("cpu")


def _experts_layer(
    arch: str, dtype: torch.dtype = torch.float64
) -> tuple[AdapterBank, LoRAExperts]:
    model = build(arch).requires_grad_(False).to(dtype)
    bank = AdapterBank(inject(model))
    for i, key in enumerate(("a", "b")):
        # Two adapters of different ranks, both with expert factors.
        bank.create(adapter_spec(key, rank=2 + 2 * i, seed=i), CPU)
        generator = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for p in bank.parameters(key):
                p.data = (0.2 * torch.randn(p.shape, generator=generator)).to(dtype)
    layer = next(m for m in model.modules() if isinstance(m, LoRAExperts))
    return bank, layer


def _reference(
    layer: LoRAExperts,
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    keys: list[str | None],
) -> torch.Tensor:
    """Token by token, top-k slot by slot: the expert's dense weight plus the token's adapter's
    delta for that expert, then the module's own gate and the routing weight."""
    base = layer.base
    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros_like(x[t])
        for k in range(index.shape[1]):
            e = int(index[t, k])
            h = x[t]
            for name in ("gate_up_proj", "down_proj"):
                factors = layer.adapters[name]
                assert isinstance(factors, ExpertFactors)
                weight = getattr(base, name)[e]  # [out, in], or [in, out] transposed
                weight = weight.t() if layer.transposed else weight
                found = factors.lookup(keys[t])
                if found is not None:
                    a, b, scale = found
                    weight = weight + scale * b[e] @ a[e]
                h = weight @ h
                if layer.has_bias:
                    h = h + getattr(base, f"{name}_bias")[e]
                if name == "gate_up_proj":
                    h = base._apply_gate(h[None])[0]
            total = total + weights[t, k] * h
        rows.append(total)
    return torch.stack(rows)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_expert_lora_matches_the_per_token_dense_reference(arch: str) -> None:
    bank, layer = _experts_layer(arch)
    generator = torch.Generator().manual_seed(3)
    tokens, experts = 12, layer.adapters["gate_up_proj"].num_experts
    d = layer.adapters["gate_up_proj"].in_features
    x = torch.randn(tokens, d, generator=generator, dtype=torch.float64, requires_grad=True)
    index = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(tokens)])
    index[:4] = index[0]  # a few tokens share experts, and (likely) some expert sits idle
    weights = torch.rand(tokens, 2, generator=generator, dtype=torch.float64)
    keys: list[str | None] = ["a"] * 5 + [None] * 2 + ["b"] * 5
    with bank.routed(keys):
        got = layer(x, index, weights)
    want = _reference(layer, x, index, weights, keys)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    upstream = torch.randn(got.shape, generator=generator, dtype=torch.float64)
    # This layer's per-expert factors, [E, r, in] and [E, out, r], of both adapters.
    expert_params = [p for p in layer.parameters() if p.requires_grad]
    assert len(expert_params) == 8
    assert all(p.dim() == 3 for p in expert_params)
    ours = torch.autograd.grad((got * upstream).sum(), [x, *expert_params])
    theirs = torch.autograd.grad((want * upstream).sum(), [x, *expert_params])
    for g, w in zip(ours, theirs, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # Each adapter's gradient comes from its own tokens only: b's from rows 7.. alone.
    with bank.routed(keys):
        only_a = layer(x, index, weights)[:5].sum()
    grads_b = torch.autograd.grad(only_a, bank.parameters("b"), allow_unused=True)
    assert all(g is None or torch.count_nonzero(g) == 0 for g in grads_b)


def test_no_adapter_routed_runs_the_experts_as_they_are() -> None:
    # (float32: transformers' default experts kernel, grouped_mm, takes no float64)
    bank, layer = _experts_layer("qwen3_moe", torch.float32)
    x = torch.randn(6, layer.adapters["down_proj"].out_features)
    index = torch.tensor([[0, 1]] * 3 + [[2, 3]] * 3)
    weights = torch.full((6, 2), 0.5)
    with bank.routed([None] * 6):
        routed = layer(x, index, weights)
    torch.testing.assert_close(routed, layer.base(x, index, weights), rtol=0, atol=0)
    assert isinstance(layer.base, nn.Module)
