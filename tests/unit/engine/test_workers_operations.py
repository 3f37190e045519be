"""A worker group takes operations as values: each travels to the ranks as itself, and the one
in flight when a worker dies runs again on the restored group with the same result."""

from __future__ import annotations

import os
import signal
from pathlib import Path
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
from tuneloop.server.engine.checkpoints import read_factors  # noqa: E402
from tuneloop.server.engine.operations import (  # noqa: E402
    CreateAdapter,
    CreateSampler,
    LoadAdapter,
    LoadState,
    OptimStep,
    RunsOperations,
    SaveSamplerWeights,
    SaveState,
    run_operation,
)
from tuneloop.server.engine.types import EngineError  # noqa: E402


def test_operations_run_as_values_and_the_one_in_flight_survives_a_killed_worker(
    group: Any, tmp_path: Path
) -> None:
    assert isinstance(group, RunsOperations)
    run_operation(group, CreateAdapter(adapter_spec("op-src", rank=4, seed=3)))
    ok(group.forward_backward([work("op-src", [example(seq(20, 1)), example(seq(9, 2))])])[0])
    metrics = run_operation(group, OptimStep("op-src", adam(1e-2)))
    assert metrics["grad_norm"] > 0
    saved = tmp_path / "saved"
    target = "tinker://op-src/weights/saved"
    assert run_operation(group, SaveState("op-src", saved, True, False, target)) > 0

    restarts = group.restarts
    os.kill(group.worker_pids()[1], signal.SIGKILL)
    spec = adapter_spec("op-dst", rank=4, seed=9)
    run_operation(group, LoadAdapter(spec, saved, optimizer=True, path=target))
    assert group.restarts == restarts + 1  # the group was restored, and the load ran again
    out = tmp_path / "dst"
    run_operation(group, SaveSamplerWeights("op-dst", out))
    assert_near(read_factors(out), read_factors(saved), 0.0, "loaded factors")
    # A sampler made from it on the restored group samples on every rank.
    run_operation(group, CreateSampler("op-s", TINY, adapter_id="op-dst"))
    assert "op-s" in group._snap.samplers

    # Engine-side checks of the operation values hold on the group as on one process.
    with pytest.raises(EngineError, match="already exists") as exists:
        run_operation(group, SaveState("op-src", saved, True, False, target))
    assert exists.value.category == "user"
    with pytest.raises(EngineError, match="missing") as gone:
        run_operation(group, LoadState("op-dst", tmp_path / "missing", True, "tinker://gone"))
    assert gone.value.category == "user"
    with pytest.raises(EngineError):
        run_operation(group, LoadAdapter(adapter_spec("op-bad"), tmp_path / "missing", True, "p"))
    # A load that failed leaves no adapter behind, on any rank.
    [missing] = group.forward_backward([work("op-bad", [example(seq(8, 4))])])
    assert isinstance(missing, EngineError)
