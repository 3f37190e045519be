"""Our SDK drives a real `tuneloop serve` process on 127.0.0.1, exactly as a user would."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tuneloop
from tuneloop import AdamParams, Datum, ModelInput, SamplingParams
from tuneloop._local_server import LiveServer, create_key, live_server, stop

pytestmark = pytest.mark.integration
MODEL = "tuneloop/fake-tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("live"))) as live:
        yield live


@pytest.fixture
def service(server: LiveServer) -> Iterator[tuneloop.ServiceClient]:
    client = tuneloop.ServiceClient(base_url=server.url, api_key=server.key)
    yield client
    client.close()


def _datum(tokens: list[int], **inputs: object) -> Datum:
    inputs.setdefault("target_tokens", tokens[1:])
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def test_training_loop_with_pipelined_futures(service: tuneloop.ServiceClient) -> None:
    training = service.create_lora_training_client(MODEL, rank=8, seed=3)
    tokenizer = training.get_tokenizer()  # fetched from the server, no hub
    tokens = tokenizer.encode("tuneloop keeps the model resident between calls")
    data = [_datum(tokens)]
    # Submit a whole pipeline before waiting: the server runs it in submission order.
    futures = []
    for _ in range(5):
        futures.append(training.forward_backward(data, "cross_entropy"))
        futures.append(training.optim_step(AdamParams(learning_rate=0.05)))
    losses = [f.result(timeout=60).metrics["loss:sum"] for f in futures[::2]]
    assert all(b < a for a, b in itertools.pairwise(losses))

    state = training.save_state("trained").result(timeout=60)
    clone = service.create_training_client_from_state_with_optimizer(state.path)
    expected = training.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"]
    got = clone.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"]
    assert got == pytest.approx(expected, rel=1e-6)

    sampler = training.save_weights_and_get_sampling_client()
    prompt = ModelInput.from_ints(tokens[:4])
    response = sampler.sample(prompt, 4, SamplingParams(max_tokens=12, seed=5)).result(timeout=60)
    assert len(response.sequences) == 4
    assert all(len(s.logprobs or []) == len(s.tokens) for s in response.sequences)
    assert all(s.sequence_id for s in response.sequences)
    logprobs = sampler.compute_logprobs(prompt).result(timeout=60)
    assert logprobs[0] is None
    assert len(logprobs) == 4

    rest = service.create_rest_client()
    run = rest.get_training_run(training.model_id).result(timeout=60)
    assert run.base_model == MODEL
    assert run.lora_rank == 8
    paths = [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints]
    assert state.path in paths


def test_bad_input_is_a_clear_error_and_the_session_keeps_working(
    service: tuneloop.ServiceClient,
) -> None:
    training = service.create_lora_training_client(MODEL, rank=4)
    bad = _datum(
        [1, 2, 3, 4],
        advantages=np.array([0.0, np.nan, 1.0], dtype=np.float32),
        logprobs=[-1.0, -1.0, -1.0],
    )
    with pytest.raises(tuneloop.BadRequestError, match="advantages"):
        training.forward_backward([bad], "importance_sampling").result(timeout=60)
    with pytest.raises(tuneloop.BadRequestError, match="target_tokens"):
        training.forward_backward([_datum([1, 2, 99999])], "cross_entropy").result(timeout=60)
    good = training.forward_backward([_datum([1, 2, 3, 4])], "cross_entropy").result(timeout=60)
    assert good.metrics["loss:sum"] > 0
    training.optim_step(AdamParams(learning_rate=0.01)).result(timeout=60)


def test_many_threads_sampling_at_once(service: tuneloop.ServiceClient) -> None:
    sampler = service.create_sampling_client(base_model=MODEL)
    results: list[int] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            futures = [
                sampler.sample(
                    ModelInput.from_ints([i + 1, j + 1]), 1, SamplingParams(max_tokens=4, seed=j)
                )
                for j in range(8)
            ]
            results.extend(len(f.result(timeout=120).sequences) for f in futures)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors
    assert results == [1] * 128


def test_revoked_key_stops_working_at_once(server: LiveServer) -> None:
    key = create_key(server.data_dir, "carol")
    service = tuneloop.ServiceClient(base_url=server.url, api_key=key)
    assert service.get_server_capabilities().supported_models
    listing = subprocess.run(
        [sys.executable, "-m", "tuneloop", "keys", "--data-dir", str(server.data_dir), "list"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    key_id = next(line.split("\t")[0] for line in listing.splitlines() if "\tcarol\t" in line)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tuneloop",
            "keys",
            "--data-dir",
            str(server.data_dir),
            "revoke",
            key_id,
        ],
        check=True,
        timeout=60,
    )
    with pytest.raises(tuneloop.AuthenticationError):
        tuneloop.RestClient(base_url=server.url, api_key=key).list_training_runs().result(60)


def test_server_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    with live_server(tmp_path) as live:
        code = stop(live.process)
    assert code == 0
