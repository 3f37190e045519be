"""A CPU micro-batch as two parts on two threads (training.split): the rows split by tokens,
every request's loss, logprobs and gradients as in one pass, the same bits run after run, and a
request failing in one part trained in neither."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import (  # noqa: E402
    adam,
    adapter_spec,
    assert_near,
    bank,
    example,
    grads,
    ok,
    seq,
    work,
)
from tests.unit.engine.test_failure_isolation import assert_not_finite_alone  # noqa: E402
from tuneloop.server.engine import training  # noqa: E402
from tuneloop.server.engine.types import EngineError  # noqa: E402

DATA = [example(seq(n, 40 + n)) for n in (30, 12, 25, 9, 18)]


def _rows(*lengths: int) -> list[training.TrainRow]:
    return [training.TrainRow(0, "A", np.zeros(n, np.int64)) for n in lengths]


class _Runtime:
    device = torch.device("cpu")


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch, two_threads: None) -> None:
    """Two torch threads, and parts as small as the tiny model's sequences."""
    monkeypatch.setattr(training, "SPLIT_MIN_TOKENS", 8)


@pytest.fixture
def whole(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A switch: `whole(True)` runs micro-batches in one pass."""

    def switch(on: bool) -> None:
        monkeypatch.setattr(training, "_SPLIT", not on)

    return switch


def test_split_balances_tokens_and_keeps_row_order(small_parts: None) -> None:
    runtime: Any = _Runtime()
    # 81 tokens: 10 + 30 = 40 against 9 + 20 + 12 = 41, the part with the longest row first
    assert training.split(runtime, _rows(10, 30, 9, 20, 12)) == [[0, 1], [2, 3, 4]]
    assert training.split(runtime, _rows(40, 8)) == [[0], [1]]
    assert training.split(runtime, _rows(40, 7)) == [[0, 1]]  # a part below the minimum
    assert training.split(runtime, _rows(40)) == [[0]]


def test_split_finds_the_most_even_token_counts(small_parts: None) -> None:
    """Where longest-first-to-the-lighter-part leaves the parts apart (8 -> a, 7 -> b, 6 -> b,
    5 -> a, 4: 17 against 13), the split is the most even one (15 and 15); on random batches
    the parts are as close as the best of every split of the rows."""
    runtime: Any = _Runtime()
    assert training.split(runtime, _rows(8, 7, 6, 5, 4)) == [[0, 1], [2, 3, 4]]
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(8, 256) for _ in range(rng.randint(2, 10))]
        parts = training.split(runtime, _rows(*lengths))
        if len(parts) == 1:
            continue
        assert sorted(parts[0] + parts[1]) == list(range(len(lengths)))
        gap = abs(sum(lengths[i] for i in parts[0]) - sum(lengths[i] for i in parts[1]))
        best = min(
            abs(sum(n for n, pick in zip(lengths, picks, strict=True) if pick) * 2 - sum(lengths))
            for picks in itertools.product((0, 1), repeat=len(lengths))
        )
        assert gap == best


def test_split_needs_two_threads_and_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(training, "SPLIT_MIN_TOKENS", 8)
    runtime: Any = _Runtime()
    torch.set_num_threads(1)  # (the session's default here)
    assert training.split(runtime, _rows(30, 30)) == [[0, 1]]
    cuda: Any = type("Cuda", (), {"device": torch.device("cuda")})()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert training.split(cuda, _rows(30, 30)) == [[0, 1]]
        assert training.split(runtime, _rows(30, 30)) == [[0], [1]]
    finally:
        torch.set_num_threads(threads)


def test_the_environment_switches_parts_off(
    small_parts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Any = _Runtime()
    monkeypatch.setenv(training.PARTS_VARIABLE, "0")
    assert training.split(runtime, _rows(30, 30)) == [[0, 1]]
    monkeypatch.setenv(training.PARTS_VARIABLE, "1")
    assert training.split(runtime, _rows(30, 30)) == [[0], [1]]


def test_part_threads() -> None:
    assert training.part_threads(1) == ()
    assert training.part_threads(2) == (1, 1)
    assert training.part_threads(5) == (3, 2)


@pytest.mark.parametrize("use", ["torch", "use_threads"])
def test_a_new_threads_count_holds_after_another_thread_sets_its_own(use: str) -> None:
    """torch sets a new thread's count at its first read, to the count any thread set last:
    torch.set_num_threads alone on the helper's first pass is undone by the engine thread
    setting its own count in between; `use_threads` holds."""
    import threading

    set_count = torch.set_num_threads if use == "torch" else training.use_threads
    outer = torch.get_num_threads()
    ready, go = threading.Event(), threading.Event()
    seen: list[int] = []

    def helper() -> None:
        set_count(1)
        ready.set()
        go.wait()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=helper)
    thread.start()
    ready.wait()
    try:
        torch.set_num_threads(2)  # the engine thread's part
        go.set()
        thread.join()
    finally:
        torch.set_num_threads(outer)
    assert seen == ([2] if use == "torch" else [1])


def _fresh(backend: Any, *ids: str) -> None:
    for adapter_id in ids:
        if adapter_id in bank(backend).specs:
            backend.delete_adapter(adapter_id)
        backend.create_adapter(adapter_spec(adapter_id, rank=4, seed=ord(adapter_id)))


def _pass(backend: Any, works: list[Any]) -> tuple[list[Any], dict[str, list[Any]]]:
    _fresh(backend, *dict.fromkeys(w.adapter_id for w in works))
    results = backend.forward_backward(works)
    return results, {w.adapter_id: grads(backend, w.adapter_id) for w in works}


@pytest.mark.parametrize("packed", [True, False])
def test_two_parts_train_as_one_pass(
    backend: Any, small_parts: None, whole: Any, packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests of two adapters, their datums across both parts: each request's loss,
    logprobs and gradients as the whole micro-batch's in one pass, a forward-only request's
    logprobs too."""
    [runtime] = backend._runtimes.values()
    runtime.packed = packed and runtime.packed
    works = [
        work("A", DATA[:3]),
        work("B", DATA[3:]),
        work("A", DATA[1:2], forward_only=True),
    ]
    whole(True)
    expected, expected_grads = _pass(backend, works)
    whole(False)
    in_parts = training._in_parts
    calls: list[int] = []

    def spy(*args: Any) -> None:
        calls.append(len(args[2]))
        in_parts(*args)

    monkeypatch.setattr(training, "_in_parts", spy)
    results, got_grads = _pass(backend, works)
    assert calls == [2]
    for mine, one in zip(results, expected, strict=True):
        mine, one = ok(mine), ok(one)
        assert mine.metrics["loss:sum"] == pytest.approx(one.metrics["loss:sum"], rel=1e-5)
        assert [len(x) for x in mine.logprobs] == [len(x) for x in one.logprobs]
        assert_near(mine.logprobs, one.logprobs, 1e-5, "logprobs")
    for key in ("A", "B"):
        assert_near(got_grads[key], expected_grads[key], 1e-5, f"grads {key}", relative=True)


def test_two_parts_give_the_same_bits_every_run(backend: Any, small_parts: None) -> None:
    works = [work("A", DATA)]
    first, first_grads = _pass(backend, works)
    for _ in range(3):
        again, again_grads = _pass(backend, works)
        assert ok(again[0]).metrics == ok(first[0]).metrics
        for a, b in zip(ok(again[0]).logprobs, ok(first[0]).logprobs, strict=True):
            assert np.array_equal(a, b)
        for a, b in zip(again_grads["A"], first_grads["A"], strict=True):
            assert torch.equal(a, b)


def test_a_request_not_finite_in_one_part_trains_in_neither(
    backend: Any, small_parts: None, whole: Any
) -> None:
    """B's first datum is fine and lands in one part, its second has an infinite weight and
    lands in the other: B fails with nothing accumulated, A gets what it gets alone."""
    good = work("A", DATA[:3])
    bad = example(seq(20, 77), weights=np.full(19, np.inf, np.float32))
    mixed = work("B", [DATA[3], bad])
    [runtime] = backend._runtimes.values()
    rows = [training.TrainRow(i, "", d.tokens) for i, d in enumerate([*DATA[:3], DATA[3], bad])]
    parts = training.split(runtime, rows)
    assert len(parts) == 2
    assert not any({3, 4} <= set(part) for part in parts)  # B's datums in different parts
    whole(True)
    [alone], alone_grads = _pass(backend, [good])
    whole(False)
    results, got = _pass(backend, [good, mixed])
    assert_not_finite_alone(results, alone, got["A"], alone_grads["A"])
    assert all(not g.any() for g in got["B"])
    backend.optim_step("A", adam())


def test_an_error_on_the_helper_thread_fails_its_request(
    backend: Any, small_parts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loss that raises in the helper thread's part only: its request fails, the other
    request of the micro-batch trains, and the helper is free for the next pass."""
    compute = training.batch_losses
    import threading

    def fragile(work: Any, lps: Any, inputs: Any, device: Any = None) -> Any:
        if work.adapter_id == "B" and threading.current_thread() is not threading.main_thread():
            raise ZeroDivisionError("loss exploded")
        return compute(work, lps, inputs, device)

    monkeypatch.setattr(training, "batch_losses", fragile)
    results, got = _pass(backend, [work("A", DATA[:3]), work("B", DATA[3:])])
    ok(results[0])
    assert isinstance(results[1], EngineError)
    assert "ZeroDivisionError" in str(results[1])
    assert all(not g.any() for g in got["B"])
    results, _ = _pass(backend, [work("A", DATA)])
    ok(results[0])
