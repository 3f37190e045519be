"""Worker groups placed by Ray: a private local Ray (2 CPUs, 127.0.0.1), one actor per worker,
torch.distributed meeting at the rank-0 actor's address. The group trains as the
single-process backend does; without Ray installed, asking for it is a clear error."""

from __future__ import annotations

import builtins
from collections.abc import Iterator
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
    params,
    seq,
    work,
)
from tuneloop.server.engine.checkpoints import read_factors  # noqa: E402


def test_ray_address_without_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from tuneloop.server.engine.workers.build import worker_group

    real_import = builtins.__import__

    def no_ray(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(RuntimeError, match=r"--ray-address needs Ray: pip install"):
        worker_group((TINY,), workers=2, cache_dir=Path("unused"), ray_address="auto")


@pytest.fixture
def local_ray() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_group_on_ray_trains_like_one_process(local_ray: Any, backend: Any, tmp_path: Path) -> None:
    from tuneloop.server.engine.workers.build import worker_group

    group = worker_group(
        (TINY,), workers=2, cache_dir=tmp_path / "cache", device="cpu", ray_address="local"
    )
    try:
        _trains_like(group, backend, tmp_path, (33, 8, 21, 12))
    finally:
        group.close()


def _trains_like(group: Any, backend: Any, tmp_path: Path, lengths: tuple[int, ...]) -> None:
    """Two steps on the group and on one process: the same losses and the same saved factors."""
    assert len(set(group.worker_pids())) == 2
    data = [example(seq(n, 40 + n)) for n in lengths]
    losses = []
    for be in (group, backend):
        be.create_adapter(adapter_spec("r", rank=4, seed=1))
        for _ in range(2):
            losses.append(ok(be.forward_backward([work("r", data)])[0]).metrics["loss:sum"])
            be.optim_step("r", adam(1e-2))
    assert_near(losses[:2], losses[2:], 1e-5, "loss sums", relative=True)
    group.save_state("r", tmp_path / "saved", optimizer=False)
    assert_near(read_factors(tmp_path / "saved"), params(backend, "r"), 1e-4, "weights")


@pytest.mark.slow
def test_a_sharded_group_on_ray_trains_like_one_process(local_ray: Any, tmp_path: Path) -> None:
    """`--shard-weights fsdp` placed by Ray: the actors run the sharded runtime, and training
    equals one process at the same dtype."""
    from tuneloop.server.engine.torch_backend import TorchBackend
    from tuneloop.server.engine.workers.build import worker_group

    backend = TorchBackend([TINY], cache_dir=tmp_path / "one", device="cpu", dtype=torch.float32)

    group = worker_group(
        (TINY,),
        workers=2,
        cache_dir=tmp_path / "cache",
        device="cpu",
        dtype="float32",
        ray_address="local",
        shard_weights="fsdp",
    )
    try:
        _trains_like(group, backend, tmp_path, (33, 8, 21))
    finally:
        group.close()
        backend.close()
