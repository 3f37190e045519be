"""A sharded worker group (FSDP2, 2 gloo ranks on the CPU) computes what one process computes.

One group serves a dense tiny model and a tiny MoE (Qwen3-MoE, experts adapted) at once. Each
rank holds half of each model's base weights (measured from its parameters' storages);
training (several losses, a server-side custom loss, two tenants' adapters in one batch) and
seeded sampling (two tenants' samplers in one batch, prompt logprobs) equal the single-process
backend's; checkpoints cross group sizes both ways; a rank SIGKILLed during a training loop
restarts the group and the loop ends with the undisturbed run's numbers. Continuous sampling
(joining, streaming, cancellation, recovery) runs in test_workers_continuous.py on a sharded
group as on a replicated one; here, the death of the rank that does not stream.

Tolerance: every rank runs the same computation over all-gathered weights that are the same
bits as one process's, so the results are equal (measured: 0 difference); the tests keep the
replicated group's 1e-5 relative so that a change of kernel order somewhere does not make them
flaky, and it is far below any real divergence.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import (  # noqa: E402
    TINY,
    adam,
    assert_near,
    example,
    ok,
    seq,
    work,
)
from tests.unit.engine.test_custom_loss import dpo_inputs, dpo_loss  # noqa: E402
from tuneloop.server.engine.checkpoints import read_factors  # noqa: E402
from tuneloop.server.engine.types import (  # noqa: E402
    AdapterSpec,
    EngineError,
    ForwardBackwardWork,
    SampleWork,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.zoo.archs import save

    return str(save("qwen3_moe", tmp_path_factory.mktemp("zoo") / "qwen3_moe"))


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama whose LM head is its input embedding (as SmolLM2's): that matrix stays
    whole on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.zoo.archs import _COMMON, copy_tokenizer

    folder = tmp_path_factory.mktemp("zoo") / "tied_llama"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**_COMMON, "tie_word_embeddings": True}))
    model.save_pretrained(folder)
    copy_tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="module")
def models(moe: str, tied: str) -> dict[str, str]:
    return {"dense": TINY, "moe": moe, "tied": tied}


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory, models: dict[str, str]) -> Iterator[Any]:
    """One 2-rank sharded group for the module (starting one costs seconds)."""
    from tuneloop.server.engine.workers.build import worker_group

    root = tmp_path_factory.mktemp("sharded")
    g = worker_group(
        tuple(models.values()),
        workers=2,
        cache_dir=root / "cache",
        device="cpu",
        dtype="float32",  # the folders would load in the CPU's fastest dtype, bf16 on some
        state_dir=root / "state",
        shard_weights="fsdp",
    )
    yield g
    g.close()


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, models: dict[str, str]) -> Iterator[Any]:
    from tuneloop.server.engine.torch_backend import TorchBackend

    cache = tmp_path_factory.mktemp("single")
    be = TorchBackend(list(models.values()), cache_dir=cache, device="cpu", dtype=torch.float32)
    yield be
    be.close()


def _spec(adapter_id: str, model: str, seed: int) -> AdapterSpec:
    return AdapterSpec(adapter_id, model, 4, seed)


def _custom_work(adapter: str) -> ForwardBackwardWork:
    examples = []
    for i, n in enumerate([21, 6, 9]):
        _, inputs = dpo_inputs(i, n)
        extra = {k: inputs[k] for k in ("ref_logprobs", "sign")}
        examples.append(example(seq(n + 1, 60 + i), inputs["weights"], **extra))
    return ForwardBackwardWork(
        adapter, tuple(examples), "custom", {}, False, custom_loss=dpo_loss()
    )


def _ppo_work(adapter: str, step: int) -> ForwardBackwardWork:
    rng = np.random.default_rng(step)
    examples = []
    for i, n in enumerate([17, 8]):
        inputs = {
            "advantages": rng.normal(size=n).astype(np.float32),
            "logprobs": rng.normal(-5.5, 0.5, size=n).astype(np.float32),
        }
        ex = example(seq(n + 1, 80 + i + step), **inputs)
        del ex.inputs["weights"]
        examples.append(ex)
    return work(adapter, examples, loss_fn="ppo")


def _batch(step: int, a: str, b: str, dense: bool) -> list[ForwardBackwardWork]:
    """Two tenants' adapters in one batch: cross entropy on uneven lengths, PPO (dense) or a
    forward-only request (MoE), and a server-side custom loss on the dense model."""
    works = [
        work(a, [example(seq(n + 1, 10 * step + i)) for i, n in enumerate([23, 5, 14])]),
        _ppo_work(b, step) if dense else work(b, [example(seq(12, 99 + step))], forward_only=True),
        work(b, [example(seq(n + 1, 40 + step + i)) for i, n in enumerate([9, 31])]),
    ]
    if dense:
        works.append(_custom_work(a))
    return works


def _train(be: Any, prefix: str, model: str, steps: int, out: Path) -> dict[str, Any]:
    a, b = f"{prefix}a", f"{prefix}b"
    be.create_adapter(_spec(a, model, 1))
    be.create_adapter(_spec(b, model, 2))
    record: dict[str, Any] = {"losses": [], "logprobs": [], "grad_norms": []}
    for step in range(steps):
        for half in range(2):  # gradients accumulate over two calls
            results = [
                ok(r) for r in be.forward_backward(_batch(2 * step + half, a, b, model == TINY))
            ]
            record["losses"].append([r.metrics["loss:sum"] for r in results])
            record["logprobs"].append([lp for r in results for lp in r.logprobs])
        for adapter in (a, b):
            record["grad_norms"].append(be.optim_step(adapter, adam(1e-2))["grad_norm"])
    record["weights"] = []
    for adapter in (a, b):
        be.save_state(adapter, out / adapter, optimizer=True)
        record["weights"].append(read_factors(out / adapter))
    return record


def _compare(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert_near(got["losses"], want["losses"], TOL, "loss sums", relative=True)
    assert_near(got["logprobs"], want["logprobs"], TOL, "logprobs", relative=True)
    assert_near(got["grad_norms"], want["grad_norms"], TOL, "grad norms", relative=True)
    for g, w in zip(got["weights"], want["weights"], strict=True):
        assert sorted(g) == sorted(w)
        assert_near([g[k] for k in sorted(g)], [w[k] for k in sorted(w)], TOL, "weights")


def test_each_rank_holds_half_of_the_base_weights(group: Any, models: dict[str, str]) -> None:
    reports = group.memory()
    assert [r["rank"] for r in reports] == [0, 1]
    for which, model in models.items():
        for m in (r["models"][model] for r in reports):
            total, replicated = m["weights_total"], m["weights_replicated"]
            if which == "tied":  # the embedding (= the head) is whole on every rank
                assert replicated == 259 * 64 * 4
            else:
                assert replicated == 0
            half = replicated + (total - replicated) / 2
            # FSDP2 pads each weight's dim 0 to a multiple of 2: at most a row per tensor
            assert half <= m["weights"] <= half * 1.02, (model, m)
            assert m["kv_cache"] > 0
    # No other reference keeps a whole weight alive: every live tensor of a rank (shards,
    # buffers, nothing sampled yet) is about half the weights, not the weights and a half.
    total = sum(m["weights_total"] for m in reports[0]["models"].values())
    for live in group.live_tensor_bytes():
        assert live < 0.6 * total, (live, total)
    one = group.memory()[0]["models"][TINY]
    group.create_adapter(_spec("mem-a", TINY, 0))
    after = group.memory()[0]["models"][TINY]
    assert after["adapters"] > one["adapters"]
    assert after["optimizer"] > one["optimizer"]
    assert after["weights"] == one["weights"]
    group.delete_adapter("mem-a")


@pytest.mark.parametrize("which", ["dense", "moe", "tied"])
def test_sharded_training_equals_one_process(
    group: Any, single: Any, models: dict[str, str], which: str, tmp_path: Path
) -> None:
    model = models[which]
    got = _train(group, f"g{which}-", model, 2, tmp_path / "group")
    want = _train(single, f"s{which}-", model, 2, tmp_path / "single")
    _compare(got, want)
    moved = max(float(t.abs().max()) for k, t in want["weights"][0].items() if "lora_B" in k)
    assert moved > 1e-3  # the adapters trained: equal untrained weights would prove nothing
    if which == "moe":  # the expert factors are among what trained and matched
        assert any("experts" in k for k in got["weights"][0])


def _samples(be: Any, samplers: tuple[str, str]) -> list[Any]:
    works = [
        SampleWork(
            samplers[i % 2],
            seq(6 + i, 200 + i),
            2,
            6,
            1.0,
            -1,
            1.0,
            i,
            (),
            (),
            prompt_logprobs=True,
            topk_sample_logprobs=2,
        )
        for i in range(4)
    ]
    return [ok(r) for r in be.sample(works)]


@pytest.mark.parametrize("which", ["dense", "moe", "tied"])
def test_sharded_sampling_equals_one_process(
    group: Any, single: Any, models: dict[str, str], which: str
) -> None:
    model = models[which]
    for be, p in ((group, f"gs{which}-"), (single, f"ss{which}-")):
        for i in range(2):  # two tenants' trained snapshots, sampled in one batch
            be.create_adapter(_spec(f"{p}{i}", model, 3 + i))
            ok(be.forward_backward([work(f"{p}{i}", [example(seq(20, 5 + i))])])[0])
            be.optim_step(f"{p}{i}", adam(1e-1))
            be.create_sampler(f"{p}snap{i}", model, adapter_id=f"{p}{i}")
    got = _samples(group, (f"gs{which}-snap0", f"gs{which}-snap1"))
    want = _samples(single, (f"ss{which}-snap0", f"ss{which}-snap1"))
    assert [[s.tokens for s in r.sequences] for r in got] == [
        [s.tokens for s in r.sequences] for r in want
    ]
    # (the MoE model's logprobs were 1.64e-5 apart on an AVX2 EPYC, the dense ones within
    # TOL: more sums whose order the shards change)
    tol = 3 * TOL if which == "moe" else TOL
    for g, w in zip(got, want, strict=True):
        assert_near([s.logprobs for s in g.sequences], [s.logprobs for s in w.sequences], tol)
        assert_near(g.prompt_logprobs[1:], w.prompt_logprobs[1:], tol, "prompt logprobs")


def test_continuous_sampling_admits_and_cancels_as_one_process(group: Any, single: Any) -> None:
    """The scheduler's continuous entry point: requests admitted after the first batch are
    sampled too, a cancelled sampler's request is answered with the cancellation, and every
    result is one process's."""
    from tuneloop.server.engine.types import CANCELLED

    def run(be: Any, prefix: str) -> dict[int, Any]:
        be.create_sampler(prefix + "base", TINY)
        be.create_sampler(prefix + "gone", TINY)
        first = [SampleWork(prefix + "base", seq(5, 1), 2, 4, 1.0, -1, 1.0, 3, (), ())]
        later = [
            SampleWork(prefix + "base", seq(7, 2), 1, 5, 1.0, -1, 1.0, 4, (), ()),
            SampleWork(prefix + "gone", seq(6, 3), 1, 5, 1.0, -1, 1.0, 5, (), ()),
        ]
        queue = [later]
        got: dict[int, Any] = {}
        index = {id(w): i for i, w in enumerate(first + later)}
        be.sample_continuous(
            first,
            lambda: queue.pop() if queue else [],
            lambda w, r: got.update({index[id(w)]: r}),
            lambda: {prefix + "gone"},
        )
        return got

    got, want = run(group, "cc-"), run(single, "ccs-")
    assert sorted(got) == sorted(want) == [0, 1, 2]
    for result in (got[2], want[2]):
        assert isinstance(result, EngineError)
        assert str(result) == CANCELLED
    for i in (0, 1):
        assert [s.tokens for s in ok(got[i]).sequences] == [s.tokens for s in ok(want[i]).sequences]


