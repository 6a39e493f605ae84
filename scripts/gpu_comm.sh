#!/usr/bin/env bash
# GPU run of the comm ops (issue 6) on the 2-GPU machine: GPU tests (one process, 2 GPUs), the
# 2-process test, then the benchmark. Every step under `timeout` (the kernels bound their own spins;
# this bounds everything else). Logs and JSON under $OUT; a short table is printed last.
#   OUT=/tmp/out bash scripts/gpu_comm.sh            (build first: bash scripts/build_native.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mok_comm_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
PY=${PYTHON:-python3}
T_TESTS=${T_TESTS:-240}
T_MP=${T_MP:-200}
T_BENCH=${T_BENCH:-240}
BENCH_ARGS=${BENCH_ARGS:-}

nvidia-smi --query-gpu=index,name,memory.used,clocks.sm --format=csv 2>&1 | tee "$OUT/gpus.txt"
$PY -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tail -1

echo "== GPU tests (one process, 2 GPUs)"
timeout -k 10 "$T_TESTS" $PY -m pytest -q -rs -p no:cacheprovider tests/test_comm_multigpu.py --timeout=150 \
  >"$OUT/test_comm_gpu.log" 2>&1
rc_gpu=$?
tail -n 40 "$OUT/test_comm_gpu.log"

echo "== multi-process test (2 processes, 1 GPU each)"
timeout -k 10 "$T_MP" $PY -m pytest -q -rs -p no:cacheprovider tests/test_comm_multiprocess_multigpu.py \
  >"$OUT/test_comm_mp.log" 2>&1
rc_mp=$?
tail -n 25 "$OUT/test_comm_mp.log"

echo "== benchmark"
timeout -k 10 "$T_BENCH" $PY -m mok_jax.bench.comm --out "$OUT/comm_h200x2.json" $BENCH_ARGS \
  >"$OUT/bench.log" 2>&1
rc_bench=$?
grep "^\[bench\]" "$OUT/bench.log" | tail -n 60
tail -n 5 "$OUT/bench.log" | grep -v "^|" || true

echo "== summary: gpu tests rc=$rc_gpu, multi-process rc=$rc_mp, bench rc=$rc_bench"
grep -E "passed|failed|error" "$OUT/test_comm_gpu.log" | tail -n 1
grep -E "passed|failed|error" "$OUT/test_comm_mp.log" | tail -n 1
[ -f "$OUT/comm_h200x2.md" ] && grep "^|" "$OUT/comm_h200x2.md" | head -n 40
exit 0
