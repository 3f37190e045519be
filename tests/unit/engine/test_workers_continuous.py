"""Continuous batching in a worker group of 2 gloo ranks on the CPU (real worker processes).

Every test that takes a group runs twice: on a replicated group (each rank decodes its share)
and on a sharded one (FSDP2: every rank decodes every request, admissions and cancellations
decided for all ranks at each step).

What must hold: tokens stream across the process boundary (each hook sees every token of its
request, in order, before the request's answer, equal to the answer); requests that join while
the ranks decode are answered; every result equals what one process gives the same seeded
request (samples do not depend on what shares the batch or the rank); cancellation reaches the
ranks; a rank SIGKILLed while it decodes leaves every request answered exactly once: the ones
that had not streamed with their undisturbed result, a streamed one with an error. A group of
Ray actors (no pipe to stream on) samples whole batches in turn, with the same results.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

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
from tuneloop.server.engine.backend import ContinuousSampling  # noqa: E402
from tuneloop.server.engine.types import (  # noqa: E402
    CANCELLED,
    EngineError,
    SampleResult,
    SampleWork,
)
from tuneloop.server.engine.workers.continuous import sample_in_batches  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module", params=["replicated", "sharded"])
def group(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    from tuneloop.server.engine.workers.build import worker_group

    root = tmp_path_factory.mktemp(request.param)
    g = worker_group(
        (TINY,),
        workers=2,
        cache_dir=root / "cache",
        device="cpu",
        state_dir=root / "state",
        shard_weights="fsdp" if request.param == "sharded" else "none",
    )
    yield g
    g.close()


@pytest.fixture(scope="module")
def single(group: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One process per group: `samplers` trains the same adapter on both."""
    from tuneloop.server.engine.torch_backend import TorchBackend

    be = TorchBackend([TINY], cache_dir=tmp_path_factory.mktemp("single"), device="cpu")
    yield be
    be.close()


@pytest.fixture(scope="module")
def samplers(group: Any, single: Any) -> dict[str, str]:
    """On both backends: a base-model sampler and a snapshot of a trained adapter."""
    for be in (group, single):
        be.create_sampler("base", TINY)
        be.create_adapter(adapter_spec("ad", rank=4, seed=3))
        ok(be.forward_backward([work("ad", [example(seq(20, 5))])])[0])
        be.optim_step("ad", adam(1e-1))
        be.create_sampler("snap", TINY, adapter_id="ad")
    return {"base": "base", "snap": "snap"}


def _work(sampler: str, i: int, *, n: int = 1, max_tokens: int = 8, plen: int = 6) -> SampleWork:
    return SampleWork(sampler, seq(plen + i % 3, 400 + i), n, max_tokens, 1.0, -1, 1.0, i, (), ())


@dataclass
class Drive:
    """Runs `sample_continuous` on this thread: `joining[k]` is what the k-th admit() call
    returns; every answer is recorded, a second answer of one request fails the test."""

    joining: dict[int, list[SampleWork]] = field(default_factory=dict)
    cancel_at: int | None = None  # admit() call from which `cancel` is cancelled
    cancel: frozenset[str] = frozenset()
    on_admit: Callable[[int], None] | None = None
    admits: int = 0
    answers: dict[int, SampleResult | EngineError] = field(default_factory=dict)
    events: list[tuple[str, int, Any]] = field(default_factory=list)  # (kind, id(work), what)

    def admit(self) -> list[SampleWork]:
        self.admits += 1
        if self.on_admit is not None:
            self.on_admit(self.admits)
        return self.joining.pop(self.admits, [])

    def deliver(self, w: SampleWork, result: SampleResult | EngineError) -> None:
        assert id(w) not in self.answers, "a request was answered twice"
        self.answers[id(w)] = result
        self.events.append(("answer", id(w), result))

    def cancelled(self) -> Collection[str]:
        if self.cancel_at is not None and self.admits >= self.cancel_at:
            return self.cancel
        return frozenset()

    def streamed(self, w: SampleWork) -> SampleWork:
        def hook(index: int, token: int, logprob: float, topk: Any) -> None:
            self.events.append(("token", id(w2), (index, token, logprob)))

        w2 = replace(w, on_token=hook)
        return w2

    def run(self, be: ContinuousSampling, batch: Sequence[SampleWork]) -> None:
        be.sample_continuous(batch, self.admit, self.deliver, self.cancelled)
        assert not self.joining, "the run ended before every joining request was admitted"

    def tokens(self, w: SampleWork) -> list[tuple[int, int, float]]:
        return [what for kind, key, what in self.events if kind == "token" and key == id(w)]


