"""A decode batch whose rows all sample one adapter snapshot runs on its merged weights by
default at fp32 on a CPU (merging loses nothing there) and when asked (`serve
--merged-sampling`): the same tokens and, to fp32 rounding, the same logprobs as with the LoRA
products; mixed batches and trainable adapters keep the products; bf16 weights are merged only
when asked (they would round a young adapter's delta away)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.unit.engine.conftest import TINY, adapter_spec, bank, ok, train  # noqa: E402
from tests.unit.engine.test_sampler import TRAIN_DATA, prompt, sequence_logprobs, sw  # noqa: E402


def _trained(backend: Any) -> Any:
    backend.create_adapter(adapter_spec("A", rank=4, seed=1))
    backend.create_adapter(adapter_spec("B", rank=8, seed=2))
    train(backend, "A", TRAIN_DATA, 3, lr=2e-2)
    train(backend, "B", TRAIN_DATA[1:], 3, lr=2e-2)
    backend.create_sampler("sA", TINY, adapter_id="A")
    backend.create_sampler("sB", TINY, adapter_id="B")
    return backend


def test_a_lone_snapshot_samples_on_merged_weights_like_with_its_products(
    backend: Any, products: list[int]
) -> None:
    be = _trained(backend)
    # (no prompt logprobs: those are scored by a forward pass of their own, with the products)
    works = [sw("sA", prompt(5, 1), num_samples=3, seed=4, max_tokens=10)]
    be.merge_lone_adapter = False
    products[0] = 0
    with_products = ok(be.sample(works)[0])
    assert products[0] > 0
    be.merge_lone_adapter = None  # the default: merged at fp32 on a CPU
    products[0] = 0
    merged = ok(be.sample(works)[0])
    assert products[0] == 0  # every adapted linear layer ran one matmul
    for a, b in zip(with_products.sequences, merged.sequences, strict=True):
        assert a.tokens == b.tokens
        # fp32 rounding through the layers: the merged weights' kernel and the products sum
        # in other orders (up to 2.1e-6 relative, 1.2e-5 at a logprob of -5.7, on an AVX-512
        # Zen 4 EPYC over six seeds)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)
        # and they are the forward pass's
        forward = sequence_logprobs(be, "A", works[0].prompt, b.tokens)[len(works[0].prompt) - 1 :]
        np.testing.assert_allclose(b.logprobs, forward, atol=1e-4)
    held = bank(be).lone_weights("sA", merge=True)
    assert held is not None
    assert all(group.a is None for group, _ in held.values())
    assert held is bank(be).lone_weights("sA", merge=True)  # kept for the next batches
    groups = {id(group): group for group, _ in held.values()}
    assert bank(be).lone_bytes == sum(group.nbytes for group in groups.values())
    be.delete_sampler("sA")
    assert bank(be).lone_bytes == 0  # freed with its sampler


def test_mixed_batches_and_trainable_adapters_are_not_merged(
    backend: Any, products: list[int]
) -> None:
    be = _trained(backend)
    be.merge_lone_adapter = True
    products[0] = 0
    alone = [ok(r) for r in be.sample([sw("sA", prompt(4, 2), seed=1)])]
    assert products[0] == 0
    mixed = [ok(r) for r in be.sample([sw("sA", prompt(4, 2), seed=1), sw("sB", prompt(6, 3))])]
    # two adapters share the steps: no merged weights, but each one's delta added per group on
    # the shared copy (segments.py) where the weights pack, else the layers' products
    assert (products[0] > 0) == (bank(be).shared_weights() is None)
    assert bank(be).deltas("sA")
    assert bank(be).deltas("sB")
    assert alone[0].sequences[0].tokens == mixed[0].sequences[0].tokens
    assert (
        bank(be).lone_weights("A", merge=True) is None
    )  # a trainable adapter's factors change under it


def test_bf16_weights_are_merged_only_when_asked(tmp_path: Any, products: list[int]) -> None:
    """Merged bf16 weights round a young adapter's delta away (docs/benchmarks.md): by default
    a bf16 model's sampler keeps the delta's products (in its fused weights where the CPU packs
    them, test_fused_sampling.py) and makes no merged copy."""
    from tuneloop.server.engine.torch_backend import TorchBackend

    be = _trained(TorchBackend([TINY], cache_dir=tmp_path, device="cpu", dtype=torch.bfloat16))
    works = [sw("sA", prompt(5, 1), num_samples=2, seed=4, max_tokens=6)]
    be.fuse_lone_key = False
    products[0] = 0
    ok(be.sample(works)[0])
    assert products[0] > 0
    assert bank(be).lone_bytes == 0
    be.merge_lone_adapter = True
    products[0] = 0
    ok(be.sample(works)[0])
    assert products[0] == 0
    held = bank(be).lone_weights("sA", merge=True)
    assert held
    assert all(group.a is None for group, _ in held.values())
    be.close()
