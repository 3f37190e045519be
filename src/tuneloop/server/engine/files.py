"""Writing folders atomically: fill a temporary sibling, then rename it into place."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

# The files of a transformers tokenizer folder: served to clients and copied into exports.
# Weights never travel this way.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


@contextlib.contextmanager
def atomic_directory(directory: Path) -> Iterator[Path]:
    """Yield a temporary sibling to fill; it replaces `directory` only if the block succeeds.

    A crash mid-write leaves a hidden temporary folder, never a checkpoint that half loads.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        yield tmp
        for path in tmp.rglob("*"):  # the data dir's modes (storage/layout.py)
            path.chmod(0o700 if path.is_dir() else 0o600)
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def directory_size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
