"""Put a served model's tokenizer into the local Hugging Face cache, under the model's name, so
code that loads tokenizers by model name with `transformers.AutoTokenizer` works offline
against a tuneloop server: the official tinker SDK's `SamplingClient.get_tokenizer()` (which
only knows the base model's name), and any script written for the hub.

    python -m tuneloop.hf_cache MODEL [--base-url URL] [--api-key KEY]

then run with `HF_HUB_OFFLINE=1`. The files come from the server (`GET /api/v1/tokenizer`), and
land as one snapshot of a model repository (`models--<org>--<name>/snapshots/<rev>/`, with
`refs/main` naming it), the layout huggingface_hub reads.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path

import httpx

from tuneloop._tokenizer import _safe_filename

__all__ = ["hf_hub_cache", "install_tokenizer"]

# What transformers' AutoTokenizer may look for besides the tokenizer files themselves.
_OPTIONAL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "preprocessor_config.json",
)


def hf_hub_cache() -> Path:
    """Where huggingface_hub keeps repositories: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return Path(home) / "hub"


def install_tokenizer(
    base_model: str,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    cache: Path | None = None,
) -> Path:
    """Fetch `base_model`'s tokenizer files from the server and install them as the `main`
    revision of repository `base_model` in the HF cache; the snapshot folder."""
    url = (base_url or os.environ.get("TINKER_BASE_URL") or "http://127.0.0.1:8000").rstrip("/")
    key = api_key or os.environ.get("TINKER_API_KEY") or os.environ.get("TUNELOOP_API_KEY", "")
    response = httpx.get(
        f"{url}/api/v1/tokenizer",
        params={"base_model": base_model},
        headers={"X-API-Key": key},
        timeout=60,
    )
    response.raise_for_status()
    payload = response.json()
    revision = str(payload["sha256"])[:40]  # a 40-hex name, as a commit id would be
    repo = (cache or hf_hub_cache()) / ("models--" + base_model.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, content in payload["files"].items():
        (snapshot / _safe_filename(str(name))).write_bytes(base64.b64decode(content))
    # Files the server did not send are marked absent in this revision (huggingface_hub's
    # `.no_exist` markers): offline, a loader asking for one then gets "not there", not an error.
    absent = repo / ".no_exist" / revision
    absent.mkdir(parents=True, exist_ok=True)
    for name in _OPTIONAL_FILES:
        if name not in payload["files"]:
            (absent / name).touch()
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tuneloop.hf_cache", description=__doc__)
    parser.add_argument("model", help="a base model the server serves")
    parser.add_argument("--base-url", help="default: $TINKER_BASE_URL, else 127.0.0.1:8000")
    parser.add_argument("--api-key", help="default: $TINKER_API_KEY")
    args = parser.parse_args(argv)
    path = install_tokenizer(args.model, base_url=args.base_url, api_key=args.api_key)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
