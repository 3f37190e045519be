"""Training micro-batches sized from free memory."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import TINY  # noqa: E402
from tuneloop.server.engine import memory  # noqa: E402
from tuneloop.server.engine.torch_backend import TorchBackend  # noqa: E402

SMOLLM2 = SimpleNamespace(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9
)
CPU = torch.device("cpu")


def test_free_memory_is_read_on_this_machine() -> None:
    free = memory.free_bytes(CPU)
    assert free is not None
    assert free > 0


def test_per_token_estimate_follows_model_size_and_dtype() -> None:
    fp32 = memory.activation_bytes_per_token(SMOLLM2, torch.float32)
    assert 1.2e6 < fp32 < 1.6e6  # ~1.4 MB per token, all 30 layers
    assert memory.activation_bytes_per_token(SMOLLM2, torch.bfloat16) == fp32 // 2
    assert memory.activation_bytes_per_token(SMOLLM2, torch.float32, CPU) == fp32


def test_cpu_half_precision_counts_the_saved_attention_probabilities() -> None:
    """bf16 attention on a CPU keeps 9 heads x up to 1,024 keys per token and layer."""
    bf16 = memory.activation_bytes_per_token(SMOLLM2, torch.bfloat16)
    on_cpu = memory.activation_bytes_per_token(SMOLLM2, torch.bfloat16, CPU)
    assert on_cpu - bf16 == 30 * 9 * 1024 * 2
    gpu = torch.device("cuda")
    assert memory.activation_bytes_per_token(SMOLLM2, torch.bfloat16, gpu) == bf16


@pytest.mark.parametrize(
    ("free_gb", "expected"),
    [(0.5, memory.MIN_TOKEN_BUDGET), (16.0, None), (10_000.0, memory.MAX_TOKEN_BUDGET)],
)
def test_budget_is_a_share_of_free_memory_clamped(
    monkeypatch: pytest.MonkeyPatch, free_gb: float, expected: int | None
) -> None:
    monkeypatch.setattr(memory, "free_bytes", lambda _device: int(free_gb * 1e9))
    budget = memory.training_token_budget(SMOLLM2, torch.float32, CPU)
    if expected is not None:
        assert budget == expected
    else:  # 40 % of 16 GB, less the head's chunk, over ~1.43 MB per token
        assert 3500 < budget < 4500


def test_backend_sizes_its_micro_batches_from_free_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(memory, "free_bytes", lambda _device: int(2e9))
    be = TorchBackend([TINY], cache_dir=tmp_path, device="cpu")
    [runtime] = be._runtimes.values()
    expected = memory.training_token_budget(runtime.model.config, torch.float32, CPU)
    assert be.token_budget == expected
    assert memory.MIN_TOKEN_BUDGET < be.token_budget < memory.MAX_TOKEN_BUDGET
    assert (
        TorchBackend([TINY], cache_dir=tmp_path, device="cpu", token_budget=64).token_budget == 64
    )
