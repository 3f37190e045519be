"""What get_info names as the tokenizer: the server's folder (default), or the model's name
(`serve --tokenizer-id name`, for clients that installed the served tokenizer in their HF
cache with tuneloop.hf_cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.server.harness import MODEL, serve
from tuneloop.server.config import ServerConfig


@pytest.mark.parametrize("mode", ["path", "name"])
async def test_get_info_tokenizer_id(tmp_path: Path, mode: str) -> None:
    async with serve(tmp_path, tokenizer_id=mode) as api:
        model_id = await api.model(await api.session())
        info = (await api.post("get_info", {"model_id": model_id})).json()
        tokenizer_id = info["model_data"]["tokenizer_id"]
        if mode == "name":
            assert tokenizer_id == MODEL
        else:
            assert (Path(tokenizer_id) / "tokenizer.json").is_file()


def test_an_unknown_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer_id"):
        ServerConfig(data_dir=tmp_path, tokenizer_id="hub")
