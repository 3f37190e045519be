"""The zoo's models, saved once per test session as HF folders (built in code, no hub)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads on a shared machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model_folder(zoo_dir: Path, arch: str) -> Path:
    from tests.zoo.archs import save

    folder = zoo_dir / arch
    if not (folder / "config.json").is_file():
        folder.mkdir()
        save(arch, folder)
    return folder
