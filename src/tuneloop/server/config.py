"""Server configuration: frozen data, built once from CLI flags and the environment.

This is the only server module that reads environment variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ServerConfig:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    db_url: str | None = None  # default: SQLite under data_dir
    keys_file: Path | None = None  # default: data_dir/keys.json
    backend: str = "torch"
    models: tuple[str, ...] = field(default_factory=tuple)  # torch: default SmolLM2-135M
    device: str | None = None  # torch: default cuda if present, else cpu
    # torch: "bfloat16" or "float32"; default: measured per device (engine/dtypes.py)
    dtype: str | None = None
    # Converted and downloaded models, shared by every server on the machine.
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "tuneloop")
    # retrieve_future holds a poll this long before answering try_again; the official SDK's
    # read timeout for that call is 45 s.
    long_poll_s: float = 30.0
    result_grace_s: float = 300.0
    max_request_bytes: int = 64 * 1024 * 1024
    max_sample_batch: int = 64
    # How long a sampling or forward_backward batch waits for more requests to join it.
    batch_gather_s: float = 0.02

    @classmethod
    def from_env(cls, **overrides: object) -> ServerConfig:
        """Flags win over TUNELOOP_* environment variables, which win over defaults."""
        env: dict[str, object] = {}
        if "TUNELOOP_DATA_DIR" in os.environ:
            env["data_dir"] = Path(os.environ["TUNELOOP_DATA_DIR"])
        if "TUNELOOP_DB_URL" in os.environ:
            env["db_url"] = os.environ["TUNELOOP_DB_URL"]
        if "TUNELOOP_CACHE_DIR" in os.environ:
            env["cache_dir"] = Path(os.environ["TUNELOOP_CACHE_DIR"])
        if "TUNELOOP_LONG_POLL_S" in os.environ:
            env["long_poll_s"] = float(os.environ["TUNELOOP_LONG_POLL_S"])
        values = {**env, **{k: v for k, v in overrides.items() if v is not None}}
        values.setdefault("data_dir", Path(".tuneloop"))
        return cls(**values)  # type: ignore[arg-type]
