"""A worker group of 2 gloo ranks on the CPU computes what the single-process backend computes.

Same tiny model, same data: per-request losses and per-datum logprobs, gradient accumulation
over several forward_backward calls, optim_step metrics and the adapter weights after several
steps, seeded sampling from a snapshot. Then recovery: a worker SIGKILLed between
forward_backward and optim_step (the watchdog restarts the group between calls) and one killed
while a call waits on it; the result still equals the undisturbed run's.

Tolerance: float32 sums taken in another order (each rank sums its shard's gradients, then the
all-reduce adds the two) differ in the last bits: 1e-5 relative on losses, logprobs and grad
norms (measured ~3e-8). Weights: 1e-4 absolute, 1% of the learning rate (1e-2): AdamW divides
each gradient element by its own running magnitude, so an element whose gradient is at the
rounding-noise level moves by a noticeable fraction of a step either way (measured 1.3e-5).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import (  # noqa: E402
    TINY,
    adam,
    adapter_spec,
    assert_near,
    example,
    ok,
    seq,
    work,
)
from tuneloop.server.engine.checkpoints import read_factors  # noqa: E402
from tuneloop.server.engine.types import EngineError, SampleWork  # noqa: E402
from tuneloop.server.engine.workers.sharding import shard_batch  # noqa: E402

TOL = 1e-5
WEIGHT_TOL = 1e-4
# For the recovery test's larger learning rates (5e-2, 1e-1). A rank's share of a batch sums
# apart from the one process's whole batch (rounding ~1e-7 of a gradient), and Adam amplifies
# that in the few entries whose moment is a near-cancelling sum of steps of both signs: 10-17
# entries of 512 differed by up to 1.5e-4 on an AMX Xeon (under 1e-4 on the CPUs before). A lost or
# doubled replayed batch moves weights by ~lr.
RECOVERY_WEIGHT_TOL = 1e-3


def _batch(step: int, adapters: tuple[str, ...]) -> list[Any]:
    """Requests of uneven lengths for each adapter, and one forward-only request."""
    works = []
    for k, adapter in enumerate(adapters):
        lengths = [23, 5, 14, 9, 31][: 3 + k]
        works.append(
            work(adapter, [example(seq(n + 1, 10 * step + i + k)) for i, n in enumerate(lengths)])
        )
    works.append(work(adapters[0], [example(seq(12, 99 + step))], forward_only=True))
    return works


def _weights(be: Any, adapter_id: str, directory: Path) -> dict[str, Any]:
    be.save_state(adapter_id, directory, optimizer=True)
    return read_factors(directory)


def _run(be: Any, prefix: str, steps: int, out: Path) -> dict[str, Any]:
    """Two adapters sharing batches, two forward_backward calls per optim_step."""
    adapters = (f"{prefix}a", f"{prefix}b")
    for i, adapter in enumerate(adapters):
        be.create_adapter(adapter_spec(adapter, rank=4, seed=i))
    record: dict[str, Any] = {"losses": [], "logprobs": [], "metrics": []}
    for step in range(steps):
        for half in range(2):
            results = [ok(r) for r in be.forward_backward(_batch(2 * step + half, adapters))]
            record["losses"].append([r.metrics["loss:sum"] for r in results])
            record["logprobs"].append([lp for r in results for lp in r.logprobs])
        for adapter in adapters:
            record["metrics"].append(be.optim_step(adapter, adam(1e-2, grad_clip_norm=1.0)))
    record["weights"] = {a: _weights(be, a, out / a) for a in adapters}
    return record


def _compare(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert_near(got["losses"], want["losses"], TOL, "loss sums", relative=True)
    assert_near(got["logprobs"], want["logprobs"], TOL, "logprobs", relative=True)
    assert_near(
        [m["grad_norm"] for m in got["metrics"]],
        [m["grad_norm"] for m in want["metrics"]],
        TOL,
        "grad norms",
        relative=True,
    )
    for adapter_g, adapter_w in zip(got["weights"], want["weights"], strict=True):
        assert_near(got["weights"][adapter_g], want["weights"][adapter_w], WEIGHT_TOL, "weights")


def test_data_parallel_equals_single_process(group: Any, single: Any, tmp_path: Path) -> None:
    assert group.size == 2
    got = _run(group, "dp-", 3, tmp_path / "group")
    want = _run(single, "sp-", 3, tmp_path / "single")
    _compare(got, want)
    # the adapters moved: an equality of untrained weights would prove nothing
    assert (
        max(float(t.abs().max()) for k, t in want["weights"]["sp-a"].items() if "lora_B" in k)
        > 1e-3
    )


def _samples(be: Any, sampler_id: str) -> list[Any]:
    works = [
        SampleWork(sampler_id, seq(6 + i, 200 + i), 2, 6, 1.0, -1, 1.0, i, (), ()) for i in range(4)
    ]
    return [ok(r) for r in be.sample(works)]


def test_sampling_spread_over_workers_matches_single(group: Any, single: Any) -> None:
    for be, prefix in ((group, "g-"), (single, "s-")):
        be.create_adapter(adapter_spec(prefix + "sam", rank=4, seed=3))
        ok(be.forward_backward([work(prefix + "sam", [example(seq(20, 5))])])[0])
        be.optim_step(prefix + "sam", adam(1e-1))
        be.create_sampler(prefix + "snap", TINY, adapter_id=prefix + "sam")
    got, want = _samples(group, "g-snap"), _samples(single, "s-snap")
    assert [[s.tokens for s in r.sequences] for r in got] == [
        [s.tokens for s in r.sequences] for r in want
    ]
    assert_near(
        [[s.logprobs for s in r.sequences] for r in got],
        [[s.logprobs for s in r.sequences] for r in want],
        TOL,
        "sampled logprobs",
    )


def test_load_state_delete_and_disk_samplers_reach_every_rank(group: Any, tmp_path: Path) -> None:
    data = [example(seq(n, 500 + n)) for n in (25, 11, 6)]
    group.create_adapter(adapter_spec("ld-src", rank=4, seed=2))
    ok(group.forward_backward([work("ld-src", data)])[0])
    group.optim_step("ld-src", adam(1e-2))
    group.save_state("ld-src", tmp_path / "saved", optimizer=True)
    group.create_adapter(adapter_spec("ld-dst", rank=4, seed=5))
    group.load_state("ld-dst", tmp_path / "saved", optimizer=True)
    for adapter in ("ld-src", "ld-dst"):  # the loaded one continues exactly like its source
        ok(group.forward_backward([work(adapter, data)])[0])
        group.optim_step(adapter, adam(1e-2))
    assert_near(
        _weights(group, "ld-src", tmp_path / "a"), _weights(group, "ld-dst", tmp_path / "b"), 0.0
    )
    group.create_sampler("ld-disk", TINY, weights_dir=tmp_path / "a")
    group.create_sampler("ld-live", TINY, adapter_id="ld-src")
    assert [[s.tokens for s in r.sequences] for r in _samples(group, "ld-disk")] == [
        [s.tokens for s in r.sequences] for r in _samples(group, "ld-live")
    ]
    group.delete_adapter("ld-dst")
    [gone] = group.forward_backward([work("ld-dst", data)])
    assert isinstance(gone, EngineError)
    assert gone.category == "user"
    with pytest.raises(EngineError, match="no adapter"):
        group.load_state("ld-dst", tmp_path / "saved", optimizer=True)


def test_a_request_failing_on_one_rank_leaves_no_gradient_on_the_other(
    group: Any, single: Any, tmp_path: Path
) -> None:
    """A request whose datums land on both ranks and whose loss is not finite on one of them
    fails as in one process, and its share of gradients on the other rank is taken back."""
    good = [example(seq(n, 700 + n)) for n in (29, 6)]
    bad = [
        example(seq(30, 800)),
        example(seq(28, 801), weights=np.full(27, np.inf, np.float32)),
    ]
    # the bad request's two datums land on different ranks: only one of them fails
    shards = shard_batch([work("x", good), work("x", bad)], 2)
    assert [[p.examples for p in parts if p.work_index == 1] for parts in shards] == [
        [(0,)],
        [(1,)],
    ]
    for be, prefix in ((group, "f-"), (single, "fs-")):
        be.create_adapter(adapter_spec(prefix + "x", rank=4, seed=9))
        ok(be.forward_backward([work(prefix + "x", [example(seq(20, 2))])])[0])
        be.optim_step(prefix + "x", adam(1e-1))  # B != 0: every factor gets a gradient
    results = {}
    for be, prefix in ((group, "f-"), (single, "fs-")):
        results[prefix] = be.forward_backward([work(prefix + "x", good), work(prefix + "x", bad)])
        be.optim_step(prefix + "x", adam(1e-2))
    for prefix in ("f-", "fs-"):
        assert isinstance(results[prefix][1], EngineError)
        assert "not finite" in str(results[prefix][1])
    assert_near(
        ok(results["f-"][0]).metrics["loss:sum"],
        ok(results["fs-"][0]).metrics["loss:sum"],
        TOL,
        "loss",
        relative=True,
    )
    assert_near(
        _weights(group, "f-x", tmp_path / "g"),
        _weights(single, "fs-x", tmp_path / "s"),
        WEIGHT_TOL,
        "weights",
    )


def test_a_poisoned_sampler_fails_alone_on_its_rank(
    group: Any, single: Any, tmp_path: Path
) -> None:
    """A sampler whose (finite) weights overflow the logits, sampled in one batch with others
    spread over both ranks: it fails alone, as a user error; the others get what one process
    gives them alone."""
    from safetensors.torch import load_file, save_file

    from tuneloop.server.engine.checkpoints import ADAPTER_FILE
    from tuneloop.server.engine.isolation import NON_FINITE_LOGITS

    for be, prefix in ((group, "pz-"), (single, "pzs-")):
        be.create_adapter(adapter_spec(prefix + "a", rank=4, seed=4))
        ok(be.forward_backward([work(prefix + "a", [example(seq(20, 6))])])[0])
        be.optim_step(prefix + "a", adam(1e-1))
        be.create_sampler(prefix + "good", TINY, adapter_id=prefix + "a")
    group.save_sampler_weights("pz-a", tmp_path / "huge")
    factors = load_file(str(tmp_path / "huge" / ADAPTER_FILE))
    save_file({k: v * 1e30 for k, v in factors.items()}, str(tmp_path / "huge" / ADAPTER_FILE))
    group.create_sampler("pz-huge", TINY, weights_dir=tmp_path / "huge")
    victims = [
        SampleWork("pz-good", seq(6 + i, 210 + i), 2, 6, 1.0, -1, 1.0, i, (), ()) for i in range(3)
    ]
    bad = [SampleWork("pz-huge", seq(7, 220 + i), 1, 6, 1.0, -1, 1.0, i, (), ()) for i in range(2)]
    results = group.sample([victims[0], bad[0], victims[1], bad[1], victims[2]])
    for result in (results[1], results[3]):
        assert isinstance(result, EngineError)
        assert result.category == "user"
        assert str(result) == NON_FINITE_LOGITS
    for mine, w in zip((results[0], results[2], results[4]), victims, strict=True):
        [alone] = single.sample([SampleWork("pzs-good", *_fields(w))])
        assert [s.tokens for s in ok(mine).sequences] == [s.tokens for s in ok(alone).sequences]


def _fields(w: SampleWork) -> tuple[Any, ...]:
    return (w.prompt, w.num_samples, w.max_tokens, w.temperature, w.top_k, w.top_p, w.seed, (), ())


def test_a_step_that_would_overflow_is_skipped_on_every_rank(
    group: Any, single: Any, tmp_path: Path
) -> None:
    """beta2 = 0 and a tiny eps: the second step divides a remembered huge gradient by ~eps.
    Both ranks skip it alike; the adapter stays finite and equal to one process's."""
    from tuneloop.server.engine.isolation import SKIPPED

    huge = adam(1e-2, beta2=0.0, eps=1e-30)
    big = [example(seq(20, 7), weights=np.full(19, 1e15, np.float32))]
    metrics = {}
    for be, prefix in ((group, "sk-"), (single, "sks-")):
        be.create_adapter(adapter_spec(prefix + "a", rank=4, seed=5))
        ok(be.forward_backward([work(prefix + "a", big)])[0])
        assert SKIPPED not in be.optim_step(prefix + "a", huge)
        metrics[prefix] = be.optim_step(prefix + "a", huge)  # no new gradient: overflows
    for prefix in ("sk-", "sks-"):
        assert metrics[prefix][SKIPPED] == 1.0
        assert metrics[prefix][SKIPPED + "_nonfinite_weights"] == 1.0
    got = _weights(group, "sk-a", tmp_path / "g")
    assert all(bool(torch.isfinite(t).all()) for t in got.values())
    assert_near(got, _weights(single, "sks-a", tmp_path / "s"), WEIGHT_TOL, "weights")
    # It trains on as before.
    ok(group.forward_backward([work("sk-a", [example(seq(12, 8))])])[0])
    assert SKIPPED not in group.optim_step("sk-a", adam(1e-2))


