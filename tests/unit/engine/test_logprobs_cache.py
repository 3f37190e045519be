"""A training pass's decoder call builds no KV cache (logprobs.py): an evaluated model's
decoder would otherwise make one, a copy of every layer's keys and values, that nothing reads.
Both forms of the call: a packed row (positions given) and right-padded rows."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.unit.engine.test_rotary import _tiny_llama  # noqa: E402
from tuneloop.server.engine import logprobs  # noqa: E402


@pytest.mark.parametrize("packed", [True, False])
def test_the_decoder_is_called_without_a_cache(packed: bool) -> None:
    model = _tiny_llama()
    assert model.config.use_cache  # (the model's own default would build one)
    seen: list[Any] = []
    decoder = model.get_decoder()
    hook = decoder.register_forward_hook(
        lambda module, args, kwargs, out: seen.append((kwargs.get("use_cache"), out)),
        with_kwargs=True,
    )
    try:
        ids = torch.randint(0, 128, (1, 7) if packed else (2, 5))
        positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]]) if packed else None
        lengths = [3, 4] if packed else [5, 3]
        with torch.no_grad():
            hidden, _, _, vocab = logprobs._hidden_and_head(model, ids, lengths, positions)
    finally:
        hook.remove()
    assert vocab == 128
    assert hidden.shape[:2] == ids.shape
    [(use_cache, out)] = seen
    assert use_cache is False
    assert out.past_key_values is None
