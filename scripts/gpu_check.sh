#!/usr/bin/env bash
# Build-check-benchmark on the GPU machine, in one command:
#   1. the machine and the software it has; the native library built on the CPU machine (carried
#      as build/native) loads and registers its FFI targets;
#   2. the GPU test subset (tests marked gpu / multigpu), each file under a timeout;
#   3. the benchmark (scripts/gpu_bench.sh when present, else mok-bench's default run).
# Logs go under $WORK (default ./out); the device tool fetches at most 8 files from $OUT, so the key
# files are copied there and everything else is packed into $OUT/all.tgz. A short table is printed last.
# Usage there: NCCL_NVLS_ENABLE=0 [SKIP_BENCH=1] bash scripts/gpu_check.sh [pytest -k expression]
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
FETCH=${OUT:-}
OUT=${WORK:-$PWD/out}; mkdir -p "$OUT"
export MOK_GIT_COMMIT=${MOK_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
PY=${PY:-python3}
LOGS=$OUT
source scripts/step.sh

step environment 120 bash -c "nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -5; $PY -c '
import jax, flax, numpy, sys
print(\"python\", sys.version.split()[0], \"jax\", jax.__version__, \"flax\", flax.__version__, \"numpy\", numpy.__version__)
print(\"devices\", jax.devices())
import mok_jax
from mok_jax._native import native_status, FFI_TARGETS
print(\"native library:\", native_status()); print(\"ffi targets:\", sorted(FFI_TARGETS))
'"
# XLA's GEMM autotuning only slows the references' matmuls here (the kernels are ours): off for the tests.
step gpu_tests 420 env XLA_FLAGS="--xla_gpu_autotune_level=0" $PY -m pytest -q -rs -p no:cacheprovider \
  -m "gpu or multigpu" tests ${1:+-k "$1"}
if [ -n "${SKIP_BENCH:-}" ]; then
  echo "benchmark skipped (SKIP_BENCH set)"
elif [ -f scripts/gpu_bench.sh ]; then
  step benchmark 420 env OUT="$OUT/bench" bash scripts/gpu_bench.sh
else
  step benchmark 420 $PY -m mok_jax.bench --json "$OUT/bench.json"
fi

if [ -n "$FETCH" ] && [ "$FETCH" != "$OUT" ]; then
  mkdir -p "$FETCH"
  for f in environment.log gpu_tests.log benchmark.log bench/headline.json bench/sweep.json bench/ragged.json bench/sweep.png; do
    [ -f "$OUT/$f" ] && cp "$OUT/$f" "$FETCH/"
  done
  tar czf "$FETCH/all.tgz" -C "$OUT" . 2>/dev/null
  if [ "$(stat -c %s "$FETCH/all.tgz")" -gt 15000000 ]; then  # the fetch limit is 16 MiB a file
    tar czf "$FETCH/all.tgz" -C "$OUT" --exclude='*.pb' --exclude='*.trace.json.gz' . 2>/dev/null
  fi
fi
echo; echo "=== summary (logs in $OUT) ==="
printf '%s\n' "${SUMMARY[@]}"
