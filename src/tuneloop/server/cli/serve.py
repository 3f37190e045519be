"""`tuneloop serve`: run the server with uvicorn until stopped (SIGTERM exits 0)."""

from __future__ import annotations

import os
import signal
import threading
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from tuneloop.server.cli import preload
from tuneloop.server.cli.common import (
    EXIT_USAGE,
    DataDirOption,
    DbUrlOption,
    DeviceOption,
    HostOption,
    KeysFileOption,
    LogFormatOption,
    MetricsTokenOption,
    PortOption,
    fail,
    need_server_extra,
)
from tuneloop.server.config import ServerConfig

# The defaults of api/http_timeouts.py, repeated: importing it here would import uvicorn before
# the command can say that the server extra is missing.
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0


class BackendName(StrEnum):
    torch = "torch"
    fake = "fake"


class TokenizerIdName(StrEnum):
    path = "path"
    name = "name"


class DtypeName(StrEnum):
    bfloat16 = "bfloat16"
    float32 = "float32"


class ShardWeights(StrEnum):
    none = "none"
    fsdp = "fsdp"


def serve(
    host: HostOption = "127.0.0.1",
    port: PortOption = 8000,
    data_dir: DataDirOption = None,
    db_url: DbUrlOption = None,
    keys_file: KeysFileOption = None,
    backend: Annotated[
        BackendName,
        typer.Option(
            help="torch: the real engine; fake: a NumPy stand-in for testing the service."
        ),
    ] = BackendName.torch,
    models: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            metavar="NAME_OR_PATH",
            help="Base model to keep resident (repeatable; default: SmolLM2-135M-Instruct).",
            show_default=False,
        ),
    ] = None,
    device: DeviceOption = None,
    dtype: Annotated[
        DtypeName | None,
        typer.Option(
            help=(
                "Base model weights (default: bfloat16 on GPUs and on CPUs where a timed matmul"
                " shows bf16 faster, e.g. AMX; float32 otherwise). LoRA factors, optimizer"
                " state, losses and logprobs are float32 either way."
            ),
            show_default=False,
        ),
    ] = None,
    compile_norms: Annotated[
        bool | None,
        typer.Option(
            "--compile-norms/--no-compile-norms",
            help=(
                "Run the model's RMSNorms and, on a CPU, its decode attention as kernels"
                " compiled by torch.compile, at load (default: for models 256 or more wide;"
                " seconds of compiling at start; on a CPU ~1.1x faster training and decode"
                " steps, on a GPU inside the decode graphs only, 1.07x an 8B model's step;"
                " bf16 on a CPU with AVX512-BF16: the decode attention is a C++ kernel built"
                " with the system compiler instead; at bf16 on a CPU, sampling steps' norms,"
                " SiLU products and rotary embeddings run as C++ loops with eager's bits)."
            ),
            show_default=False,
        ),
    ] = None,
    jemalloc: Annotated[
        bool,
        typer.Option(
            "--jemalloc/--no-jemalloc",
            help=(
                "For the torch engine on a CPU, start again with the system's jemalloc"
                " preloaded where it is installed (sampling after training steps ran 1.15x"
                " slower on glibc's fragmented heap; see cli/preload.py). Also"
                " TUNELOOP_JEMALLOC=0."
            ),
        ),
    ] = True,
    decode_graphs: Annotated[
        bool | None,
        typer.Option(
            "--decode-graphs/--no-decode-graphs",
            help=(
                "Replay decode steps as CUDA graphs, one per bucket of rows, context width and"
                " adapters (default: on a GPU; 2.7x faster decode steps of an 8B model at 128"
                " rows on an H200). No effect on a CPU."
            ),
            show_default=False,
        ),
    ] = None,
    kv_cache_tokens: Annotated[
        int | None,
        typer.Option(
            "--kv-cache-tokens",
            min=1,
            help=(
                "Tokens of each model's sampling KV cache (default: a share of the memory free"
                " when it is made; on a CPU 20 %, within 32,768-262,144 tokens). Requests whose"
                " worst case does not fit wait; also TUNELOOP_KV_CACHE_TOKENS."
            ),
            show_default=False,
        ),
    ] = None,
    merged_sampling: Annotated[
        bool | None,
        typer.Option(
            "--merged-sampling/--no-merged-sampling",
            help=(
                "Sample a lone adapter snapshot on its merged weights (default: at fp32 on a"
                " CPU, where merging loses nothing; at bf16 the fused weights keep the delta"
                " exact). bf16 merged decode steps are 1.15-1.2x faster than fused ones on an"
                " AVX-512-BF16 Xeon, but round most of a young adapter's delta away: the"
                " sampler's logprobs sit ~2-3x further from a training pass's. For evaluation"
                " sampling, not for RL."
            ),
            show_default=False,
        ),
    ] = None,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            help="Converted models (default: $TUNELOOP_CACHE_DIR, else ~/.cache/tuneloop).",
            show_default=False,
        ),
    ] = None,
    long_poll_s: Annotated[
        float | None,
        typer.Option(
            help="Seconds retrieve_future holds a poll before answering try-again (default 30).",
            show_default=False,
        ),
    ] = None,
    max_sessions: Annotated[
        int | None,
        typer.Option(
            min=0,
            help=(
                "Live (unfinished, unexpired) sessions per tenant; past it create_session gets a"
                " retryable 429. 0: unlimited. Per tenant: `tuneloop keys limits`."
                " [default: $TUNELOOP_MAX_SESSIONS, else 64]"
            ),
            show_default=False,
        ),
    ] = None,
    max_inflight: Annotated[
        int | None,
        typer.Option(
            min=0,
            help=(
                "Requests per tenant submitted and not yet completed; past it new ones get a"
                " retryable 429. 0: unlimited. [default: $TUNELOOP_MAX_INFLIGHT, else 2048]"
            ),
            show_default=False,
        ),
    ] = None,
    session_ttl_s: Annotated[
        float | None,
        typer.Option(
            min=0,
            help=(
                "Seconds without a heartbeat or request after which a session expires: its"
                " models and samplers are freed, its pending work fails, its checkpoints stay."
                " 0: never."
                " [default: $TUNELOOP_SESSION_TTL_S, else 300]"
            ),
            show_default=False,
        ),
    ] = None,
    expiry_check_s: Annotated[
        float | None,
        typer.Option(
            min=0.01,
            help="Seconds between looks for expired sessions. [default: 10]",
            show_default=False,
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help=(
                "Engine worker processes, one per device (GPUs; on a CPU they share its cores):"
                " training batches are sharded across them (data parallel), sampling requests"
                " spread over them, and a worker that dies is restarted with its adapters."
                " 1: the engine runs in the server process."
            ),
        ),
    ] = 1,
    shard_weights: Annotated[
        ShardWeights,
        typer.Option(
            help=(
                "fsdp: shard the base model's weights across the workers (FSDP2) instead of"
                " a full replica per worker, for a model larger than one device; every worker"
                " then runs every batch. E.g. a model that needs 4 GPUs: --workers 4"
                " --shard-weights fsdp (or --ray-address auto --ray-gpus-per-worker 1 across"
                " nodes). Refused at start, with the numbers, when the workers cannot hold it."
            ),
        ),
    ] = ShardWeights.none,
    ray_address: Annotated[
        str | None,
        typer.Option(
            metavar="ADDR|auto",
            help=(
                "Place the worker group on this Ray cluster (auto: the one this machine"
                " joined), one actor per worker. Needs the ray extra."
            ),
            show_default=False,
        ),
    ] = None,
    ray_cpus_per_worker: Annotated[
        float, typer.Option(min=0, help="CPUs each worker's Ray actor reserves.")
    ] = 1.0,
    ray_gpus_per_worker: Annotated[
        float, typer.Option(min=0, help="GPUs each worker's Ray actor reserves (1 on GPUs).")
    ] = 0.0,
    metrics_token: MetricsTokenOption = None,
    log_format: LogFormatOption = None,
    jwt: Annotated[
        bool,
        typer.Option(
            "--jwt",
            help=(
                "JWT exchange: clients trade their API key for a short-lived signed token at"
                " POST /api/v1/auth/token (the official SDK then renews it by itself, and"
                " RestClient.whoami works); revoking the key stops its tokens."
            ),
        ),
    ] = False,
    jwt_ttl_s: Annotated[
        int | None,
        typer.Option(
            min=120, help="Seconds an issued token lives. [default: 900]", show_default=False
        ),
    ] = None,
    tokenizer_id: Annotated[
        TokenizerIdName | None,
        typer.Option(
            help=(
                "What get_info names as the tokenizer: path (the server's folder, for clients on"
                " this machine) or name (the model's name, for clients that ran"
                " `python -m tuneloop.hf_cache MODEL`). [default: path]"
            ),
            show_default=False,
        ),
    ] = None,
    parent_pid: Annotated[
        int | None,
        typer.Option(
            help="Stop when this process exits (used when a client starts a local server).",
            show_default=False,
        ),
    ] = None,
    header_timeout_s: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Seconds a connection may take to send its request headers before it is closed.",
        ),
    ] = HEADER_TIMEOUT_S,
    body_timeout_s: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Seconds a request body may stall between reads before its connection is closed.",
        ),
    ] = BODY_TIMEOUT_S,
) -> None:
    """Run the tuneloop server (prints `tuneloop serving at URL` once it accepts requests)."""
    if jemalloc and preload.cpu_engine(backend.value, device):
        preload.restart_with_jemalloc()  # returns where not done (not found, preloaded, off)
    # Everything the server writes (registry, checkpoints, keys, caches) is the server's alone:
    # files 0600, folders 0700, whatever the umask of the shell that started it.
    os.umask(0o077)
    try:
        import uvicorn  # noqa: F401 - checked here: a bare SDK install gets the one-line message

        from tuneloop.server.app import create_app
    except ImportError as exc:
        need_server_extra(exc)

    try:
        config = ServerConfig.from_env(
            host=host,
            port=port,
            data_dir=data_dir,
            db_url=db_url,
            keys_file=keys_file,
            backend=backend.value,
            models=tuple(models or ()) or None,
            device=device,
            dtype=dtype.value if dtype is not None else None,
            compile_norms=compile_norms,
            merged_sampling=merged_sampling,
            decode_graphs=decode_graphs,
            kv_cache_tokens=kv_cache_tokens,
            cache_dir=cache_dir,
            long_poll_s=long_poll_s,
            max_sessions=max_sessions,
            max_inflight=max_inflight,
            session_ttl_s=session_ttl_s,
            expiry_check_s=expiry_check_s,
            workers=workers,
            ray_address=ray_address,
            ray_cpus_per_worker=ray_cpus_per_worker,
            ray_gpus_per_worker=ray_gpus_per_worker,
            shard_weights=shard_weights.value,
            metrics_token=metrics_token,
            log_format=log_format.value if log_format is not None else None,
            jwt=jwt or None,
            jwt_ttl_s=jwt_ttl_s,
            tokenizer_id=tokenizer_id.value if tokenizer_id is not None else None,
        )
        app = create_app(config)  # a sharded group that does not fit is refused here
    except ValueError as exc:  # settings that do not go together: a usage error, not a traceback
        fail(str(exc), EXIT_USAGE)
    run_server(
        app,
        config,
        parent_pid=parent_pid,
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
    )


