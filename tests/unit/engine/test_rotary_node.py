"""The rotary embedding as one recorded node in torch's operations (rotary.py's `_TorchRotary`):
what a model that the C++ loops do not take (fp32, a GPU, a narrow model) trains through, with
the bits of eager autograd through the family's own function, forward and backward."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

from tests.unit.engine.test_rotary import _loss_and_grads, _tiny_llama  # noqa: E402
from tuneloop.server.engine import rotary  # noqa: E402

LLAMA = "transformers.models.llama.modeling_llama"


@pytest.fixture(autouse=True)
def _restored() -> Iterator[None]:
    rotary.uninstall()  # families an earlier test's backend switched in this process
    yield
    rotary.uninstall()


def _node(q: Any, k: Any, cos: Any, sin: Any) -> Any:
    return rotary._TorchRotary.apply(q, k, cos, sin)


@pytest.mark.parametrize("family", [modeling_llama, modeling_qwen3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "tokens", "dim"), [(9, 3, 40, 64), (2, 1, 7, 6), (4, 4, 1, 32)]
)
def test_the_node_gives_eager_autograds_bits(
    family: Any, dtype: str, heads: int, kv_heads: int, tokens: int, dim: int
) -> None:
    """Outputs and the gradient of q and k as the projections' transposed views of one tensor,
    against eager autograd through the family's function: the same bits, signed zeros, NaN and
    infinities included."""
    kind = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(tokens * dim + heads)
    width = (heads + kv_heads) * dim
    both = (torch.randn(1, tokens, width, generator=gen) * 4).to(kind)
    both[0, 0, :2] = 0.0
    both[0, 0, 2:4] = -0.0
    both[0, -1, 4] = float("nan")
    angles = torch.randn((1, tokens, dim), generator=gen).mul(5)
    cos, sin = angles.cos().to(kind), angles.sin().to(kind)
    upstream = [
        (torch.randn((1, n, tokens, dim), generator=gen) * 3).to(kind) for n in (heads, kv_heads)
    ]
    upstream[0][..., :1, :] = -0.0
    upstream[1][..., -1, 0] = float("inf")

    def run(rotate: Any) -> list[Any]:
        x = both.clone().requires_grad_(True)
        q = x[..., : heads * dim].view(1, tokens, heads, dim).transpose(1, 2)
        k = x[..., heads * dim :].reshape(1, tokens, kv_heads, dim).transpose(1, 2)
        out = rotate(q, k, cos, sin)
        return [o.detach() for o in out] + list(torch.autograd.grad(out, (x,), upstream))

    got, want = run(_node), run(family.apply_rotary_pos_emb)
    bits = torch.int32 if kind == torch.float32 else torch.int16
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert g.stride() == w.stride()
        assert torch.equal(g.view(bits), w.view(bits))


def test_an_fp32_model_trains_through_the_node_with_eagers_bits() -> None:
    """Without the loops (kept off here; where they cannot be built or do not agree)."""
    model = _tiny_llama(dtype=torch.float32)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    want, want_grads = _loss_and_grads(model, ids)
    with torch.no_grad():
        logits = model(ids).logits
    own = modeling_llama.apply_rotary_pos_emb
    assert rotary.install(model, loops=False) == 1
    assert rotary.switched() == [LLAMA]
    assert rotary.installed() == []
    assert modeling_llama.apply_rotary_pos_emb is not own
    calls: list[int] = []
    backward = rotary._TorchRotary.backward

    def counted(ctx: Any, *grads: Any) -> Any:
        calls.append(1)
        return backward(ctx, *grads)

    try:
        rotary._TorchRotary.backward = staticmethod(counted)  # type: ignore[method-assign]
        got, got_grads = _loss_and_grads(model, ids)
        with torch.no_grad():  # not recorded: the family's own function
            assert torch.equal(model(ids).logits, logits)
    finally:
        rotary._TorchRotary.backward = staticmethod(backward)  # type: ignore[method-assign]
    assert len(calls) == 2  # one node a layer
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert torch.equal(a, b)
    assert rotary.uninstall() == 1
    assert modeling_llama.apply_rotary_pos_emb is own


def test_the_node_is_taken_only_in_the_dtype_it_was_probed_in() -> None:
    assert rotary.install(_tiny_llama(dtype=torch.float32), loops=False) == 1  # probed at fp32
    model = _tiny_llama(dtype=torch.float16)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    taken: list[int] = []
    apply = rotary._TorchRotary.apply

    def counted(*args: Any) -> Any:
        taken.append(1)
        return apply(*args)

    try:
        rotary._TorchRotary.apply = counted  # type: ignore[method-assign]
        _loss_and_grads(model, ids)
        assert taken == []  # fp16 never probed: the family's own function
        assert rotary.install(model) == 1  # (its probe runs the node once)
        taken.clear()
        _loss_and_grads(model, ids)
        assert len(taken) == 2
    finally:
        rotary._TorchRotary.apply = apply  # type: ignore[method-assign]


def test_what_the_node_does_not_take_is_left_to_the_family() -> None:
    q = torch.randn(1, 4, 5, 16)
    k = torch.randn(1, 2, 5, 16)
    cos, sin = torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    assert rotary._node_takes(q, k, cos, sin)
    assert not rotary._node_takes(q, k, cos.double(), sin.double())  # mixed dtypes
    assert not rotary._node_takes(q, k, cos[0], sin[0])  # cos without its batch dimension
    assert not rotary._node_takes(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15])
    assert not rotary._node_takes(q, k, cos.requires_grad_(True), sin)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_family_whose_rotary_differs_keeps_its_own(
    monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """Neither the node nor (at bf16, where a compiler builds them) the C++ loops are switched
    in for a family whose function computes something else."""

    def interleaved(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
        def turn(x: Any) -> Any:  # pairs (x0, x1), (x2, x3), ... rotated: GPT-J's layout
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)

        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + turn(q) * sin, k * cos + turn(k) * sin

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", interleaved)
    assert rotary.install(_tiny_llama(dtype=getattr(torch, dtype))) == 0
    assert modeling_llama.apply_rotary_pos_emb is interleaved
    assert rotary.switched() == []
