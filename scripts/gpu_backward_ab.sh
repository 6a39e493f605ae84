#!/usr/bin/env bash
# A/B of the backward between two trees (each its Python package and its native library, built here and carried),
# on a lent H200: scripts/ab_backward.py once per tree in the order A B B A (the card drifts under its power cap),
# each tree in its own process; the bits (CRC32 of every gradient) must agree, and the times are printed side by
# side last. A tree is a directory with mok_jax/ and build/native/libmok_ffi.so ("." is this checkout).
# Usage there: NCCL_NVLS_ENABLE=0 [PROBLEMS='kimi-k2 qwen3-30b-a3b:8192:16'] bash scripts/gpu_backward_ab.sh A B
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=${OUT:-$PWD/out}; mkdir -p "$LOGS"
[ $# -eq 2 ] || { echo "usage: bash scripts/gpu_backward_ab.sh TREE_A TREE_B" >&2; exit 2; }
here=$(realpath scripts/ab_backward.py)
n=0
for tree in "$1" "$2" "$2" "$1"; do
  n=$((n + 1))
  dir=$(realpath "$tree")
  [ -f "$dir/build/native/libmok_ffi.so" ] && [ -d "$dir/mok_jax" ] || { echo "not a tree: $tree" >&2; exit 2; }
  (cd "$dir" && PYTHONPATH="$dir" MOK_JAX_LIB="$dir/build/native/libmok_ffi.so" timeout ${AB_LIMIT:-200} \
    python3 "$here" ${PROBLEMS:-kimi-k2 qwen3.5-397b-a17b qwen3-30b-a3b:8192:16}) > "$LOGS/ab_$n.jsonl" 2> "$LOGS/ab_$n.log"
  echo "run $n ($tree): exit $?"
done
python3 - "$LOGS" "$1" "$2" <<'PY'
import json, sys
logs, a, b = sys.argv[1:]
runs = [[json.loads(l) for l in open(f"{logs}/ab_{i}.jsonl") if l.startswith("{")] for i in range(1, 5)]
trees = [a, b, b, a]
for p in range(max(len(r) for r in runs)):
    rows = [r[p] if p < len(r) else None for r in runs]
    ok = [r for r in rows if r]
    same = all(r["bits"] == ok[0]["bits"] for r in ok) if ok else False
    print(f"== {ok[0]['problem'] if ok else p}: bits {'identical in all runs' if same else 'DIFFER'}")
    if not same:
        for t, r in zip(trees, rows):
            print(f"   {t}: {r and r['bits']}")
    for t, r in zip(trees, rows):
        if r:
            items = ", ".join(f"{k} {v:.3f}" for k, v in r["items kept busy ms per SM"].items())
            print(f"   {t:>10}: dense {r['dense fwd+bwd']:.3f}/{r['dense fwd+bwd after']:.3f} fwd+bwd {r['fwd+bwd']:.3f}"
                  f" ({r['fwd+bwd'] / r['dense fwd+bwd']:.3f}x dense)  items: {items}")
PY
