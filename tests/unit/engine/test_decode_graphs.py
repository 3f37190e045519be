"""Decode steps on static, padded inputs (decode_graphs.py): the buckets, and the padded steps'
samples equal to the plain steps' and to HF's dense cache. On a CPU the static steps run
eagerly (no graph is captured): what is checked is everything the graph replays."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import TINY, assert_near, seq  # noqa: E402
from tests.unit.engine.test_paged_kv import check_dense, idle, with_samplers  # noqa: E402
from tests.unit.engine.test_sampler import sw  # noqa: E402
from tuneloop.server.engine.decode_graphs import (  # noqa: E402
    MAX_WIDTH,
    ROW_BUCKETS,
    row_bucket,
    width_bucket,
)


def test_buckets_hold_the_step_with_bounded_padding() -> None:
    assert [width_bucket(w) for w in (1, 64, 65, 80, 81, 128, 129, 1000)] == [
        64,
        64,
        80,
        80,
        96,
        128,
        160,
        1024,
    ]
    for width in range(1, MAX_WIDTH + 1):
        bucket = width_bucket(width)
        assert width <= bucket <= max(64, width * 1.25), width
    assert [row_bucket(r) for r in (1, 3, 5, 128, 129, 256, 257)] == [1, 4, 8, 128, 160, 256, None]
    assert list(ROW_BUCKETS) == sorted(set(ROW_BUCKETS))


@pytest.fixture
def be(backend) -> Any:
    return with_samplers(backend)


def _graphs(backend: Any) -> Any:
    return backend._runtimes[TINY].decoder.runner.graphs


def _products(backend: Any) -> None:
    """The base layers and the LoRA products in every step (no lone-key weight copies), as on
    a GPU, where static steps are used."""
    backend.merge_lone_adapter = False
    backend.fuse_lone_key = False


def test_static_steps_sample_what_the_plain_steps_do(be) -> None:
    """Requests of an adapter and of the base model, 5 decode rows (3 pad rows in the bucket of
    8, the pad rows on the last row's adapter), contexts growing across width buckets: every
    sample's tokens are the plain steps', logprobs within fp32 rounding, and each equals HF's
    dense decoding. The pool's zero pad slot stays zero (pad rows write a scratch slot), and a
    plain run afterwards is unchanged."""
    _products(be)
    works = [
        sw("sA", seq(6, 30), num_samples=2, max_tokens=12, seed=1),
        sw("base", seq(9, 31), max_tokens=12, seed=2, temperature=0.7),
        sw("sA", seq(60, 32), num_samples=2, max_tokens=12, seed=3),
    ]
    be.decode_graphs = False
    plain = be.sample(works)
    assert _graphs(be) is None  # never asked for
    be.decode_graphs = True
    static = be.sample(works)
    graphs = _graphs(be)
    assert graphs is not None
    assert graphs.replayed > 0  # the decode steps ran on the static inputs
    assert graphs.captured == 0  # a CPU captures nothing
    assert len(graphs) >= 2  # contexts of 61 and 72 tokens: widths 64 and 80
    tokens = [[s.tokens for s in r.sequences] for r in static]
    assert tokens == [[s.tokens for s in r.sequences] for r in plain]
    assert_near(
        [[s.logprobs for s in r.sequences] for r in static],
        [[s.logprobs for s in r.sequences] for r in plain],
        1e-5,
        "static decode steps",
    )
    check_dense(be, works, static)
    pool = be._runtimes[TINY].decoder.runner.pool
    for tensors in (pool.keys, pool.values):  # pad rows wrote the scratch slot, never the pad
        assert all(not t[pool.pad_slot].any() for t in tensors.values())
        assert all(t[pool.scratch_slot].any() for t in tensors.values())
    be.decode_graphs = False
    replayed, made = graphs.replayed, len(graphs)
    again = be.sample(works)
    assert [[s.tokens for s in r.sequences] for r in again] == tokens
    assert graphs.replayed == replayed  # off: plain steps
    be.decode_graphs = True
    be.sample(works)
    assert _graphs(be) is graphs  # kept while off: the same static steps serve again
    assert len(graphs) == made
    assert graphs.replayed > replayed
    idle(be)


def test_static_steps_are_kept_while_their_adapters_are_the_same(be) -> None:
    """A static step serves later calls of the same sampler; after the sampler is made again
    under its id from a further-trained adapter, a new one is made and its samples follow the
    new factors (HF's dense decoding with them)."""
    from tests.unit.engine.conftest import example, train

    _products(be)
    be.decode_graphs = True
    work = sw("sA", seq(6, 30), num_samples=3, max_tokens=4, seed=1)
    be.sample([work])
    graphs = _graphs(be)
    (first,) = graphs._steps.values()
    be.sample([work])
    assert list(graphs._steps.values()) == [first]
    train(be, "A", [example(seq(16, 11))], 2, lr=5e-2)
    be.delete_sampler("sA")
    be.create_sampler("sA", TINY, adapter_id="A")
    results = be.sample([work])
    (second,) = graphs._steps.values()
    assert second is not first
    check_dense(be, [work], results)
    bank = be._runtimes[TINY].bank
    assert bank.version("A") is None  # trainable: a graph never reads it
    assert bank.version(None) == 0
    assert isinstance(bank.version("sA"), int)


def test_steps_with_lone_key_weights_stay_plain(be) -> None:
    """A CPU's lone-key weight copies (merged at fp32) are not what a static step reads: those
    steps run as they are."""
    be.merge_lone_adapter = True
    be.decode_graphs = True
    results = be.sample([sw("sA", seq(6, 30), num_samples=2, max_tokens=4, seed=1)])
    assert _graphs(be).replayed == 0
    check_dense(be, [sw("sA", seq(6, 30), num_samples=2, max_tokens=4, seed=1)], results)