def _alone(single: Any, works: Sequence[SampleWork]) -> list[SampleResult]:
    """What one process gives each request (one batch: seeded samples ignore the others)."""
    return [ok(r) for r in single.sample([replace(w, on_token=None) for w in works])]


def _assert_same(got: SampleResult | EngineError, want: SampleResult) -> None:
    got = ok(got)
    assert isinstance(got, SampleResult)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    assert_near(
        [s.logprobs for s in got.sequences],
        [s.logprobs for s in want.sequences],
        TOL,
        "sampled logprobs",
    )


def test_a_group_is_a_continuous_sampler(group: Any) -> None:
    assert isinstance(group, ContinuousSampling)
    assert group.size == 2


def test_a_worker_group_streams_tokens(group: Any, single: Any, samplers: Any) -> None:
    drive = Drive()
    works = [
        drive.streamed(_work("snap", 0, n=2, max_tokens=30)),
        drive.streamed(_work("base", 1, max_tokens=12)),
        _work("base", 2, max_tokens=10),  # no hook: answered whole
        drive.streamed(_work("snap", 3, max_tokens=20)),
    ]
    drive.run(group, works)
    for w, want in zip(works, _alone(single, works), strict=True):
        _assert_same(drive.answers[id(w)], want)
        result = ok(drive.answers[id(w)])
        told = drive.tokens(w)
        if w.on_token is None:
            assert told == []
            continue
        # every token, in order per sample, equal to the answer, and all before the answer
        for index, sequence in enumerate(result.sequences):
            mine = [(t, lp) for i, t, lp in told if i == index]
            assert [t for t, _ in mine] == sequence.tokens
            assert_near([lp for _, lp in mine], sequence.logprobs, 1e-6, "streamed logprobs")
        answered = drive.events.index(("answer", id(w), drive.answers[id(w)]))
        last = max(i for i, e in enumerate(drive.events) if e[0] == "token" and e[1] == id(w))
        assert last < answered
    # tokens arrive while the ranks decode, not at the end: the 20-token request's first
    # token is told before the 10-token request is answered. Both run on one rank in either
    # group (a replicated group places the largest request, the 30-token pair, alone on rank
    # 0 and the rest on rank 1), so the order does not hang on two processes' relative speed.
    first = next(i for i, e in enumerate(drive.events) if e[1] == id(works[3]))
    assert first < drive.events.index(("answer", id(works[2]), drive.answers[id(works[2])]))


def test_requests_joining_mid_decode_are_answered(group: Any, single: Any, samplers: Any) -> None:
    drive = Drive()
    # Long enough that the group asks for joiners (between its messages, at least every
    # POLL_S) more than 8 times before the first batch ends, however fast the ranks decode.
    first = [_work("base", 10 + i, n=1 + i % 2, max_tokens=96) for i in range(3)]
    later = [_work("snap", 20 + i, max_tokens=6 + 2 * i) for i in range(3)]
    last = [drive.streamed(_work("base", 30 + i, max_tokens=5)) for i in range(2)]
    drive.joining = {3: later, 8: last}
    drive.run(group, first)
    everything = [*first, *later, *last]
    assert len(drive.answers) == len(everything)
    for w, want in zip(everything, _alone(single, everything), strict=True):
        _assert_same(drive.answers[id(w)], want)
    # the same schedule on one process gives the same answers
    drive1 = Drive(joining={3: later, 8: last})
    drive1.run(single, first)
    for w in everything:
        _assert_same(drive.answers[id(w)], ok(drive1.answers[id(w)]))


def test_a_joining_request_joins_the_running_batch(group: Any, single: Any, samplers: Any) -> None:
    """A short request that arrives while a long one decodes is answered before the long one
    ends (it joined the running batch, not the next one), the long one streams meanwhile, and
    both equal one process's seeded answers."""
    drive = Drive()
    running = drive.streamed(_work("snap", 140, max_tokens=48))
    joiner = _work("base", 141, n=2, max_tokens=3)
    drive.joining = {2: [joiner]}
    drive.run(group, [running])
    for w, want in zip([running, joiner], _alone(single, [running, joiner]), strict=True):
        _assert_same(drive.answers[id(w)], want)
    assert len(ok(drive.answers[id(running)]).sequences[0].tokens) == 48  # no early EOS
    answers = [e[1] for e in drive.events if e[0] == "answer"]
    assert answers == [id(joiner), id(running)]
    joined = drive.events.index(("answer", id(joiner), drive.answers[id(joiner)]))
    told = [i for i, e in enumerate(drive.events) if e[0] == "token"]
    assert told[0] < joined < told[-1]  # streamed before, during and after the joiner ran


