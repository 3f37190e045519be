"""RL on the public SDK: environments, group rollouts, GRPO advantages, datums, async overlap.

An `Env` is one episode of one problem: it gives the first messages, and judges each reply
(reward, done, and for multi-turn tasks the messages that follow, e.g. a tool's output). A
problem is rolled out `group_size` times; a trajectory's advantage is its reward minus its
group's mean (GRPO), and groups whose rewards are all equal carry no signal: they are skipped
and counted. Every sampled turn becomes one datum whose targets are the turn's sampled tokens
(prompt positions get advantage 0 and are not trained), with the sampler's logprobs, so the
`importance_sampling`, `ppo` and `cispo` losses correct for the sampler being older than the
policy. For `stable_reinforce` (the tinker-cookbook's default) the sampler records what it drew
(`record_stability_info`) and each datum names its sampled sequence (provenance spans), so the
server takes the importance weights against its own records. An optional KL penalty against the
base model subtracts `kl_coef * (logp - logp_base)` per token (the base model's logprobs from a
base sampling client).

`RolloutStream` overlaps sampling with training: a background thread samples step k+1's groups
with the newest sampler while step k trains; each batch carries the version of the weights it was
sampled with, and batches more than `max_staleness` optimizer steps old are dropped (and
counted). With `max_staleness=0` it runs synchronously: sample, train, sample.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tuneloop import (
    Datum,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
    SamplingClient,
    SamplingParams,
    TensorData,
)
from tuneloop.recipes.renderers import Message, Renderer


@dataclass(frozen=True)
class Judgement:
    reward: float
    done: bool = True
    follow_up: list[Message] = field(default_factory=list)  # the next turn's new messages
    metrics: dict[str, float] = field(default_factory=dict)


class Env(Protocol):
    def initial(self) -> list[Message]: ...

    def judge(self, reply: str, turn: int) -> Judgement: ...


@dataclass
class Turn:
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    reply: str
    ref_logprobs: list[float] | None = None  # the base model's, when a KL penalty is on
    sequence_id: str | None = None  # the sampled sequence's, for provenance


@dataclass
class Trajectory:
    turns: list[Turn]
    reward: float
    metrics: dict[str, float]


@dataclass
class Batch:
    """The groups of one step, sampled with the weights of `version` optimizer steps."""

    version: int
    index: int  # which batch of the problem stream
    groups: list[list[Trajectory]]


def advantages(rewards: Sequence[float]) -> list[float]:
    """Reward minus the group mean (not divided by the spread: a nearly solved group should
    move the model less)."""
    mean = float(np.mean(rewards))
    return [float(r) - mean for r in rewards]


def rollout_group(
    sampler: SamplingClient,
    renderer: Renderer,
    envs: Sequence[Env],
    params: SamplingParams,
    max_turns: int = 1,
) -> list[Trajectory]:
    """Roll out `envs` (one problem, `group_size` episodes) to the end, batched per turn: the
    first turn is one request with num_samples = group size (one prefill), later turns one
    request per unfinished episode, all in flight together."""
    histories = [list(env.initial()) for env in envs]
    turns: list[list[Turn]] = [[] for _ in envs]
    rewards = [0.0] * len(envs)
    metrics: list[dict[str, float]] = [{} for _ in envs]
    live = list(range(len(envs)))
    for turn in range(max_turns):
        if not live:
            break
        prompts = {i: renderer.prompt(histories[i]) for i in live}
        if turn == 0 and len({tuple(p) for p in prompts.values()}) == 1:
            first = sampler.sample(ModelInput.from_ints(prompts[live[0]]), len(live), params)
            sequences = first.result().sequences
            samples = dict(zip(live, sequences, strict=True))
        else:
            futures = {i: sampler.sample(ModelInput.from_ints(prompts[i]), 1, params) for i in live}
            samples = {i: f.result().sequences[0] for i, f in futures.items()}
        still = []
        for i in live:
            seq = samples[i]
            reply = renderer.parse(seq.tokens)
            turns[i].append(
                Turn(
                    prompts[i],
                    list(seq.tokens),
                    list(seq.logprobs or []),
                    reply,
                    sequence_id=seq.sequence_id,
                )
            )
            verdict = envs[i].judge(reply, turn)
            rewards[i] = verdict.reward
            metrics[i] = {**metrics[i], **verdict.metrics}
            if not verdict.done and turn + 1 < max_turns:
                histories[i] += [{"role": "assistant", "content": reply}, *verdict.follow_up]
                still.append(i)
        live = still
    return [Trajectory(t, r, m) for t, r, m in zip(turns, rewards, metrics, strict=True)]


def add_reference_logprobs(base: SamplingClient, groups: list[list[Trajectory]]) -> None:
    """The base model's logprobs of every sampled token (for the KL penalty), all in flight."""
    pending = []
    for group in groups:
        for trajectory in group:
            for turn in trajectory.turns:
                tokens = turn.prompt + turn.completion
                pending.append((turn, base.compute_logprobs(ModelInput.from_ints(tokens))))
    for turn, future in pending:
        scores = future.result()
        turn.ref_logprobs = [float(x or 0.0) for x in scores[len(turn.prompt) :]]


# The losses whose datums must name their sampled sequences (and whose samplers record them).
PROVENANCE_LOSSES = frozenset({"stable_reinforce"})


def needs_provenance(loss_fn: str) -> bool:
    return loss_fn in PROVENANCE_LOSSES


