"""Shared helpers for the torch-engine tests: a tiny-model backend and datum builders."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

TINY = "tuneloop/tiny-qwen3"
VOCAB = 259
EOS = 258
ADAM = (1e-2, 0.9, 0.999, 1e-8, 0.0, 0.0)


def packed_for_kernels(weight: Any) -> bool:
    """Whether a decode copy's weight is laid out for a CPU kernel: packed for oneDNN, or in
    the native linear kernel's blocks (native_linear.py)."""
    from tuneloop.server.engine.native_linear import NativeWeight

    return isinstance(weight, NativeWeight) or bool(weight.is_mkldnn)


def _torch_ready() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """The tiny models gain nothing from intra-op threads, and on a shared 2-core machine spinning
    OpenMP workers make them 10x slower; run torch single-threaded here."""
    if not _torch_ready():
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two torch threads inside one test: the native kernels' work split between them."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[Any]:
    if not _torch_ready():
        pytest.skip("torch/transformers not installed")
    from tuneloop.server.engine.torch_backend import TorchBackend

    be = TorchBackend([TINY], cache_dir=tmp_path / "cache", device="cpu")
    yield be
    be.close()


@pytest.fixture
def products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the LoRA products (`add_lora` calls) the adapted linear layers compute."""
    from tuneloop.server.engine.lora import linear

    calls = [0]
    original = linear.add_lora

    def counting(*args: Any) -> Any:
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(linear, "add_lora", counting)
    return calls


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One 2-rank worker group of the tiny model per test module (starting one costs seconds)."""
    from tuneloop.server.engine.workers.build import worker_group

    root = tmp_path_factory.mktemp("group")
    g = worker_group(
        (TINY,), workers=2, cache_dir=root / "cache", device="cpu", state_dir=root / "state"
    )
    yield g
    g.close()


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The one-process engine a module's worker group is compared with."""
    from tuneloop.server.engine.torch_backend import TorchBackend

    be = TorchBackend([TINY], cache_dir=tmp_path_factory.mktemp("single"), device="cpu")
    yield be
    be.close()


def adapter_spec(adapter_id: str, rank: int = 4, seed: int = 0, **kw: Any) -> Any:
    from tuneloop.server.engine.types import AdapterSpec

    return AdapterSpec(adapter_id, TINY, rank, seed, **kw)


def seq(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=length).astype(np.int64)


def example(sequence: np.ndarray, weights: np.ndarray | None = None, **inputs: np.ndarray) -> Any:
    """Next-token datum over `sequence`: tokens = seq[:-1], targets = seq[1:]."""
    from tuneloop.server.engine.types import Example

    n = len(sequence) - 1
    data: dict[str, np.ndarray] = {"target_tokens": np.asarray(sequence[1:], dtype=np.int64)}
    data["weights"] = (
        np.ones(n, dtype=np.float32) if weights is None else np.asarray(weights, np.float32)
    )
    data.update(inputs)
    return Example(np.asarray(sequence[:-1], dtype=np.int64), data)


def work(
    adapter_id: str,
    examples: Sequence[Any],
    *,
    loss_fn: str = "cross_entropy",
    forward_only: bool = False,
    config: dict[str, float] | None = None,
) -> Any:
    from tuneloop.server.engine.types import ForwardBackwardWork

    return ForwardBackwardWork(adapter_id, tuple(examples), loss_fn, config or {}, forward_only)


def adam(lr: float = 1e-2, **kw: float) -> Any:
    from tuneloop.server.engine.types import AdamStep

    values = dict(
        zip(("beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"), ADAM[1:], strict=True)
    )
    values.update(kw)
    return AdamStep(learning_rate=lr, **values)


def ok(result: Any) -> Any:
    from tuneloop.server.engine.types import EngineError

    assert not isinstance(result, EngineError), f"unexpected EngineError: {result}"
    return result


def forward(be: Any, adapter_id: str, examples: Sequence[Any]) -> list[np.ndarray]:
    """Per-datum logprobs of a forward-only pass."""
    [result] = be.forward_backward([work(adapter_id, examples, forward_only=True)])
    return [np.array(x) for x in ok(result).logprobs]


def train(be: Any, adapter_id: str, examples: Sequence[Any], steps: int, lr: float = 1e-2) -> None:
    for _ in range(steps):
        [result] = be.forward_backward([work(adapter_id, examples)])
        ok(result)
        be.optim_step(adapter_id, adam(lr))


def bank(be: Any) -> Any:
    """The adapter bank of the backend's one model."""
    [runtime] = be._runtimes.values()
    return runtime.bank


def params(be: Any, adapter_id: str) -> dict[str, Any]:
    """A copy of an adapter's factors, PEFT-named."""
    return {k: v.clone() for k, v in bank(be).state(adapter_id).items()}


def grads(be: Any, adapter_id: str) -> list[Any]:
    import torch

    return [
        torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for p in bank(be).parameters(adapter_id)
    ]


def max_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two arrays/tensors or dicts/lists of them."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max((max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, list | tuple):
        assert len(a) == len(b)
        return max((max_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    x, y = np.asarray(_numpy(a), dtype=np.float64), np.asarray(_numpy(b), dtype=np.float64)
    assert x.shape == y.shape, (x.shape, y.shape)
    if x.size == 0:
        return 0.0
    return float(np.max(np.abs(x - y)))


def _numpy(x: Any) -> Any:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x


def max_abs(a: Any) -> float:
    if isinstance(a, dict):
        return max((max_abs(v) for v in a.values()), default=0.0)
    if isinstance(a, list | tuple):
        return max((max_abs(v) for v in a), default=0.0)
    x = np.asarray(_numpy(a), dtype=np.float64)
    return float(np.max(np.abs(x))) if x.size else 0.0


def assert_near(a: Any, b: Any, atol: float, what: str = "", *, relative: bool = False) -> float:
    """max |a - b| <= atol; with `relative`, atol is scaled by max |b| (float32 sums of
    gradients carry an error relative to their magnitude)."""
    diff = max_diff(a, b)
    tol = atol * max(1.0, max_abs(b)) if relative else atol
    print(f"[diff] {what}: {diff:.3g} (tol {tol:.3g}, max |b| {max_abs(b):.3g})")
    assert diff <= tol, f"{what}: max abs diff {diff:.3g} > {tol:.3g}"
    return diff


async def stepping(loop: Any) -> Any:
    """Start the engine loop's next batch as a task; return it once the batch runs."""
    import asyncio

    step = asyncio.create_task(loop.step())
    for _ in range(2000):  # bounded: the batch starts within a few ms
        if loop.running is not None:
            break
        await asyncio.sleep(0.005)
    assert loop.running is not None
    return step


@pytest.fixture(params=["tiles", "loops"])
def linear_form(request: pytest.FixtureRequest) -> Iterator[str]:
    """The native linear kernel (linear_avx512.cpp) on the AMX tile unit, where the CPU has
    one, and on the AVX-512 loops: both forms run on one CPU."""
    from tuneloop.server.engine import native_linear

    if request.param == "tiles" and not native_linear.tiles(True):
        pytest.skip("no AMX tile unit granted on this CPU")
    native_linear.tiles(request.param == "tiles")
    yield request.param
    native_linear.tiles(True)