def run_server(
    app: Any,
    config: ServerConfig,
    *,
    parent_pid: int | None = None,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    body_timeout_s: float = BODY_TIMEOUT_S,
) -> None:
    """Run `app` with uvicorn until stopped: prints `tuneloop serving at URL` once it accepts
    requests (the bound port, for --port 0); SIGTERM shuts it down gracefully and exits 0.
    Connections whose request is half sent are closed (see api/http_timeouts.py)."""
    import uvicorn

    log_config: Any = uvicorn.config.LOGGING_CONFIG
    if config.log_format == "json":
        from tuneloop.server.api.access_log import configure_logging

        configure_logging("json")
        log_config = None  # uvicorn's own config would print its lines as text
    from tuneloop.server.api.http_timeouts import timed_protocol

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            log_config=log_config,
            timeout_graceful_shutdown=5,
            http=timed_protocol(header_timeout_s, body_timeout_s),
        )
    )
    original_startup = server.startup

    async def startup(sockets: Any = None) -> None:
        await original_startup(sockets=sockets)
        if server.started:
            from tuneloop.server.api.large_body import freeze_startup_heap

            # What startup built is kept out of later garbage collections: a full collection
            # walking it held the event loop for 60-190 ms (see api/large_body.py).
            freeze_startup_heap()  # with --port 0 the OS picks the port: print the bound one
            bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else config.port
            state = getattr(app.state, "tuneloop", None)
            for spec in state.models.values() if state is not None else ():
                if spec.lora is not None:  # what the adapters cover on each served model
                    print(spec.lora.describe(spec.name, spec.arch), flush=True)
            print(f"tuneloop serving at http://{config.host}:{bound}", flush=True)
            print(f"web console at http://{config.host}:{bound}/console", flush=True)

    setattr(server, "startup", startup)  # noqa: B010 - announce readiness with the real port
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(server, parent_pid), daemon=True).start()
    # uvicorn turns SIGTERM into a graceful shutdown and then re-raises it to the handler that
    # was installed before: make that one a no-op, so a requested stop exits with status 0.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    server.run()


def _exit_with_parent(server: Any, parent_pid: int) -> None:
    """Shut the server down once the process that started it is gone (even after SIGKILL)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    server.should_exit = True
