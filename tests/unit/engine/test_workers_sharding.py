"""The pure parts of worker groups: how a batch is split across ranks and merged back."""

from __future__ import annotations

import numpy as np

from tuneloop.server.engine.types import (
    EngineError,
    Example,
    ForwardBackwardResult,
    ForwardBackwardWork,
    SampleWork,
)
from tuneloop.server.engine.workers.sharding import (
    balance,
    merge_results,
    shard_batch,
    shard_works,
    split_samples,
)


def _work(adapter: str, lengths: list[int], forward_only: bool = False) -> ForwardBackwardWork:
    examples = tuple(
        Example(np.full(n, i, np.int64), {"target_tokens": np.full(n, i, np.int64)})
        for i, n in enumerate(lengths)
    )
    return ForwardBackwardWork(adapter, examples, "cross_entropy", {}, forward_only)


def test_balance_is_greedy_by_cost_and_deterministic() -> None:
    assert balance([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]  # 8 vs 7 tokens
    assert balance([5, 1, 4, 2, 3], 2) == balance([5, 1, 4, 2, 3], 2)
    assert balance([1], 3) == [[0], [], []]


def test_shards_balance_tokens_and_merge_back_in_order() -> None:
    batch = [_work("a", [30, 2, 9]), _work("b", [17, 12]), _work("a", [4], forward_only=True)]
    shards = shard_batch(batch, 2)
    loads = [
        sum(len(batch[p.work_index].examples[e].tokens) for p in s for e in p.examples)
        for s in shards
    ]
    assert sorted(loads) == [36, 38]
    # every example on exactly one rank
    seen = sorted((p.work_index, e) for s in shards for p in s for e in p.examples)
    assert seen == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)]
    # each rank computes "logprobs" = its examples' first token, and a loss sum per part
    replies = []
    for parts in shards:
        works = shard_works(batch, parts)
        replies.append(
            [
                ForwardBackwardResult(
                    [ex.tokens[:1].astype(np.float32) for ex in w.examples],
                    {"loss:sum": float(len(w.examples)), "n:max": float(p.work_index)},
                )
                for w, p in zip(works, parts, strict=True)
            ]
        )
    merged, partial = merge_results(batch, shards, replies)
    assert not partial
    for work, result in zip(batch, merged, strict=True):
        assert isinstance(result, ForwardBackwardResult)
        assert [int(x[0]) for x in result.logprobs] == list(range(len(work.examples)))
        assert result.metrics["loss:sum"] == len(work.examples)


def test_a_request_failing_on_one_rank_only_is_marked_for_revert() -> None:
    batch = [_work("a", [10, 10]), _work("b", [3, 3], forward_only=True)]
    shards = shard_batch(batch, 2)
    ok = ForwardBackwardResult([np.zeros(10, np.float32)], {"loss:sum": 1.0})
    ok_b = ForwardBackwardResult([np.zeros(3, np.float32)], {"loss:sum": 1.0})
    replies: list[list[ForwardBackwardResult | EngineError]] = [
        [ok if p.work_index == 0 else ok_b for p in shards[0]],
        [EngineError("not finite", "user") if p.work_index == 0 else ok_b for p in shards[1]],
    ]
    merged, partial = merge_results(batch, shards, replies)
    assert isinstance(merged[0], EngineError)
    assert merged[0].category == "user"
    assert isinstance(merged[1], ForwardBackwardResult)
    assert partial == {0}  # the forward-only request never needs a revert


def test_sampling_requests_split_by_rows_times_width() -> None:
    def sw(prompt: int, samples: int) -> SampleWork:
        return SampleWork("s", np.zeros(prompt, np.int64), samples, 10, 1.0, -1, 1.0, 0, (), ())

    batch = [sw(90, 1), sw(10, 4), sw(10, 1), sw(40, 2)]
    # costs 100, 80, 20, 100: largest first onto the least loaded rank
    assert split_samples(batch, 2) == [[0, 1], [2, 3]]
    assert split_samples(batch[:1], 2) == [[0], []]
