"""Tokenizers come from the server, never from a model hub.

`GET /api/v1/tokenizer?base_model=<name>` answers
`{"base_model": str, "files": {"<filename>": "<base64>"}, "sha256": "<hex>"}`. The files are
written once to `<cache>/tokenizers/<sha256>/` (cache = $TUNELOOP_CACHE_DIR or ~/.cache/tuneloop)
and loaded with `transformers.AutoTokenizer` from that directory, offline.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuneloop._http import env_cache_dir
from tuneloop.errors import APIResponseValidationError, TuneloopError

if TYPE_CHECKING:
    from tuneloop._futures import ClientHolder

__all__ = ["fetch_tokenizer_dir", "get_tokenizer", "tokenizer_cache_dir"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_lock = threading.Lock()
# (base_url, base_model) -> loaded tokenizer, so repeated get_tokenizer() calls are free.
_loaded: dict[tuple[str, str], Any] = {}


def tokenizer_cache_dir() -> Path:
    return env_cache_dir() / "tokenizers"


def _safe_filename(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise APIResponseValidationError(f"tokenizer file name {name!r} is not a plain file name")
    return name


def _write_cache(root: Path, digest: str, files: dict[str, bytes]) -> Path:
    """Write the files to root/digest atomically (a temp dir renamed into place)."""
    target = root / digest
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=root))
    try:
        for name, content in files.items():
            (staging / name).write_bytes(content)
        try:
            os.replace(staging, target)
        except OSError:
            if not target.is_dir():  # another process won the race: theirs is identical
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


async def fetch_tokenizer_dir(holder: ClientHolder, base_model: str) -> Path:
    """Download the base model's tokenizer files (once per content hash) and return their dir."""
    response = await holder.http.request(
        "GET", "/api/v1/tokenizer", params={"base_model": base_model}
    )
    try:
        payload = response.json()
        digest = str(payload["sha256"]).lower()
        encoded = payload["files"]
        if not isinstance(encoded, dict) or not encoded:
            raise ValueError("files must be a non-empty object")
        if not _SHA256.match(digest):
            raise ValueError(f"sha256 {digest!r} is not 64 hex digits")
        target = tokenizer_cache_dir() / digest
        if target.is_dir():
            return target
        files = {
            _safe_filename(str(name)): base64.b64decode(content, validate=True)
            for name, content in encoded.items()
        }
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise APIResponseValidationError(f"bad tokenizer response for {base_model}: {exc}") from exc
    return _write_cache(tokenizer_cache_dir(), digest, files)


def get_tokenizer(holder: ClientHolder, base_model: str) -> Any:
    """The HF tokenizer of `base_model`, from the server's files (blocks)."""
    key = (holder.base_url, base_model)
    with _lock:
        if key in _loaded:
            return _loaded[key]
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise TuneloopError(
            "get_tokenizer() needs the transformers package: pip install transformers"
        ) from exc
    directory = holder.submit(fetch_tokenizer_dir(holder, base_model)).result()
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    with _lock:
        _loaded[key] = tokenizer
    return tokenizer