def test_cancellation_reaches_the_ranks(group: Any, single: Any, samplers: Any) -> None:
    group.create_sampler("doomed", TINY)
    drive = Drive(cancel_at=4, cancel=frozenset({"doomed"}))
    doomed = [drive.streamed(_work("doomed", 40 + i, n=2, max_tokens=400)) for i in range(3)]
    kept = [_work("base", 50 + i, max_tokens=16) for i in range(3)]
    late = _work("doomed", 60)  # joins after the cancellation: answered at once
    drive.joining = {6: [late]}
    drive.run(group, [*doomed, *kept])
    for w in [*doomed, late]:
        answer = drive.answers[id(w)]
        assert isinstance(answer, EngineError)
        assert str(answer) == CANCELLED
        assert answer.category == "user"
    for w in doomed:  # they stopped early: far fewer than 400 tokens were drawn
        assert len(drive.tokens(w)) < 2 * 400
    for w, want in zip(kept, _alone(single, kept), strict=True):
        _assert_same(drive.answers[id(w)], want)


def test_large_messages_both_ways_at_once(group: Any, single: Any, samplers: Any) -> None:
    """Answers larger than a pipe's buffer (top-k prompt logprobs of long prompts) while an
    admission larger than one (many long prompts) goes the other way: neither side waits on
    the other for ever."""
    drive = Drive()

    def long(i: int, **kw: Any) -> SampleWork:
        return replace(_work("base", 120 + i, max_tokens=1), prompt=seq(1500, 900 + i), **kw)

    talkative = [long(i, prompt_logprobs=True, topk_prompt_logprobs=20) for i in range(4)]
    many = [long(10 + i) for i in range(40)]  # 40 x 1500 int64 tokens: ~480 kB admitted at once
    drive.joining = {1: many}
    drive.run(group, talkative)
    assert len(drive.answers) == len(talkative) + len(many)
    want = _alone(single, talkative[:1])[0]
    got = ok(drive.answers[id(talkative[0])])
    assert got.topk_prompt_logprobs is not None
    assert len(got.topk_prompt_logprobs) == 1500
    _assert_same(got, want)


def test_a_poisoned_sampler_fails_alone(
    group: Any, single: Any, samplers: Any, tmp_path: Any
) -> None:
    """A sampler whose weights overflow the logits, decoding continuously next to others on
    both ranks (one of its requests streamed): its requests fail alone, as user errors, and
    the others get what one process gives them."""
    from safetensors.torch import load_file, save_file

    from tuneloop.server.engine.checkpoints import ADAPTER_FILE
    from tuneloop.server.engine.isolation import NON_FINITE_LOGITS

    group.save_sampler_weights("ad", tmp_path / "huge")
    factors = load_file(str(tmp_path / "huge" / ADAPTER_FILE))
    save_file({k: v * 1e30 for k, v in factors.items()}, str(tmp_path / "huge" / ADAPTER_FILE))
    group.create_sampler("huge", TINY, weights_dir=tmp_path / "huge")
    drive = Drive()
    bad = [_work("huge", 130), drive.streamed(_work("huge", 131))]
    good = [_work("snap", 132 + i, n=2, max_tokens=8) for i in range(3)]
    drive.joining = {2: [bad[1]]}
    drive.run(group, [good[0], bad[0], good[1], good[2]])
    for w in bad:
        answer = drive.answers[id(w)]
        assert isinstance(answer, EngineError)
        assert answer.category == "user"
        assert str(answer) == NON_FINITE_LOGITS
    for w, want in zip(good, _alone(single, good), strict=True):
        _assert_same(drive.answers[id(w)], want)


def test_sample_in_batches_takes_in_what_queued() -> None:
    """The path of workers without pipes: whole batches in turn, cancelled ones answered."""
    batches: list[list[str]] = []

    def sample(works: Sequence[SampleWork]) -> list[SampleResult | EngineError]:
        batches.append([w.sampler_id for w in works])
        return [SampleResult([]) for _ in works]

    drive = Drive(cancel_at=1, cancel=frozenset({"c"}))
    first = [_work("a", 0), _work("b", 1)]
    joining = [_work("c", 2), _work("d", 3)]
    drive.joining = {1: joining}
    sample_in_batches(sample, first, drive.admit, drive.deliver, drive.cancelled)
    assert batches == [["a", "b"], ["d"]]
    assert str(drive.answers[id(joining[0])]) == CANCELLED
    assert len(drive.answers) == 4


