#!/usr/bin/env bash
# A/B between two or more trees (each its Python package and its native library, built here and carried), on a lent
# GPU: scripts/ab_backward.py (WHICH=bwd, the default) or scripts/ab_forward.py (WHICH=fwd) once per tree in the order
# A B .. B A (each tree, then each again in reverse: the card drifts under its power cap; a third tree C runs
# A B C C B A, cheaper than two A/Bs), each tree in its own process, then the script's --summary: for the
# backward the bits (CRC32 of every gradient) must agree and the times are printed side by side; for the forward,
# y's CRC at emulated EP 1, 2, 4, 8 and the times of each. A tree is a directory with mok_jax/ and
# build/native/libmok_ffi.so ("." is this checkout); a tree's ab.env (KEY=VALUE lines) is exported for its runs only,
# so that one library under two settings of an environment knob makes two trees.
# Usage there: NCCL_NVLS_ENABLE=0 [WHICH=fwd] [PROBLEMS='kimi-k2 ...'] bash scripts/gpu_backward_ab.sh A B [C ...]
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# The dense baseline is XLA's GEMM as a user gets it: with autotuning (gpu_tests.sh turns it off for the tests; a
# shell that exported that flag made the dense FFN 50x slower here once).
case " ${XLA_FLAGS:-} " in
  *" --xla_gpu_autotune_level=0 "*)
    XLA_FLAGS=$(echo " $XLA_FLAGS " | sed 's/ --xla_gpu_autotune_level=0 / /; s/^ *//; s/ *$//')
    echo "gpu_backward_ab.sh: dropped --xla_gpu_autotune_level=0 from XLA_FLAGS (the dense baseline needs autotuning)" >&2
    export XLA_FLAGS ;;
esac
LOGS=${OUT:-$PWD/out}; mkdir -p "$LOGS"
[ $# -ge 2 ] || { echo "usage: bash scripts/gpu_backward_ab.sh TREE_A TREE_B [TREE_C ...]" >&2; exit 2; }
order=("$@"); for ((i = $# - 1; i >= 0; i--)); do order+=("${order[$i]}"); done
case ${WHICH:-bwd} in
  bwd) here=$(realpath scripts/ab_backward.py); default="kimi-k2 qwen3.5-397b-a17b qwen3-30b-a3b:8192:16" ;;
  fwd) here=$(realpath scripts/ab_forward.py); default="kimi-k2:2048:16 qwen3-30b-a3b:8192:16" ;;
  *) echo "WHICH must be bwd or fwd" >&2; exit 2 ;;
esac
n=0
for tree in "${order[@]}"; do
  n=$((n + 1))
  dir=$(realpath "$tree")
  [ -f "$dir/build/native/libmok_ffi.so" ] && [ -d "$dir/mok_jax" ] || { echo "not a tree: $tree" >&2; exit 2; }
  (cd "$dir" && { [ ! -f ab.env ] || { set -a; source ab.env; set +a; }; } &&
    PYTHONPATH="$dir" MOK_JAX_LIB="$dir/build/native/libmok_ffi.so" timeout ${AB_LIMIT:-200} \
    python3 "$here" ${PROBLEMS:-$default}) > "$LOGS/ab_$n.jsonl" 2> "$LOGS/ab_$n.log"
  echo "run $n ($tree): exit $?"
done
python3 "$here" --summary "$LOGS" "$@"
rc=$?
source scripts/step.sh
pack_logs "$LOGS" "ab_${WHICH:-bwd}"
exit $rc