def test_rank_1_killed_while_the_group_streams(group: Any, single: Any) -> None:
    """SIGKILL of rank 1 (which streams nothing) on the third token rank 0 streams: rank 0's
    collectives fail with it, yet no request is answered with that failure: the streamed one
    gets an error, the others their undisturbed results on the restored group."""
    for be, p in ((group, "k1-"), (single, "k1s-")):
        be.create_sampler(p + "base", TINY)
    pids, restarts = group.worker_pids(), group.restarts
    told: list[int] = []

    def kill_on_third(index: int, token: int, logprob: float, topk: Any) -> None:
        told.append(token)
        if len(told) == 3:
            os.kill(pids[1], signal.SIGKILL)

    def works(sampler: str) -> list[SampleWork]:
        return [
            SampleWork(sampler, seq(5, 600 + i), 1 + i % 2, 40, 1.0, -1, 1.0, 20 + i, (), ())
            for i in range(4)
        ]

    mine = works("k1-base")
    mine[0] = replace(mine[0], on_token=kill_on_third)
    got: dict[int, Any] = {}
    group.sample_continuous(mine, list, lambda w, r: got.update({id(w): r}))
    assert group.restarts == restarts + 1
    assert pids[1] not in group.worker_pids()
    assert len(got) == 4
    streamed = got[id(mine[0])]
    assert isinstance(streamed, EngineError)
    assert streamed.category == "server"
    want = single.sample(works("k1s-base"))
    for w, r in zip(mine[1:], want[1:], strict=True):
        assert [s.tokens for s in ok(got[id(w)]).sequences] == [s.tokens for s in ok(r).sequences]