def with_sampled_provenance(
    datum: Datum, prompt_length: int, num_sampled: int, sequence_id: str
) -> Datum:
    """`datum` (input = prompt + sampled tokens but the last, targets = the same shifted by
    one) naming `sequence_id` behind every position, as `stable_reinforce` requires."""

    def spans(start: int, stop: int) -> list[PromptProvenanceSpan | SampledProvenanceSpan]:
        # Positions [start, stop) of prompt + sampled tokens, split where the sampling began.
        out: list[PromptProvenanceSpan | SampledProvenanceSpan] = []
        if start < prompt_length:
            end = min(stop, prompt_length)
            out.append(
                PromptProvenanceSpan(sequence_id=sequence_id, offset=start, length=end - start)
            )
        if stop > prompt_length:
            begin = max(start, prompt_length) - prompt_length
            out.append(
                SampledProvenanceSpan(
                    sequence_id=sequence_id, offset=begin, length=stop - prompt_length - begin
                )
            )
        return out

    total = prompt_length + num_sampled
    return datum.with_provenance(model_input=spans(0, total - 1), loss_fn_inputs=spans(1, total))


def datum(turn: Turn, advantage: float, kl_coef: float = 0.0, provenance: bool = False) -> Datum:
    """Input = prompt + completion but the last token; targets shifted by one; advantages and
    logprobs zero on prompt positions, so only the sampled tokens train. With `provenance`,
    the datum names the turn's sampled sequence (for `stable_reinforce`)."""
    if len(turn.logprobs) != len(turn.completion):
        raise ValueError("the sampler returned no logprob for some sampled tokens")
    tokens = turn.prompt + turn.completion
    n_prompt = len(turn.prompt) - 1
    per_token = np.full(len(turn.completion), advantage, dtype=np.float64)
    if kl_coef and turn.ref_logprobs is not None:
        per_token -= kl_coef * (np.array(turn.logprobs) - np.array(turn.ref_logprobs))
    plain = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)),
            "logprobs": TensorData.from_numpy(
                np.array([0.0] * n_prompt + turn.logprobs, dtype=np.float32)
            ),
            "advantages": TensorData.from_numpy(
                np.concatenate([np.zeros(n_prompt), per_token]).astype(np.float32)
            ),
        },
    )
    if not provenance:
        return plain
    if turn.sequence_id is None:
        raise ValueError("the sampler returned no sequence_id to name in the provenance")
    return with_sampled_provenance(plain, len(turn.prompt), len(turn.completion), turn.sequence_id)


@dataclass(frozen=True)
class Assembled:
    data: list[Datum]
    skipped_groups: int  # all rewards equal: no signal
    mean_reward: float
    kl: float  # mean (logp - logp_base) over sampled tokens, when measured


def assemble(
    groups: list[list[Trajectory]], kl_coef: float = 0.0, provenance: bool = False
) -> Assembled:
    data: list[Datum] = []
    skipped = 0
    kl_terms: list[float] = []
    for group in groups:
        group_adv = advantages([t.reward for t in group])
        for trajectory in group:
            for turn in trajectory.turns:
                if turn.ref_logprobs is not None:
                    kl_terms += list(np.array(turn.logprobs) - np.array(turn.ref_logprobs))
        if all(abs(a) < 1e-9 for a in group_adv):
            skipped += 1
            continue
        for trajectory, adv in zip(group, group_adv, strict=True):
            data += [datum(turn, adv, kl_coef, provenance) for turn in trajectory.turns]
    rewards = [t.reward for g in groups for t in g]
    return Assembled(
        data,
        skipped,
        float(np.mean(rewards)) if rewards else 0.0,
        float(np.mean(kl_terms)) if kl_terms else 0.0,
    )


class SamplerBox:
    """The newest sampler and its version (optimizer steps), shared with the sampling thread."""

    def __init__(self, sampler: SamplingClient, version: int) -> None:
        self._lock = threading.Lock()
        self._value = (sampler, version)

    def get(self) -> tuple[SamplingClient, int]:
        with self._lock:
            return self._value

    def set(self, sampler: SamplingClient, version: int) -> None:
        with self._lock:
            self._value = (sampler, version)


class RolloutStream:
    """Batches of groups, sampled ahead by one step in a background thread (or inline when
    `max_staleness` is 0); `next()` returns the next batch that is fresh enough, counting the
    stale ones it drops."""

    def __init__(
        self,
        box: SamplerBox,
        make_batch: Callable[[SamplingClient, int, int], Batch],
        first_index: int,
        max_staleness: int,
    ) -> None:
        self.box = box
        self.make_batch = make_batch
        self.max_staleness = max_staleness
        self.dropped = 0
        self._index = first_index
        self._queue: queue.Queue[Batch | BaseException] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if max_staleness > 0:
            self._thread = threading.Thread(target=self._produce, daemon=True, name="rollouts")
            self._thread.start()

    def _sample(self) -> Batch:
        sampler, version = self.box.get()
        batch = self.make_batch(sampler, version, self._index)
        self._index += 1
        return batch

    def _produce(self) -> None:
        while not self._stop.is_set():
            try:
                item: Batch | BaseException = self._sample()
            except BaseException as exc:  # handed to the trainer, which raises it
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.5)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def next(self, policy_version: int) -> Batch:
        while True:
            if self._thread is None:
                return self._sample()
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if policy_version - item.version <= self.max_staleness:
                return item
            self.dropped += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)


def sub_batches(data: list[Datum], size: int) -> list[list[Datum]]:
    """Gradient work in sub-batches of `size` datums (all submitted before the optimizer step)."""
    size = max(1, size)
    return [data[i : i + size] for i in range(0, len(data), size)]


def staleness_metrics(batch: Batch, policy_version: int, dropped: int) -> dict[str, Any]:
    return {"staleness": policy_version - batch.version, "stale_batches_dropped": dropped}