def test_a_caller_that_raises_leaves_the_group_usable(
    group: Any, single: Any, samplers: Any
) -> None:
    """deliver() raising mid-session propagates, and the ranks are not left in the session:
    the next calls are answered as usual."""
    drive = Drive()

    def failing(w: SampleWork, result: SampleResult | EngineError) -> None:
        raise RuntimeError("the caller broke")

    works = [_work("base", 90 + i, max_tokens=30) for i in range(3)]
    with pytest.raises(RuntimeError, match="the caller broke"):
        group.sample_continuous(works, drive.admit, failing, drive.cancelled)
    [sampled] = group.sample([works[0]])
    _assert_same(sampled, _alone(single, [works[0]])[0])
    drive.run(group, works[1:])
    for w, want in zip(works[1:], _alone(single, works[1:]), strict=True):
        _assert_same(drive.answers[id(w)], want)


def test_a_rank_killed_while_it_decodes(group: Any, single: Any, samplers: Any) -> None:
    """Rank 0 is SIGKILLed on the third token of the streamed request it decodes: that one
    gets an error, every other request (on either rank, and one that joins after the death)
    its undisturbed result, each exactly once; the group is restored and samples again. In a
    sharded group every rank decodes all four: rank 1 fails its collectives with rank 0 gone,
    and those errors must not be told as the requests' own."""
    drive = Drive()
    restarts, pids = group.restarts, group.worker_pids()
    killed: list[int] = []

    def kill_on_third(index: int, token: int, logprob: float, topk: Any) -> None:
        drive.events.append(("token", id(victim), (index, token, logprob)))
        if len(drive.tokens(victim)) == 3 and not killed:
            killed.append(pids[0])
            os.kill(pids[0], signal.SIGKILL)

    # replicated, placed largest first onto the least-loaded rank: victim (65) -> 0,
    # pair (50) -> 1, medium (35) -> 1, short (25) -> 0, next to the victim
    victim = replace(_work("snap", 70, max_tokens=60, plen=5), on_token=kill_on_third)
    victim = replace(victim, prompt=seq(5, 470))
    pair = replace(_work("base", 71, n=2, max_tokens=20), prompt=seq(5, 471))
    medium = replace(_work("snap", 72, max_tokens=30), prompt=seq(5, 472))
    short = replace(_work("base", 73, max_tokens=20), prompt=seq(5, 473))
    joiner = _work("snap", 74, max_tokens=8)
    joined: list[bool] = []

    def admit_hook(n: int) -> None:  # the first admit() after the death brings the joiner
        if killed and not joined:
            joined.append(True)
            drive.joining[n] = [joiner]

    drive.on_admit = admit_hook
    drive.run(group, [victim, pair, medium, short])
    assert killed
    assert joined
    assert group.restarts == restarts + 1
    assert pids[0] not in group.worker_pids()
    answer = drive.answers[id(victim)]
    assert isinstance(answer, EngineError)
    assert answer.category == "server"
    others = [pair, medium, short, joiner]
    assert len(drive.answers) == 5
    for w, want in zip(others, _alone(single, others), strict=True):
        _assert_same(drive.answers[id(w)], want)
    # the restored group samples as before
    again, w = Drive(), _work("snap", 80, max_tokens=6)
    again.run(group, [w])
    _assert_same(again.answers[id(w)], _alone(single, [w])[0])


@pytest.mark.slow  # a private Ray and its actors: tens of seconds on a shared machine
def test_a_group_of_ray_actors_samples_whole_batches(backend: Any, tmp_path: Any) -> None:
    """Ray actors have no pipe to stream on: `sample_continuous` samples whole batches in turn
    (joining requests included), answers whole, and equals one process."""
    ray = pytest.importorskip("ray")
    from tuneloop.server.engine.workers.build import worker_group

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        group = worker_group(
            (TINY,), workers=2, cache_dir=tmp_path / "cache", device="cpu", ray_address="local"
        )
        try:
            group.create_sampler("ray-base", TINY)
            backend.create_sampler("ray-single", TINY)
            drive = Drive()
            first = [drive.streamed(_work("ray-base", 100 + i, max_tokens=6)) for i in range(3)]
            joining = [_work("ray-base", 110, max_tokens=4)]
            drive.joining = {1: joining}
            drive.run(group, first)
            everything = [*first, *joining]
            mine = [replace(w, sampler_id="ray-single") for w in everything]
            for w, want in zip(everything, _alone(backend, mine), strict=True):
                _assert_same(drive.answers[id(w)], want)
                assert drive.tokens(w) == []
        finally:
            group.close()
    finally:
        ray.shutdown()
