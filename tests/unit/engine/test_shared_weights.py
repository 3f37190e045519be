"""A decode step whose rows use several keys takes the layers' base outputs from the base model's
stacked weights, packed for the CPU's kernels (`AdapterBank.shared_weights`), and adds each key's
LoRA delta to its rows per group (segments.py): the same tokens as the layers' own weights and
products give, logprobs to the kernels' rounding; kept beside the lone key's copy, made again
when a base weight changes, and not made where the weights do not pack."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.unit.engine.conftest import TINY, bank, ok, packed_for_kernels  # noqa: E402
from tests.unit.engine.test_merged_sampling import _trained  # noqa: E402
from tests.unit.engine.test_sampler import prompt, sw  # noqa: E402
from tuneloop.server.engine import packed  # noqa: E402
from tuneloop.server.engine.lora.bank import AdapterBank  # noqa: E402

WORKS = [
    sw("sA", prompt(4, 2), num_samples=2, seed=1, max_tokens=8),
    sw("sB", prompt(6, 3), num_samples=2, seed=2, max_tokens=8),
]


def _packs(dtype: Any) -> bool:
    return packed.packable(torch.zeros(2, 2, dtype=dtype))


fp32_packs = pytest.mark.skipif(
    not _packs(torch.float32), reason="fp32 weights are not packed on this CPU"
)


def _mixed(be: Any, products: list[int], *, deltas: bool = True) -> list[Any]:
    """WORKS sampled: on the shared weights each key's delta is added per group (segments.py)
    and no layer makes its own products; on the layers' own weights, their products."""
    products[0] = 0
    out = [ok(r) for r in be.sample(WORKS)]
    assert (products[0] == 0) == deltas
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_of_two_adapters_run_the_base_on_the_shared_packed_copy(
    tmp_path: Any, products: list[int], monkeypatch: pytest.MonkeyPatch, dtype: Any
) -> None:
    from tuneloop.server.engine.torch_backend import TorchBackend

    if not _packs(dtype):
        pytest.skip(f"{dtype} weights are not packed on this CPU")
    be = _trained(TorchBackend([TINY], cache_dir=tmp_path, device="cpu", dtype=dtype))
    calls = [0]
    original = AdapterBank.shared_weights

    def counting(self: AdapterBank) -> Any:
        calls[0] += 1
        return original(self)

    monkeypatch.setattr(AdapterBank, "shared_weights", counting)
    got = _mixed(be, products)
    assert calls[0] > 0
    shared = bank(be)._shared
    assert shared
    groups = {id(g): g for g, _ in shared.values()}
    assert all(packed_for_kernels(g.weight) and g.a is None for g in groups.values())
    assert any(len(g.sizes) == 3 for g in groups.values())  # q/k/v as one
    head = be._runtimes[TINY].model.get_output_embeddings()
    assert id(head) in shared  # the head's base part too
    assert bank(be).shared_weights() is shared  # kept for the next steps

    monkeypatch.setattr(AdapterBank, "shared_weights", lambda self: None)
    plain = _mixed(be, products, deltas=False)  # the layers' own weights and products
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for a_result, b_result in zip(got, plain, strict=True):
        for a, b in zip(a_result.sequences, b_result.sequences, strict=True):
            assert a.tokens == b.tokens
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=tolerance)
    be.close()


@fp32_packs
def test_the_shared_copy_is_kept_beside_the_lone_one_and_made_again_when_stale(
    backend: Any, products: list[int]
) -> None:
    be = _trained(backend)
    _mixed(be, products)
    shared = bank(be).shared_weights()
    assert shared
    ok(be.sample([WORKS[0]])[0])  # a step of one sampler: its merged copy, the shared one kept
    lone = bank(be).lone_weights("sA", merge=True)
    assert lone
    assert bank(be).shared_weights() is shared
    groups = {id(g): g for t in (shared, lone) for g, _ in t.values()}
    deltas = {id(d): d for key in ("sA", "sB") for d in bank(be).deltas(key).values()}
    held = [*groups.values(), *deltas.values()]
    assert deltas
    assert bank(be).lone_bytes == sum(g.nbytes for g in held)
    layer = next(m for m in bank(be).modules.values() if id(m) in shared)
    with torch.no_grad():
        layer.base.weight.mul_(1.0)  # an in-place change of a copied base weight
    again = bank(be).shared_weights()
    assert again
    assert again is not shared  # made again, never stale
    bank(be).release_lone()
    assert bank(be).lone_bytes == 0


@fp32_packs
def test_a_refused_shared_copy_is_asked_again_once_a_sampler_is_deleted(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    be = _trained(backend)
    held = bank(be)
    monkeypatch.setattr(packed, "packable", lambda weight: False)
    assert held.shared_weights() is None  # refused, and not measured again every step
    monkeypatch.undo()
    assert held.shared_weights() is None
    be.delete_sampler("sB")  # memory freed: asked again
    assert held.shared_weights()


@fp32_packs
def test_a_base_model_sampler_s_copy_serves_as_the_shared_one(
    backend: Any, products: list[int]
) -> None:
    be = _trained(backend)
    be.create_sampler("base", TINY)
    ok(be.sample([sw("base", prompt(5, 1), seed=4, max_tokens=4)])[0])
    held = bank(be).lone_weights(None, merge=True)
    assert held
    assert bank(be).shared_weights() is held  # no second copy of the same weights
    assert bank(be)._shared is None


def test_no_shared_copy_where_the_weights_do_not_pack(
    backend: Any, products: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    be = _trained(backend)
    monkeypatch.setattr(packed, "packable", lambda weight: False)
    _mixed(be, products, deltas=False)
    assert bank(be).shared_weights() is None
    assert bank(be)._shared is None
