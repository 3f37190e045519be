"""A decode step whose rows all use one key runs each group of sibling linears as one matmul,
the adapter's delta in extra columns (lora/fused.py): the values of the base layers plus the
LoRA products to rounding, the same tokens, one computation per group, and the products back
wherever more than one key shares the step or a copy would be stale."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from tests.unit.engine.conftest import TINY, bank, ok, packed_for_kernels  # noqa: E402
from tests.unit.engine.test_merged_sampling import _trained  # noqa: E402
from tests.unit.engine.test_sampler import prompt, sequence_logprobs, sw  # noqa: E402
from tuneloop.server.engine import packed  # noqa: E402
from tuneloop.server.engine.lora.fused import FusedLinear, fusable, sibling_groups  # noqa: E402


def _linear(out: int, inp: int, *, bias: bool, seed: int, dtype: Any = torch.float32) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(inp, out, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out, inp, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(out, generator=g))
    layer.requires_grad_(False)
    return layer


def _factors(out: int, inp: int, rank: int, seed: int) -> tuple[Any, Any, float]:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(rank, inp, generator=g), torch.randn(out, rank, generator=g), 0.5


def _reference(x: Any, layer: nn.Linear, found: Any) -> Any:
    out = nn.functional.linear(x.double(), layer.weight.double(), None)
    if layer.bias is not None:
        out = out + layer.bias.double()
    if found is not None:
        a, b, scale = found
        out = out + scale * (x.double() @ a.double().t()) @ b.double().t()
    return out


@pytest.mark.parametrize("bias", [False, True])
def test_a_group_gives_each_siblings_base_output_plus_its_delta(bias: bool) -> None:
    layers = [_linear(12, 8, bias=bias, seed=1), _linear(4, 8, bias=False, seed=2)]
    layers.append(_linear(4, 8, bias=bias, seed=3))
    # the middle sibling has no factors for this key (an adapter that skips k_proj)
    factors = [_factors(12, 8, 3, 1), None, _factors(4, 8, 3, 3)]
    group = FusedLinear.build(layers, factors)
    assert group.a is not None
    assert group.a.shape == (6, 8)
    assert group.weight.shape == (20, 8 + 6)
    x = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(9))
    for index, (layer, found) in enumerate(zip(layers, factors, strict=True)):
        got = group.output(index, x)
        assert got.shape == (1, 5, layer.out_features)
        torch.testing.assert_close(got.double(), _reference(x, layer, found), atol=1e-5, rtol=1e-5)
    merged = FusedLinear.build(layers, factors, merge=True)
    assert merged.a is None
    assert merged.weight.shape == (20, 8)
    for index, (layer, found) in enumerate(zip(layers, factors, strict=True)):
        got = merged.output(index, x)
        torch.testing.assert_close(got.double(), _reference(x, layer, found), atol=1e-4, rtol=1e-5)


def test_siblings_share_one_computation_per_input(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = [_linear(6, 4, bias=False, seed=s) for s in range(3)]
    group = FusedLinear.build(layers, [_factors(6, 4, 2, s) for s in range(3)])
    calls = [0]
    original = group._compute

    def counting(*args: Any) -> Any:
        calls[0] += 1  # the group's matmul (on whichever layout its weight is in)
        return original(*args)

    monkeypatch.setattr(group, "_compute", counting)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    outs = [group.output(i, x) for i in range(3)]
    assert calls[0] == 1
    assert group._held == {}  # every sibling served: nothing held
    assert [group.output(i, y) for i in (1, 0)]
    assert calls[0] == 2
    group.output(0, y)  # asked again before its siblings: computed again, same values
    assert calls[0] == 3
    torch.testing.assert_close(group.output(2, x), outs[2])  # another input: computed again
    assert calls[0] == 4


def test_siblings_are_grouped_by_parent_family_and_input() -> None:
    names = [
        "l0.attn.q_proj",
        "l0.attn.k_proj",
        "l0.attn.v_proj",
        "l0.attn.o_proj",
        "l0.mlp.gate_proj",
        "l0.mlp.up_proj",
        "l0.mlp.down_proj",
        "l1.attn.q_proj",
        "l1.attn.v_proj",
        "lm_head",
    ]
    bases = {n: _linear(4, 8, bias=False, seed=0) for n in names}
    bases["l1.attn.v_proj"] = _linear(4, 6, bias=False, seed=0)  # another input size
    assert sibling_groups(names, bases) == [
        ["l0.attn.q_proj", "l0.attn.k_proj", "l0.attn.v_proj"],
        ["l0.attn.o_proj"],
        ["l0.mlp.gate_proj", "l0.mlp.up_proj"],
        ["l0.mlp.down_proj"],
        ["l1.attn.q_proj"],
        ["l1.attn.v_proj"],
        ["lm_head"],
    ]
    assert fusable(_linear(4, 8, bias=True, seed=0))
    assert not fusable(nn.Linear(8, 4))  # trainable
    hooked = _linear(4, 8, bias=False, seed=0)
    hooked.register_forward_hook(lambda *_: None)
    assert not fusable(hooked)


def test_a_lone_snapshot_samples_on_fused_weights_like_with_its_products(
    backend: Any, products: list[int]
) -> None:
    be = _trained(backend)
    works = [sw("sA", prompt(5, 1), num_samples=3, seed=4, max_tokens=10)]
    be.merge_lone_adapter = False  # (fp32's default merges: test_merged_sampling.py)
    assert be.fuse_lone_key is None  # fp32: products unless asked
    with_products = ok(be.sample(works)[0])
    assert products[0] > 0
    assert bank(be).lone_bytes == 0
    be.fuse_lone_key = True
    products[0] = 0
    got = ok(be.sample(works)[0])
    assert products[0] == 0  # every adapted linear layer ran in its group's one matmul
    for a, b in zip(with_products.sequences, got.sequences, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        forward = sequence_logprobs(be, "A", works[0].prompt, b.tokens)[len(works[0].prompt) - 1 :]
        np.testing.assert_allclose(b.logprobs, forward, atol=1e-4)
    held = bank(be).lone_weights("sA")
    assert held is not None
    assert held is bank(be).lone_weights("sA")
    groups = {id(g): g for g, _ in held.values()}
    assert any(len(g.sizes) == 3 for g in groups.values())  # q/k/v as one
    assert bank(be).lone_bytes == sum(g.nbytes for g in groups.values())
    # the base model alone: its layers fused, no LoRA columns
    be.create_sampler("base", TINY)
    products[0] = 0  # (the forward passes above ran the products)
    base = ok(be.sample([sw("base", prompt(5, 1), seed=4, max_tokens=6)])[0])
    assert products[0] == 0
    assert base.sequences[0].tokens
    assert all(g.a is None for g, _ in (bank(be).lone_weights(None) or {}).values())
    bank(be).lone_weights("sA")
    be.delete_sampler("sA")
    assert bank(be).lone_bytes == 0  # freed with its sampler


def test_mixed_batches_trainable_adapters_and_stale_copies_skip_the_lone_copy(
    backend: Any, products: list[int]
) -> None:
    be = _trained(backend)
    be.fuse_lone_key = True
    alone = ok(be.sample([sw("sA", prompt(4, 2), seed=1)])[0])
    assert products[0] == 0
    mixed = [ok(r) for r in be.sample([sw("sA", prompt(4, 2), seed=1), sw("sB", prompt(6, 3))])]
    # two adapters share the steps: each one's delta added per group on the shared copy
    # (segments.py) where the weights pack, else the layers' products
    assert (products[0] > 0) == (bank(be).shared_weights() is None)
    assert alone.sequences[0].tokens == mixed[0].sequences[0].tokens
    assert bank(be).lone_weights("A") is None  # a trainable adapter's factors change under it
    held = bank(be).lone_weights("sA")
    assert held is not None
    layer = next(m for m in bank(be).modules.values() if id(m) in held)
    with torch.no_grad():
        layer.base.weight.mul_(1.0)  # an in-place change of a copied base weight
    assert bank(be).lone_weights("sA") is not held  # made again, never stale


def test_bf16_weights_sample_on_fused_weights_where_the_cpu_packs_them(
    tmp_path: Any, products: list[int]
) -> None:
    """By default a bf16 model's lone snapshot samples on fused packed weights where this CPU
    has native bf16 kernels (else the products); fused or not, the tokens of the products
    (but for a draw at a boundary) and logprobs near them, which merged bf16 weights do not
    keep (docs/benchmarks.md)."""
    from tuneloop.server.engine.torch_backend import TorchBackend

    be = _trained(TorchBackend([TINY], cache_dir=tmp_path, device="cpu", dtype=torch.bfloat16))
    native = packed.packable(torch.zeros(2, 2, dtype=torch.bfloat16))
    works = [sw("sA", prompt(5, 1), num_samples=2, seed=4, max_tokens=6)]
    default = ok(be.sample(works)[0])
    assert (products[0] == 0) == native
    if native:
        held = bank(be).lone_weights("sA")
        assert held
        assert all(packed_for_kernels(g.weight) for g, _ in held.values())
        assert any(g.a is not None for g, _ in held.values())  # the delta in columns
    be.fuse_lone_key = False
    products[0] = 0
    plain = ok(be.sample(works)[0])
    assert products[0] > 0
    # The two paths' logits differ by bf16 roundings: a draw whose random number lands that
    # close to the boundary between two tokens' shares of the mass may pick either (one such
    # draw, at logprob -8, after a change to training's attention). The sequences agree up to
    # such a draw, with logprobs near, and in all but a few tokens.
    agree = 0
    for a, b in zip(default.sequences, plain.sequences, strict=True):
        same = [x == y for x, y in zip(a.tokens, b.tokens, strict=True)]
        upto = same.index(False) if False in same else len(same)
        np.testing.assert_allclose(a.logprobs[:upto], b.logprobs[:upto], atol=0.1)
        agree += sum(same)
    assert agree >= 10  # of 12
    be.close()


def test_released_lone_weights_are_freed_once_the_runner_forgets_its_routings(
    backend: Any,
) -> None:
    """A GPU's sampling call ends by dropping the lone key's copy (torch_backend.py): the copy
    is freed only if the decode steps' held routings let go of it too."""
    import gc
    import weakref

    be = _trained(backend)
    be.fuse_lone_key = True
    ok(be.sample([sw("sA", prompt(4, 2), seed=1)])[0])
    held = bank(be).lone_weights("sA")
    assert held is not None
    group = weakref.ref(next(iter(held.values()))[0])
    del held
    bank(be).release_lone()
    gc.collect()
    assert group() is not None  # still held by the runner's routings
    be._runtimes[TINY].decoder.runner.forget_routings()
    gc.collect()
    assert group() is None


def test_a_copy_too_large_for_free_memory_is_not_made_and_not_measured_every_step(
    backend: Any, products: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tuneloop.server.engine.lora import bank as bank_module

    be = _trained(backend)
    be.fuse_lone_key = True
    reads = [0]

    def full(device: Any) -> int:
        reads[0] += 1
        return 1024  # bytes free: far less than four times the weights

    monkeypatch.setattr(bank_module, "free_bytes", full)
    result = ok(be.sample([sw("sA", prompt(4, 2), seed=1, max_tokens=8)])[0])
    assert len(result.sequences[0].tokens) == 8
    assert products[0] > 0  # the products ran
    assert bank(be).lone_bytes == 0
    assert reads[0] == 1  # refused once, remembered for the next steps
