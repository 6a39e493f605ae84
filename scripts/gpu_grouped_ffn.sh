#!/usr/bin/env bash
# On the GPU machine: the grouped-FFN GPU tests, then its benchmark. Each step has its own timeout and a
# failure in one does not stop the next. Logs and results go under $OUT (default ./out); the last lines
# printed are the test summary and the benchmark table.
#   export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1; bash scripts/gpu_grouped_ffn.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export MOK_TEST_METRICS=$OUT/test_metrics.jsonl
PY=${PYTHON:-python3}
: >"$MOK_TEST_METRICS"

timeout 30 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,memory.used \
  --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

echo "== tests (timeout ${MOK_TEST_TIMEOUT:-200}s)"
# No GEMM autotuning for the reference's fp32/bf16 dots: it dominated compile time (~20 s per case).
timeout -k 10 "${MOK_TEST_TIMEOUT:-200}" env XLA_PYTHON_CLIENT_PREALLOCATE=false \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
  "$PY" -m pytest -q -rA -p no:cacheprovider -o faulthandler_timeout=40 --durations=0 \
  tests/test_grouped_ffn_gpu.py ${MOK_TEST_ARGS:-} >"$OUT/tests.log" 2>&1
echo "tests exit code $?" | tee -a "$OUT/tests.log"

if [ -z "${MOK_SKIP_BENCH:-}" ]; then
  echo "== benchmark (timeout ${MOK_BENCH_TIMEOUT:-240}s)"
  timeout -k 10 "${MOK_BENCH_TIMEOUT:-240}" "$PY" -m mok_jax.bench.grouped_ffn --out "$OUT/grouped_ffn_h200.json" \
    ${MOK_BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  echo "bench exit code $?" | tee -a "$OUT/bench.log"
fi

echo "== summary"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|error" "$OUT/tests.log" | grep -v "^E " | tail -25
"$PY" - "$MOK_TEST_METRICS" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "max_rel_err_y" in r:
        print(f"{r['case']:<26} y {r['max_rel_err_y']:.2e} (naive {r['max_rel_err_y_naive']:.2e}) "
              f"h {r['max_rel_err_h']:.2e} (naive {r['max_rel_err_h_naive']:.2e}) "
              f"err/bound y {r['worst_err_over_bound_y']:.2f} h {r['worst_err_over_bound_h']:.2f}")
    elif r.get("case") == "concurrent_sm_subset":
        print("concurrent_sm_subset rc", r["returncode"], r["result"][:400])
PYEOF
grep -E "^[0-9.]+s (call|setup)" "$OUT/tests.log" | head -20
[ -f "$OUT/bench.log" ] && { grep -B2 -A30 "^grouped FFN on" "$OUT/bench.log" || tail -40 "$OUT/bench.log"; }