def test_checkpoints_cross_group_sizes(group: Any, single: Any, tmp_path: Path) -> None:
    """Saved on the sharded group, loaded in one process, and the other way: both continue
    exactly like the adapter they were saved from."""
    data = [example(seq(n, 500 + n)) for n in (25, 11, 6)]
    for be, p in ((group, "cg-"), (single, "cs-")):
        be.create_adapter(_spec(p + "src", TINY, 2))
        ok(be.forward_backward([work(p + "src", data)])[0])
        be.optim_step(p + "src", adam(1e-2))
        be.save_state(p + "src", tmp_path / p, optimizer=True)
    single.create_adapter(_spec("cs-from-group", TINY, 7))
    single.load_state("cs-from-group", tmp_path / "cg-", optimizer=True)
    group.create_adapter(_spec("cg-from-single", TINY, 7))
    group.load_state("cg-from-single", tmp_path / "cs-", optimizer=True)
    # the files themselves: the same PEFT layout and values from either side
    assert_near(read_factors(tmp_path / "cg-"), read_factors(tmp_path / "cs-"), TOL, "saved")
    for be, adapter in (
        (group, "cg-src"),
        (group, "cg-from-single"),
        (single, "cs-src"),
        (single, "cs-from-group"),
    ):
        ok(be.forward_backward([work(adapter, data)])[0])
        be.optim_step(adapter, adam(1e-2))
        be.save_state(adapter, tmp_path / "after" / adapter, optimizer=True)
    after = {a: read_factors(tmp_path / "after" / a) for a in os.listdir(tmp_path / "after")}
    for adapter in ("cg-from-single", "cs-src", "cs-from-group"):
        assert_near(after[adapter], after["cg-src"], TOL, adapter)


