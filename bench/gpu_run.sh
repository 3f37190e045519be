#!/usr/bin/env bash
# The engine benchmark on a GPU: the device's measured peak (bench/machine_peak.py), then
# bench/engine.py on random-weight Qwen3 models (no download, no GGUF), bf16, every column on
# the GPU. JSON, a log and the engine's op profiles (engine.py --profile: is a step bound by
# the device or by the host issuing kernels?) go to $OUT when it is set (else ./gpu-bench).
# Bounded: every step runs under `timeout`, and the whole script stays inside BUDGET_S
# (default 470 s) so a lent machine with an ~8-minute command limit returns what finished.
#
#   bash bench/gpu_run.sh                       # on the GPU machine, from the repo root
#   CONFIGS="qwen3-1.7b qwen3-8b" bash bench/gpu_run.sh
#   DEVICE=cpu CONFIGS=tiny DTYPE=float32 EXTRA=--quick bash bench/gpu_run.sh   # smoke, no GPU
#   PEAK_JSON=bench/results/peak_cuda_h200.json bash bench/gpu_run.sh  # peak measured before: kept
#   GRAPHS_AB=1 bash bench/gpu_run.sh   # first bench/decode_graphs.py per config (half the
#                                       # time left at most), with GRAPHS_ARGS
#                                       # (default: --compiled --profile)
#
# The GPU image has torch, transformers and peft but not the server stack (pydantic, fastapi,
# uvicorn, sqlalchemy, ...). Fetch those as wheels once, on a machine with network access:
#   bash bench/gpu_run.sh --fetch-wheels        # into .whl/ (ignored by git)
# and carry .whl along; the script installs it into /tmp/site. Without the server stack the
# server column is skipped (--no-server) and the engine and HF columns still run.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=.whl

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    common=(--only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}"
        -d "$WHEELS")
    # The server extra's pins (pyproject.toml) with their dependencies; transformers and peft at
    # the pinned versions without theirs (the image has torch, tokenizers, huggingface_hub).
    "$PY" -m pip download "${common[@]}" "pydantic==2.14.4" "fastapi==0.165.0" \
        "uvicorn==0.54.0" "sqlalchemy>=2.0,<2.2" "zstandard>=0.23" "pyjwt==2.15.1" \
        "python-json-logger==4.2.0" || exit 1
    "$PY" -m pip download "${common[@]}" --no-deps "transformers==5.24.0" "peft==0.21.2" ||
        exit 1
    du -sh "$WHEELS"
    exit 0
fi

DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
CONFIGS=${CONFIGS:-qwen3-1.7b}
EXTRA=${EXTRA:-}
GRAPHS_ARGS=${GRAPHS_ARGS:---compiled --profile}
BUDGET_S=${BUDGET_S:-470}
DEST=${OUT:-gpu-bench}
mkdir -p "$DEST"
LOG="$DEST/gpu_run.log"
export PYTHONUNBUFFERED=1 TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1

log() { echo "[gpu_run $(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET_S - SECONDS)); }

if [[ -d "$WHEELS" ]] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    log "unpacking $(ls "$WHEELS"/*.whl | wc -l) wheels into /tmp/site"
    # A wheel is a zip of its files as installed: unpacked in seconds (pip took ~40 s).
    "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall('/tmp/site') for w in sys.argv[1:]]" \
        "$WHEELS"/*.whl 2>&1 | tee -a "$LOG"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import tuneloop.server.engine.torch_backend, peft" 2>>"$LOG"; then
    log "cannot import tuneloop's engine or peft (see above); run --fetch-wheels and carry .whl"
    exit 1
fi
server_flag=()
# The modules `tuneloop serve` imports, not a list of packages that can fall behind them.
if ! "$PY" -c "import tuneloop.server.cli.serve, tuneloop.server.app" 2>>"$LOG"; then
    log "no server stack here: the server column is skipped (--no-server)"
    server_flag=(--no-server)
fi
"$PY" -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__, 'device', torch.cuda.get_device_name()
if torch.cuda.is_available() else 'cpu')" 2>&1 | tee -a "$LOG"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>/dev/null |
    tee -a "$LOG"

peak_quick=()
[[ " $EXTRA " == *" --quick "* ]] && peak_quick=(--quick)
PEAK="$DEST/peak_${DEVICE%%:*}.json"
if [[ -s "${PEAK_JSON:-}" ]]; then  # measured by an earlier run on this machine
    log "machine peak from $PEAK_JSON"
    cp "$PEAK_JSON" "$PEAK"
else
    log "machine_peak on $DEVICE"
    timeout --kill-after=10 "$(($(left) < 150 ? $(left) : 150))" \
        "$PY" bench/machine_peak.py --device "$DEVICE" "${peak_quick[@]}" --json "$PEAK" 2>&1 |
        tee -a "$LOG"
fi
peak_flag=()
[[ -s "$PEAK" ]] && peak_flag=(--peak-json "$PEAK")

status=0
for config in $CONFIGS; do
    budget=$(left)
    if ((budget < 60)); then
        log "skipping $config: ${budget}s left"
        status=1
        continue
    fi
    if [[ -n "${GRAPHS_AB:-}" ]]; then
        log "decode_graphs.py $config $GRAPHS_ARGS: eager against CUDA-graph decode steps" \
            "(limit $((budget / 2))s)"
        # shellcheck disable=SC2086
        timeout --kill-after=15 "$((budget / 2))" "$PY" bench/decode_graphs.py \
            --random-init "$config" --device "$DEVICE" --dtype "$DTYPE" "${peak_flag[@]}" \
            $GRAPHS_ARGS --json "$DEST/decode_graphs_${config}.json" 2>&1 | tee -a "$LOG" |
            tail -40
        ((PIPESTATUS[0] == 0)) || status=1
        budget=$(left)
        if ((budget < 60)); then
            log "skipping engine.py $config: ${budget}s left"
            status=1
            continue
        fi
    fi
    log "engine.py --random-init $config --dtype $DTYPE on $DEVICE (limit ${budget}s)"
    # On a GPU a step takes well under a second: more steps and rounds than the CPU default.
    # shellcheck disable=SC2086
    timeout --kill-after=15 "$budget" "$PY" bench/engine.py --random-init "$config" \
        --device "$DEVICE" --dtype "$DTYPE" --steps 10 --warmup 3 --sample-rounds 3 \
        "${server_flag[@]}" "${peak_flag[@]}" $EXTRA --profile "$DEST/profile_${config}" \
        --json "$DEST/engine_${config}_${DTYPE}.json" >/dev/null 2> >(tee -a "$LOG" >&2)
    rc=$?
    log "engine.py $config exited $rc"
    ((rc == 0)) || status=1
done
log "done; files in $DEST: $(ls "$DEST" | tr '\n' ' ')"
exit $status
