"""The poison test: tenant B runs every hostile input of the engine kind while tenant A runs an
ordinary training-and-sampling loop; A's results must equal A's run alone.

Against a real `tuneloop serve` process, on the fake backend and on the torch engine with the
tiny built-in model. B's hostile inputs:

- optim_step learning rates of 1e308, Infinity and NaN (each must be a 400 naming the field);
- forward_backward datums with weights of 1e36 (finite float32, gradients that overflow: a
  user error on the torch engine, finite on the float64 fake), then optim_steps with beta2 = 0
  and eps = 1e-30 whose updates overflow (skipped, said so in the metrics);
- load_weights of a checkpoint holding NaN (refused as the user's error: no route makes an
  adapter non-finite);
- bursts of samples from a poisoned sampler (finite weights whose logits overflow), sent while
  A samples, so that they share A's decode batches, and an OpenAI-route completion on its
  checkpoint (a 400).

Every answer B gets must be a 4xx or a user error, never a 5xx, and plain JSON; A's losses,
grad norms, sampled tokens and logprobs must equal those of A's run alone (exactly on the
deterministic fake; on torch, tokens exactly and floats to float32 rounding, since B's rows
change the shapes of the batched matmuls A's rows are computed in).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tuneloop
from tests.adversarial.harness import (
    Answer,
    Tenant,
    read_checkpoint,
    scale_checkpoint,
    strict_json,
)
from tuneloop import AdamParams, Datum, ModelInput, SamplingParams
from tuneloop._local_server import LiveServer, create_key, start_server, stop

pytestmark = pytest.mark.integration

FAKE = "tuneloop/fake-tiny"
TINY = "tuneloop/tiny-qwen3"
STEPS = 3
TEXT = [5, 17, 33, 90, 120, 7, 64, 200, 3, 44, 91, 150]
PROMPTS = [[5, 17, 33], [90, 120], [7, 64, 200, 3]]
# Scales that make a checkpoint's finite weights overflow the logits (fake: float64, torch:
# float32 factors, whose product overflows).
OVERFLOW = {FAKE: 1e200, TINY: 1e30}


@dataclass(frozen=True)
class Backend:
    name: str
    model: str


BACKENDS = [Backend("fake", FAKE), Backend("torch", TINY)]


@dataclass
class World:
    server: LiveServer
    model: str
    a_key: str
    b_key: str


@pytest.fixture(scope="module", params=BACKENDS, ids=lambda b: b.name)
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    backend: Backend = request.param
    data_dir = Path(tmp_path_factory.mktemp(f"poison-{backend.name}"))
    a_key, b_key = create_key(data_dir, "tenant-a"), create_key(data_dir, "tenant-b")
    models = () if backend.name == "fake" else (backend.model,)
    server = start_server(data_dir, key=a_key, backend=backend.name, models=models)
    try:
        yield World(server, backend.model, a_key, b_key)
    finally:
        stop(server.process)


# ---- tenant A: an ordinary loop through the public SDK ----------------------------------------


@dataclass
class Record:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens: list[list[list[int]]] = field(default_factory=list)
    logprobs: list[list[list[float]]] = field(default_factory=list)


def run_a(world: World, on_sample: threading.Event | None = None) -> Record:
    """STEPS of forward_backward + optim_step, each followed by seeded samples of a snapshot."""
    service = tuneloop.ServiceClient(base_url=world.server.url, api_key=world.a_key)
    record = Record()
    try:
        training = service.create_lora_training_client(world.model, rank=4, seed=11)
        data = [
            Datum(
                model_input=ModelInput.from_ints(TEXT[:-1]),
                loss_fn_inputs={"target_tokens": TEXT[1:]},
            )
        ]
        for _ in range(STEPS):
            out = training.forward_backward(data, "cross_entropy").result(timeout=120)
            record.losses.append(out.metrics["loss:sum"])
            step = training.optim_step(AdamParams(learning_rate=0.05)).result(timeout=120)
            assert step.metrics is not None
            record.grad_norms.append(step.metrics["grad_norm"])
            sampler = training.save_weights_and_get_sampling_client()
            if on_sample is not None:
                on_sample.set()  # B's poisoned burst goes now, alongside these samples
            futures = [
                sampler.sample(ModelInput.from_ints(p), 2, SamplingParams(max_tokens=8, seed=i))
                for i, p in enumerate(PROMPTS)
            ]
            for future in futures:
                response = future.result(timeout=120)
                record.tokens.append([s.tokens for s in response.sequences])
                record.logprobs.append([list(s.logprobs or []) for s in response.sequences])
    finally:
        service.close()
    return record


# ---- tenant B: every hostile input, in a loop, while A works ---------------------------------


@dataclass
class Hostile:
    tenant: Tenant
    model_id: str
    poisoned: str  # a sampler whose logits overflow
    poison_path: str  # its checkpoint
    nan_path: str  # a checkpoint holding NaN
    rounds: int = 0
    poisoned_answers: list[Answer] = field(default_factory=list)


def prepare_b(world: World) -> Hostile:
    b = Tenant(world.server.url, world.b_key)
    session = b.session()
    model_id = b.model(session, world.model, seed=5)
    b.forward_backward(model_id, TEXT)
    b.optim_step(model_id, learning_rate=0.05)
    poison_path = b.save(model_id, "sampler", "poison")
    nan_path = b.save(model_id, "weights", "nan")
    scale_checkpoint(world.server.data_dir, "poison", OVERFLOW[world.model])
    scale_checkpoint(world.server.data_dir, "nan", math.nan)
    poisoned = b.sampler(session, poison_path, seq=0)
    return Hostile(b, model_id, poisoned, poison_path, nan_path)


def hostile_round(h: Hostile, burst: threading.Event) -> None:
    b, model_id = h.tenant, h.model_id
    for lr in (1e308, math.inf, math.nan):
        refused = b.optim_step(model_id, learning_rate=lr)
        assert refused.status == 400, refused
        assert refused.body["field"] == "adam_params.learning_rate", refused
    b.forward_backward(model_id, TEXT, weight=1e36)
    for _ in range(2):  # the second divides a remembered huge moment by ~eps
        b.optim_step(model_id, learning_rate=1.0, beta2=0.0, eps=1e-30)
    body = {"model_id": model_id, "seq_id": b.next_seq(model_id), "path": h.nan_path}
    loaded = b.submit("load_weights", "load_weights", body)
    assert loaded.failed_as == "user", loaded
    burst.wait(timeout=5.0)
    burst.clear()
    pending = [b.asample(h.poisoned, PROMPTS[i % len(PROMPTS)], seed=i) for i in range(4)]
    h.poisoned_answers += [b.follow("poisoned asample", r) for r in pending]
    # The OpenAI route on the poisoned checkpoint: the user's error, a 400.
    body = {"model": h.poison_path, "prompt": PROMPTS[0], "max_tokens": 4}
    response = b.http.post("/oai/api/v1/completions", json=body)
    b.answers.append(Answer("oai completions", response.status_code, strict_json(response.text)))
    assert response.status_code == 400, response.text
    h.rounds += 1


def run_b(h: Hostile, done: threading.Event, burst: threading.Event, errors: list[Any]) -> None:
    try:
        while not done.is_set():
            hostile_round(h, burst)
    except BaseException as exc:  # reported by the test, on its own thread
        errors.append(exc)


# ---- the test -----------------------------------------------------------------------------------


def _same_floats(got: list[Any], want: list[Any], exact: bool) -> None:
    flat_got, flat_want = _flatten(got), _flatten(want)
    assert len(flat_got) == len(flat_want)
    if exact:
        assert flat_got == flat_want
    else:
        assert flat_got == pytest.approx(flat_want, rel=1e-4, abs=1e-5)


def _flatten(value: Any) -> list[float]:
    if isinstance(value, list):
        return [x for v in value for x in _flatten(v)]
    return [float(value)]


@pytest.mark.slow
def test_tenant_a_gets_what_it_gets_alone_while_tenant_b_poisons(world: World) -> None:
    hostile = prepare_b(world)
    try:
        _poisoned_run(world, hostile)
    finally:
        hostile.tenant.close()


def _poisoned_run(world: World, hostile: Hostile) -> None:
    alone = run_a(world)

    done, burst, errors = threading.Event(), threading.Event(), []
    attacker = threading.Thread(target=run_b, args=(hostile, done, burst, errors), daemon=True)
    attacker.start()
    try:
        crowded = run_a(world, on_sample=burst)
    finally:
        done.set()
        burst.set()
        attacker.join(timeout=120)
    assert not attacker.is_alive()
    assert not errors, errors
    assert hostile.rounds >= 1

    exact = world.model == FAKE
    assert crowded.tokens == alone.tokens
    _same_floats(crowded.losses, alone.losses, exact)
    _same_floats(crowded.grad_norms, alone.grad_norms, exact)
    _same_floats(crowded.logprobs, alone.logprobs, exact)
    assert all(math.isfinite(x) for x in _flatten([alone.losses, alone.grad_norms]))

    # B: never a 5xx, never a server error; its poisoned samples failed as its own errors.
    b = hostile.tenant
    assert all(a.status < 500 for a in b.answers), [a for a in b.answers if a.status >= 500]
    assert all(a.failed_as != "server" for a in b.answers), [
        a for a in b.answers if a.failed_as == "server"
    ]
    assert hostile.poisoned_answers
    for answer in hostile.poisoned_answers:
        assert answer.failed_as == "user", answer
        assert "non-finite" in answer.body["error"]
    steps = [a for a in b.answers if a.what.startswith("optim_step") and a.status == 200]
    assert steps
    for answer in steps:  # applied or skipped, every metric is a finite number
        assert answer.failed_as is None, answer
        assert all(math.isfinite(v) for v in answer.body["metrics"].values()), answer
    # B's adapter never became non-finite, whatever it tried.
    b.save(hostile.model_id, "weights", "after")
    weights = read_checkpoint(world.server.data_dir, "after")
    assert weights
    assert all(bool(np.isfinite(w).all()) for w in weights.values())


def test_strict_json_refuses_non_json_literals() -> None:
    assert strict_json('{"a": 1.5}') == {"a": 1.5}
    for literal in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(ValueError, match="non-JSON literal"):
            strict_json('{"a": ' + literal + "}")