def _wait_for(predicate: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_rank_killed_during_a_training_loop(group: Any, single: Any) -> None:
    """SIGKILL of one rank while a loop of forward_backward + optim_step runs: the group
    restarts from the server's copies, the call in flight runs again, and the loop's losses and
    gradient norms are the undisturbed run's."""
    steps = 6
    data = [example(seq(n, 300 + n)) for n in (40, 9, 17)]

    def loop(be: Any, adapter: str, out: list[tuple[float, float]]) -> None:
        for _ in range(steps):
            [result] = be.forward_backward([work(adapter, data)])
            norm = be.optim_step(adapter, adam(5e-2))["grad_norm"]
            out.append((ok(result).metrics["loss:sum"], norm))

    for be, adapter in ((group, "kl-x"), (single, "kls-x")):
        be.create_adapter(_spec(adapter, TINY, 7))
    got: list[tuple[float, float]] = []
    generation = group.generation
    thread = threading.Thread(target=loop, args=(group, "kl-x", got))
    thread.start()
    _wait_for(lambda: len(got) >= 2)
    os.kill(group.worker_pids()[1], signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive()
    want: list[tuple[float, float]] = []
    loop(single, "kls-x", want)
    _wait_for(lambda: group.generation > generation)
    assert len(got) == steps
    assert_near(got, want, TOL, "losses and grad norms", relative=True)


def test_a_group_that_cannot_fit_is_refused_with_the_numbers(tmp_path: Path) -> None:
    from tuneloop.server.engine.workers.build import worker_group

    with pytest.raises(ValueError, match=r"each rank needs [\d.,]+ MiB and has 8\.0 MiB") as caught:
        worker_group(
            (TINY,),
            workers=2,
            cache_dir=tmp_path,
            device="cpu",
            shard_weights="fsdp",
            rank_memory=8 * 2**20,
        )
    message = str(caught.value)
    for part in ("weights", "adapter", "optimizer", "KV cache", "activations", "--workers"):
        assert part in message


def test_the_plan_halves_the_weights_and_counts_the_tied_embedding_once(tied: str) -> None:
    from tuneloop.server.engine.parallel.plan import check_fits, meta_model, plan_model

    model = meta_model(tied, Path("unused"))
    one, two = (plan_model(tied, model, n, torch.float32, 1024) for n in (1, 2))
    embedding = 259 * 64 * 4
    assert one.weights == one.weights_total  # 1 rank: everything, the tied matrix once
    assert two.replicated == embedding
    assert two.weights == pytest.approx(embedding + (one.weights_total - embedding) / 2, rel=0.02)
    assert (two.adapter, two.kv_cache) == (one.adapter, one.kv_cache)
    assert "1/2 of" in check_fits([two], two.need)  # exactly enough fits
    with pytest.raises(ValueError, match="do not fit"):
        check_fits([two], two.need - 1)


def test_shard_weights_needs_a_group(tmp_path: Path) -> None:
    from tuneloop.server.config import ServerConfig

    with pytest.raises(ValueError, match="--workers 2"):
        ServerConfig(tmp_path, backend="torch", shard_weights="fsdp")
    with pytest.raises(ValueError, match="none or fsdp"):
        ServerConfig(tmp_path, backend="torch", workers=2, shard_weights="tp")
    assert (
        ServerConfig(tmp_path, backend="torch", workers=2, shard_weights="fsdp").shard_weights
        == "fsdp"
    )
