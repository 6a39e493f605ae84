#!/usr/bin/env bash
# A/B of builds of the native library on the FP8 and bf16 grouped FFN kernels, on a lent H200: for each library
# given (built here, carried), one process of `python -m mok_jax.bench.grouped_ffn --kernels-only` (every SM, the
# ep64-slice shapes, a CRC of each output), then the libraries again in reverse order (the machine drifts). Same
# CRCs: the change moved no bit. Logs under $OUT; a short table of every run last.
# Usage there: NCCL_NVLS_ENABLE=0 [MODELS='kimi-k2 ...'] bash scripts/gpu_fp8_ab.sh build/native/libmok_ffi.so other.so ...
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=${OUT:-$PWD/out}; mkdir -p "$LOGS"
MODELS=${MODELS:-kimi-k2 glm-5 qwen3.5-397b-a17b deepseek-v4-pro}
[ $# -ge 1 ] || { echo "usage: bash scripts/gpu_fp8_ab.sh LIB [LIB ...]" >&2; exit 2; }
libs=("$@"); rev=(); for ((i = $# - 1; i >= 0; i--)); do rev+=("${libs[i]}"); done
n=0
for lib in "${libs[@]}" "${rev[@]}"; do
  n=$((n + 1))
  MOK_JAX_LIB="$(realpath "$lib")" timeout ${AB_LIMIT:-150} python3 -m mok_jax.bench.grouped_ffn --kernels-only \
    --settings ep64 --models $MODELS --samples ${SAMPLES:-10} --out "$LOGS/ab_$n.json" > "$LOGS/ab_$n.log" 2>&1
  echo "run $n ($lib): exit $?"
done
for ((i = 1; i <= n; i++)); do [ -f "$LOGS/ab_$i.md" ] && { echo; cat "$LOGS/ab_$i.md"; }; done
