"""The rotary embedding by the C++ loops (rotary.py): the bits of the model families' own
`apply_rotary_pos_emb`, forward and, where autograd records it, backward, switched in for
families whose function agrees, and back on `uninstall`. Skipped where the loops cannot be
built."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

from tuneloop.server.engine import native, rotary  # noqa: E402

pytestmark = pytest.mark.skipif(rotary.native_kernel() is None, reason="no C++ compiler here")


@pytest.fixture(autouse=True)
def _restored() -> Iterator[None]:
    rotary.uninstall()  # families an earlier test's backend switched in this process
    yield
    rotary.uninstall()


def _inputs(
    heads: int,
    kv_heads: int,
    tokens: int,
    dim: int,
    seed: int,
    scale: float = 4.0,
    dtype: Any = None,
) -> tuple[Any, ...]:
    """q and k as the projections' transposed views, cos and sin of random angles, in `dtype`
    (bf16 by default)."""
    dtype = dtype or torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((1, tokens, heads, dim), generator=gen).mul(scale).to(dtype).transpose(1, 2)
    k = torch.randn((1, tokens, kv_heads, dim), generator=gen).mul(scale)
    angles = torch.randn((1, tokens, dim), generator=gen).mul(5)
    return q, k.to(dtype).transpose(1, 2), angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", [modeling_llama, modeling_qwen3])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "tokens", "dim"),
    [(9, 3, 128, 64), (8, 2, 7, 128), (4, 4, 1, 32), (2, 1, 33, 6)],
)
def test_the_loop_gives_the_families_bits(
    family: Any, heads: int, kv_heads: int, tokens: int, dim: int, dtype: Any
) -> None:
    """bf16 and fp32 (an fp32 model's sampling steps): each product and the sum rounded as
    eager's operations round them, so the same bits."""
    q, k, cos, sin = _inputs(heads, kv_heads, tokens, dim, seed=heads * tokens + dim, dtype=dtype)
    q[0, 0, 0, :2] = torch.tensor([float("nan"), 3e38])  # NaN kept, overflow to inf as eager
    own = family.apply_rotary_pos_emb
    got = rotary.rotate(q, k, cos, sin)
    assert got is not None
    want = own(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert torch.equal(g.nan_to_num(), w.nan_to_num())
        assert torch.equal(g.isnan(), w.isnan())
    # laid out as eager lays out its results: [tokens, heads, dim] in memory
    assert got[0][0].transpose(0, 1).is_contiguous()


def test_what_the_loop_does_not_take_is_left_to_the_family() -> None:
    q, k, cos, sin = _inputs(4, 2, 5, 16, seed=1)
    assert rotary.rotate(q.float(), k, cos, sin) is None  # dtypes mixed
    assert rotary.rotate(q.half(), k.half(), cos.half(), sin.half()) is None  # no fp16 loop
    assert rotary.rotate(q, k, cos[0], sin[0]) is None  # cos without its batch dimension
    assert rotary.rotate(torch.cat([q, q]), torch.cat([k, k]), cos, sin) is None  # a batch of 2
    odd = _inputs(4, 2, 5, 15, seed=2)
    assert rotary.rotate(*odd) is None
    assert rotary.rotate(q.requires_grad_(True), k, cos, sin) is None


def _tiny_llama(act: str = "silu", dtype: Any = None) -> Any:
    """A 2-layer Llama 64 wide of seeded random weights, bf16 unless `dtype` says."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        hidden_act=act,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype or torch.bfloat16).eval()


def test_a_switched_family_samples_the_same_logits() -> None:
    model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids).logits
    own = modeling_llama.apply_rotary_pos_emb
    assert rotary.install(model) == 1
    assert rotary.installed() == ["transformers.models.llama.modeling_llama"]
    assert modeling_llama.apply_rotary_pos_emb is not own
    assert rotary.install(model) == 1  # a second model of the family: switched already
    calls: list[int] = []
    rotate = rotary.rotate

    def counted(*args: Any) -> Any:
        calls.append(1)
        return rotate(*args)

    try:
        rotary.rotate = counted  # type: ignore[assignment]
        with torch.no_grad(), native.sampling_step():
            inside = model(ids).logits
        assert len(calls) == 2  # one call a layer
        assert torch.equal(inside, before)
    finally:
        rotary.rotate = rotate  # type: ignore[assignment]
    assert rotary.uninstall() == 1
    assert modeling_llama.apply_rotary_pos_emb is own


def _loss_and_grads(model: Any, ids: Any) -> tuple[Any, list[Any]]:
    model.zero_grad()
    loss = model(ids).logits.float().logsumexp(-1).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_switched_family_trains_through_the_loops_with_eagers_gradients(dtype: Any) -> None:
    """Where autograd records q and k the rotation is one node of the loops (`_Rotary`): the
    loss and every weight's gradient are the unswitched model's bit for bit."""
    model = _tiny_llama(dtype=dtype)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    want, want_grads = _loss_and_grads(model, ids)
    assert rotary.install(model) == 1
    calls: list[Any] = []
    kernel = rotary.backward_kernel(dtype)

    def counted(kind: Any = torch.bfloat16) -> Any:
        def call(*args: Any) -> Any:
            calls.append(kind)
            return kernel(*args)

        return call

    backward_kernel = rotary.backward_kernel
    try:
        rotary.backward_kernel = counted  # type: ignore[assignment]
        got, got_grads = _loss_and_grads(model, ids)
    finally:
        rotary.backward_kernel = backward_kernel  # type: ignore[assignment]
    assert calls == [dtype] * 2  # one backward call a layer
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "tokens", "dim"), [(9, 3, 300, 64), (2, 1, 7, 6)])
def test_the_backward_loop_gives_eager_autograds_bits(
    heads: int, kv_heads: int, tokens: int, dim: int, dtype: Any
) -> None:
    """The gradients of q and k, as the projections' transposed views of one tensor, against
    eager autograd's through the family's function: the same bits, signed zeros included."""
    gen = torch.Generator().manual_seed(tokens)
    width = (heads + 2 * kv_heads) * dim
    both = (torch.randn(1, tokens, width, generator=gen) * 4).to(dtype)
    both[0, :2] = 0.0
    both[0, 2:4] = -0.0
    angles = torch.randn((1, tokens, dim), generator=gen).mul(5)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    upstream = [
        torch.randn((1, n, tokens, dim), generator=gen).to(dtype) for n in (heads, kv_heads)
    ]
    upstream[0][..., :3, :] = -0.0

    def grads(rotate: Any) -> list[Any]:
        x = both.clone().requires_grad_(True)
        q = x[..., : heads * dim].view(1, tokens, heads, dim).transpose(1, 2)
        k = x[..., heads * dim : (heads + kv_heads) * dim]
        k = k.reshape(1, tokens, kv_heads, dim).transpose(1, 2)
        out = rotate(q, k, cos, sin)
        return [*out, *torch.autograd.grad(out, (x,), upstream)]

    got, want = grads(rotary._Rotary.apply), grads(modeling_llama.apply_rotary_pos_emb)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(bits), w.view(bits))


def test_each_dtypes_loop_is_probed_for_its_models() -> None:
    """An fp32 model's family takes the fp32 loops (sampling steps, and as the recorded node
    where autograd records the rotation, once that agrees too) and torch's node beside them
    (test_rotary_node.py); an fp16 model's the node only; a bf16 model's the loops, forward
    and backward, unless the caller keeps them off."""
    name = "transformers.models.llama.modeling_llama"
    assert rotary.install(_tiny_llama().half()) == 1
    assert rotary.installed(torch.float16) == []
    assert rotary.install(_tiny_llama().float()) == 1
    assert rotary.installed(torch.float32) == [name]
    assert rotary.installed() == []
    assert rotary.switched() == [name]
    assert (torch.float32, "cpu") in rotary._NODES[name]
    assert rotary._LOOPED_NODES[name] == {torch.float32}
    assert rotary.install(_tiny_llama(), loops=False) == 1
    assert rotary.installed() == []
    assert rotary.install(_tiny_llama()) == 1
    assert rotary.installed() == ["transformers.models.llama.modeling_llama"]


def test_an_fp32_model_samples_through_the_loop_and_trains_through_the_loops_node() -> None:
    """At fp32 the loop runs in sampling steps (inputs autograd does not record), with the
    unswitched model's logits bit for bit; training records the loops' node, with eager's loss
    and gradients."""
    model = _tiny_llama(dtype=torch.float32)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids).logits
    want, want_grads = _loss_and_grads(model, ids)
    assert rotary.install(model) == 1
    calls: list[int] = []
    rotate = rotary.rotate

    def counted(*args: Any) -> Any:
        out = rotate(*args)
        calls.append(out is not None)
        return out

    try:
        rotary.rotate = counted  # type: ignore[assignment]
        with torch.no_grad(), native.sampling_step():
            inside = model(ids).logits
    finally:
        rotary.rotate = rotate  # type: ignore[assignment]
    assert calls == [True, True]  # one loop call a layer
    assert torch.equal(inside, before)
    got, got_grads = _loss_and_grads(model, ids)
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert torch.equal(a, b)
