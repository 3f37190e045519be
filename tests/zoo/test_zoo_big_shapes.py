"""What a rank-32 adapter with its optimizer state takes on the released MoE shapes
(GPT-OSS-20B, Qwen3-30B-A3B), computed from their configs on the meta device: the figures
docs/benchmarks.md ("Adapter memory at rank 32") states."""

from __future__ import annotations

import pytest

from tests.zoo.archs import published_config
from tuneloop.server.engine.memory import ADAPTER_BYTES_PER_PARAMETER, adapter_memory

GIB = 2**30


@pytest.mark.parametrize(
    ("name", "all_m", "all_gib", "attn_m", "attn_gib"),
    [("gpt-oss-20b", 376.3, 5.61, 15.9, 0.24), ("qwen3-30b-a3b", 1290.0, 19.22, 26.7, 0.40)],
)
def test_rank_32_adapter_memory_on_released_moe_shapes(
    name: str, all_m: float, all_gib: float, attn_m: float, attn_gib: float
) -> None:
    config = published_config(name)
    parameters, nbytes = adapter_memory(config, 32)
    assert nbytes == ADAPTER_BYTES_PER_PARAMETER * parameters
    assert (round(parameters / 1e6, 1), round(nbytes / GIB, 2)) == (all_m, all_gib)
    attention, attention_bytes = adapter_memory(config, 32, train_mlp=False, train_unembed=False)
    assert (round(attention / 1e6, 1), round(attention_bytes / GIB, 2)) == (attn_m, attn_gib)
    # The experts are nearly all of it, and train_experts sets them apart from train_mlp.
    no_experts, _ = adapter_memory(config, 32, train_experts=False)
    assert no_experts < 0.1 * parameters
    assert adapter_memory(config, 16)[0] * 2 == parameters  # linear in the rank
