"""TorchBackend.kv_cache_use: the KV tokens a running decode run holds, read while it decodes.

Two requests decode together; when the shorter one is delivered (on the engine thread, mid-run)
the longer one still holds its cache rows, so the reading is above zero and its bytes are the
tokens times the tiny model's per-token size; once the run ends it reads zero again.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.unit.engine.conftest import TINY, seq
from tuneloop.server.engine.backend import KVCacheUse, ReportsKVCache
from tuneloop.server.engine.types import SampleWork


def test_kv_use_while_decoding_and_after(backend: Any) -> None:
    from tuneloop.server.engine.memory import CPU_MIN_KV_TOKENS, kv_bytes_per_token

    assert isinstance(backend, ReportsKVCache)
    before = backend.kv_cache_use()  # no pool yet: what it will take, sized from free memory
    assert before.tokens == before.bytes == 0
    assert before.token_budget >= CPU_MIN_KV_TOKENS
    backend.create_sampler("s", TINY)
    short = SampleWork("s", seq(5, 1), 1, 2, 1.0, -1, 1.0, 1, (), ())
    long = SampleWork("s", seq(7, 2), 2, 24, 1.0, -1, 1.0, 2, (), ())
    seen: list[KVCacheUse] = []

    def deliver(work: SampleWork, result: Any) -> None:
        seen.append(backend.kv_cache_use())

    backend.sample_continuous([short, long], list, deliver)
    assert len(seen) == 2
    during = seen[0]  # the short request is done, the long one's two rows still decode
    assert during.tokens >= 2 * (7 + 2)
    model = next(iter(backend._runtimes.values())).loaded.model
    per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
    assert per_token > 0
    assert during.bytes == during.tokens * per_token
    pool = next(iter(backend._runtimes.values())).decoder.blocks
    assert during.token_budget == pool.num_blocks * pool.block_size >= CPU_MIN_KV_TOKENS
    assert backend.kv_cache_use().tokens == 0


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer() -> None:
    import torch

    from tuneloop.server.engine.memory import kv_bytes_per_token

    class Config:
        num_hidden_layers = 4
        num_attention_heads = 8
        num_key_value_heads = 2
        hidden_size = 256
        head_dim = 64

    # 2 (key, value) x 4 layers x 2 kv heads x 64 dims x 4 bytes
    assert kv_bytes_per_token(Config(), torch.float32) == 2 * 4 * 2 * 64 * 4
    assert kv_bytes_per_token(Config(), torch.bfloat16) == 2 * 4 * 2 * 64 * 2
