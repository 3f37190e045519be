"""Server configuration: frozen data, built once from CLI flags and the environment.

This is the only server module that reads environment variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

# Environment variable -> config field -> parser, for the quota and expiry numbers.
_NUMBERS: tuple[tuple[str, str, type[int] | type[float]], ...] = (
    ("TUNELOOP_MAX_SESSIONS", "max_sessions", int),
    ("TUNELOOP_MAX_INFLIGHT", "max_inflight", int),
    ("TUNELOOP_SESSION_TTL_S", "session_ttl_s", float),
    ("TUNELOOP_EXPIRY_CHECK_S", "expiry_check_s", float),
    ("TUNELOOP_KV_CACHE_TOKENS", "kv_cache_tokens", int),
)


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
    # torch: RMSNorms and the CPU decode attention as compiled kernels (engine/compiled.py,
    # engine/kv/decode_attention.py); None: on a CPU for models 256 or more wide, where the
    # seconds of compiling at load pay back.
    compile_norms: bool | None = None
    # torch: True, a decode step whose rows all sample one adapter snapshot runs on its merged
    # weights (sibling layers stacked, no LoRA products); False: never; None: at fp32 on a CPU
    # (merging loses nothing there), else the fused weights where the CPU packs half-precision
    # ones (the delta exact, in extra columns) or the LoRA products. bf16 merged weights are
    # faster (1.15-1.2x the fused ones) but round most of a young adapter's delta away, so the
    # sampler draws further from the trained policy (SmolLM2-135M bf16: largest logprob gap
    # to a training pass 0.44-0.55 merged against 0.13-0.21; docs/benchmarks.md).
    merged_sampling: bool | None = None
    # torch: decode steps replayed as CUDA graphs (engine/decode_graphs.py); None: on a GPU.
    decode_graphs: bool | None = None
    # torch: tokens of each model's sampling KV cache; None: sized from the memory free when
    # it is made (engine/memory.py: a share of it, on a CPU within 32,768-262,144 tokens).
    kv_cache_tokens: int | None = None
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
    # Per-tenant quotas (0 = unlimited); `tuneloop keys limits` overrides them per tenant in
    # limits_file (default: limits.json beside the keys file). Past one, requests get a 429.
    # Sessions: unfinished and unexpired. In flight: submitted requests without a result yet;
    # 2048 is above the 1,000 futures a single client keeps in flight in bench/control_plane.py.
    max_sessions: int = 64
    max_inflight: int = 2048
    limits_file: Path | None = None
    # A session with no activity (heartbeat or request) for this long expires: its adapters and
    # samplers are freed, its queued work fails; its checkpoints stay. Both SDKs heartbeat every
    # 10 s, so 300 s is 30 missed heartbeats (the official SDK warns after 120 s). 0: never.
    session_ttl_s: float = 300.0
    # How often the server looks for expired sessions.
    expiry_check_s: float = 10.0
    # Engine worker processes (one per device); 1 runs the engine in the server process.
    workers: int = 1
    # Place the worker group on this Ray cluster ("auto": the one this machine belongs to).
    ray_address: str | None = None
    # Resources of each worker's Ray actor (a fraction shares a device between workers).
    ray_cpus_per_worker: float = 1.0
    ray_gpus_per_worker: float = 0.0
    # "fsdp": the worker group shards the base weights across its workers (FSDP2) instead of
    # each holding a replica, for models larger than one device.
    shard_weights: str = "none"
    # A deployment (`tuneloop deploy`): only the OpenAI-compatible routes, no training routes.
    openai_only: bool = False
    # GET /metrics answers only `Authorization: Bearer <metrics_token>` when set; unset, the
    # metrics are open to whoever reaches the server's host and port.
    metrics_token: str | None = None
    # "text": the logs as before (warnings and errors); "json": JSON lines on stderr, one
    # access line per request included (api/access_log.py).
    log_format: str = "text"
    # JWT exchange (`serve --jwt`): POST /api/v1/auth/token trades an API key for a signed token
    # this long-lived, which the official SDK sends instead of the key and renews at half its
    # life (its own rule: renew when under 60 s left, so keep this well above 60).
    jwt: bool = False
    jwt_ttl_s: int = 900
    # What get_info names as the tokenizer: "path", the server's local folder (the official SDK
    # loads it with no hub when it runs on this machine), or "name", the model's name (for
    # clients elsewhere that installed the served tokenizer in their HF cache: tuneloop.hf_cache).
    tokenizer_id: str = "path"

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_inflight", "session_ttl_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {getattr(self, name)}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if (self.workers > 1 or self.ray_address is not None) and self.backend != "torch":
            raise ValueError("--workers > 1 and --ray-address need the torch backend")
        if self.shard_weights not in ("none", "fsdp"):
            raise ValueError(f"shard_weights must be none or fsdp, got {self.shard_weights!r}")
        if self.shard_weights != "none" and self.workers < 2 and self.ray_address is None:
            raise ValueError("--shard-weights needs a worker group: --workers 2 or more")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if self.tokenizer_id not in ("path", "name"):
            raise ValueError(f"tokenizer_id must be 'path' or 'name', got {self.tokenizer_id!r}")
        if self.jwt_ttl_s < 120:
            raise ValueError(f"jwt_ttl_s must be >= 120, got {self.jwt_ttl_s}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.expiry_check_s <= 0:
            raise ValueError(f"expiry_check_s must be > 0, got {self.expiry_check_s}")

    @property
    def limits_path(self) -> Path:
        """Per-tenant quota overrides: beside the keys file, so both move together."""
        if self.limits_file is not None:
            return self.limits_file
        keys = self.keys_file or self.data_dir / "keys.json"
        return keys.parent / "limits.json"

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
        for name, key, parse in _NUMBERS:
            if name in os.environ:
                env[key] = parse(os.environ[name])
        if os.environ.get("TUNELOOP_METRICS_TOKEN"):
            env["metrics_token"] = os.environ["TUNELOOP_METRICS_TOKEN"]
        if "TUNELOOP_LOG_FORMAT" in os.environ:
            env["log_format"] = os.environ["TUNELOOP_LOG_FORMAT"]
        if "TUNELOOP_LIMITS_FILE" in os.environ:
            env["limits_file"] = Path(os.environ["TUNELOOP_LIMITS_FILE"])
        values = {**env, **{k: v for k, v in overrides.items() if v is not None}}
        values.setdefault("data_dir", Path(".tuneloop"))
        return cls(**values)  # type: ignore[arg-type]