def _wait_for(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_worker_killed_between_calls_and_during_one(
    group: Any, single: Any, tmp_path: Path
) -> None:
    """Kill between forward_backward and optim_step (gradients replayed), then during a call:
    the results equal the single-process run's, and the sampler survives."""
    for be, prefix in ((group, "k-"), (single, "ks-")):
        be.create_adapter(adapter_spec(prefix + "x", rank=4, seed=7))
        be.create_sampler(prefix + "base", TINY)
        ok(be.forward_backward([work(prefix + "x", [example(seq(30, 1))])])[0])
        be.optim_step(prefix + "x", adam(1e-1))
        be.create_sampler(prefix + "snap", TINY, adapter_id=prefix + "x")  # restored from host
    data = [example(seq(n, 300 + n)) for n in (40, 9, 17)]
    for be, prefix in ((group, "k-"), (single, "ks-")):
        ok(be.forward_backward([work(prefix + "x", data)])[0])
    restarts = group.restarts
    os.kill(group.worker_pids()[1], signal.SIGKILL)
    _wait_for(lambda: group.restarts > restarts)  # the watchdog restarted the group
    assert group.last_recovery_s is not None
    got = [group.optim_step("k-x", adam(5e-2))]
    want = [single.optim_step("ks-x", adam(5e-2))]

    # Now during a call: many forward_backward calls from another thread, a kill among them
    # once the first has come back (later calls are then in flight or about to be sent).
    calls = 12
    results: list[Any] = []

    def train() -> None:
        for _ in range(calls):
            results.append(ok(group.forward_backward([work("k-x", data)])[0]))

    thread = threading.Thread(target=train)
    generation = group.generation
    thread.start()
    _wait_for(lambda: len(results) >= 1)
    os.kill(group.worker_pids()[0], signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive()
    # On a fast machine the last calls may finish before the death is seen: then the watchdog
    # restarts the group between calls instead.
    _wait_for(lambda: group.generation > generation)
    got.append(group.optim_step("k-x", adam(5e-2)))
    for _ in range(calls):
        ok(single.forward_backward([work("ks-x", data)])[0])
    want.append(single.optim_step("ks-x", adam(5e-2)))
    assert len(results) == calls
    assert_near(
        [m["grad_norm"] for m in got],
        [m["grad_norm"] for m in want],
        TOL,
        "grad norms",
        relative=True,
    )
    assert_near(
        _weights(group, "k-x", tmp_path / "g"),
        _weights(single, "ks-x", tmp_path / "s"),
        RECOVERY_WEIGHT_TOL,
        "weights",
    )
    assert [[s.tokens for s in r.sequences] for r in _samples(group, "k-snap")] == [
        [s.tokens for s in r.sequences] for r in _samples(single, "ks-snap")
    ]
    [sampled] = group.sample([SampleWork("k-base", seq(5, 1), 1, 3, 1.0, -1, 1.0, 0, (), ())])
    assert len(ok(sampled).sequences[0].tokens) == 3
    status = (group._state_dir / "workers.json").read_text()
    assert str(group.worker_pids()[0]) in status
