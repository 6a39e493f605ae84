#!/usr/bin/env bash
# A/B of two trees of the layer (each its Python package and its native library, built here and carried) on the
# backward, on a lent H200: `python -m mok_jax.bench.backward` (fwd, fwd+bwd with the default and each keep, the
# dense FFN of the same FLOPs, the op's time per kind of work item) once per tree in the order A B B A (the machine
# drifts under its power cap), each tree in its own process. Logs and JSON under $OUT; the tables last.
# A tree is a directory with mok_jax/ and build/native/libmok_ffi.so ("." is this checkout).
# Usage there: NCCL_NVLS_ENABLE=0 [MODELS=kimi-k2,...] [SAMPLES=7] bash scripts/gpu_backward_ab.sh TREE_A TREE_B
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=${OUT:-$PWD/out}; mkdir -p "$LOGS"
[ $# -eq 2 ] || { echo "usage: bash scripts/gpu_backward_ab.sh TREE_A TREE_B" >&2; exit 2; }
for tree in "$@"; do
  [ -f "$tree/build/native/libmok_ffi.so" ] && [ -d "$tree/mok_jax" ] || { echo "not a tree: $tree" >&2; exit 2; }
done
n=0
for tree in "$1" "$2" "$2" "$1"; do
  n=$((n + 1))
  dir=$(realpath "$tree")
  # from the tree's own directory: `python -m` puts the working directory first on sys.path
  (cd "$dir" && PYTHONPATH="$dir" MOK_JAX_LIB="$dir/build/native/libmok_ffi.so" timeout ${AB_LIMIT:-200} \
    python3 -m mok_jax.bench.backward --model "${MODELS:-kimi-k2,qwen3.5-397b-a17b}" --samples ${SAMPLES:-7} \
    --json "$LOGS/ab_$n.json") > "$LOGS/ab_$n.log" 2>&1
  echo "run $n ($tree): exit $?"
done
for ((i = 1; i <= n; i++)); do
  echo; echo "== run $i"; grep -v "^ " "$LOGS/ab_$i.log" | tail -n 4; grep "items kept" "$LOGS/ab_$i.log" | cut -c1-200
done
