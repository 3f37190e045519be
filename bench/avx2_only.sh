#!/bin/sh
# Run a command as an AVX2-only CPU would run it (no AVX-512, no AMX, no bf16 instructions), on
# a host that has more: torch's own kernels, oneDNN's and MKL's capped at AVX2, and tuneloop's
# C++ kernels built for x86-64-v3 with the host's larger flags hidden (native.py). Processes the
# command starts (the benchmark's server) inherit the caps. The fp32-only CPUs' targets can be
# measured so where no such CPU is at hand; a figure taken so says it was.
#
#     bench/avx2_only.sh python bench/machine_peak.py --threads 2 --json peak.json
export ATEN_CPU_CAPABILITY=avx2
export ONEDNN_MAX_CPU_ISA=AVX2
export MKL_ENABLE_INSTRUCTIONS=AVX2
export TUNELOOP_CPU_ISA=avx2
# inductor's on-disk cache does not key its kernels by the capped vector level: a kernel built
# here and loaded later by an uncapped process of the same user crashed it (glibc: "double free
# or corruption" in the compiled RMSNorm's warm-up). The capped runs keep a cache of their own.
export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/torchinductor-avx2-$(id -u)"
exec "$@"
