#!/usr/bin/env bash
# EP 2 over real NVLink (issue 13) on the 2-GPU H200 machine (device kind nvidia-h200-x2), in one command:
#   env        GPUs, NVLink topology, JAX's devices, the native library (carried as build/native)
#   tests      the fused layer at EP 2 in one process and in one process per GPU (tests/test_moe_multigpu.py;
#              its backward over collectives and through the fused EP op), the communication ops on both GPUs (one
#              process, one process per GPU), the emulated-EP forward tests and the fused EP backward's
#   fwd        mok-bench, ep64-slice, 2048 tokens per GPU, the four bench models, mok against xla and xla-capacity
#   fwd+bwd    the same, fwd+bwd
#   gran       kimi-k2: mok over granularity 512, 1024, 2048
#   comm_items kimi-k2: mok with 8, 16, 24, 32 communication items
#   comm       dispatch/combine alone at 4096 tokens, H 7168, k 8, 12 experts, 8..32 SMs, beside XLA's all_to_all
# Logs and JSON under $OUT (the device tool's folder; at most 8 files come back, so the logs are also packed into
# all.tgz) or ./out/ep2. A short summary is printed last. Here first: bash scripts/build_native.sh.
# Knobs: EP2_STEPS (default "tests fwd fwd+bwd gran comm_items comm"), TEST_LIMIT, BENCH_BUDGET, PY.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=${OUT:-$PWD/out/ep2}; mkdir -p "$LOGS"
PY=${PY:-python3}
STEP_WIDTH=10 STEP_TAIL=${TAIL:-12}
source scripts/step.sh
MODELS=kimi-k2,glm-5,qwen3.5-397b-a17b,deepseek-v4-pro
BENCH=($PY -m mok_jax.bench --ep-mode ep64-slice --tokens 2048 --dtype bf16 --no-progress --samples ${SAMPLES:-10}
       --target-sample-ms 100 --devices 2)
step env 60 bash -c "nvidia-smi -L; nvidia-smi topo -m; $PY -c 'import jax, mok_jax; from mok_jax._native import native_status; print(jax.__version__, jax.devices(), native_status())'"
for s in ${EP2_STEPS-tests fwd fwd+bwd gran comm_items comm}; do
  case $s in
    tests) step tests ${TEST_LIMIT:-300} env XLA_FLAGS="--xla_gpu_autotune_level=0" MOK_COMM_PROCS=2 \
             $PY -m pytest -q -rs --timeout=200 -p no:cacheprovider tests/test_moe_multigpu.py tests/test_comm_multigpu.py \
             tests/test_comm_multiprocess_multigpu.py tests/test_moe_gpu.py tests/test_moe_backward_gpu.py \
             -k "multigpu or one_process or comm or emulated_data or emulated_math or emulated_rank or fused" ;;
    fwd) step fwd ${BENCH_BUDGET:-100} "${BENCH[@]}" --model "$MODELS" --impl xla,xla-capacity,mok --pass fwd \
           --time-budget 85 --json "$LOGS/fwd.json" ;;
    fwd+bwd) step fwd+bwd ${BENCH_BUDGET:-130} "${BENCH[@]}" --model "$MODELS" --impl xla,xla-capacity,mok \
               --pass fwd+bwd --time-budget 115 --json "$LOGS/fwd_bwd.json" ;;
    gran) step gran 60 "${BENCH[@]}" --model kimi-k2 --impl mok --granularity 512,1024,2048 --time-budget 50 \
            --json "$LOGS/gran.json" ;;
    comm_items) step comm_items 70 bash -c "for n in 8 16 24 32; do ${BENCH[*]} --model kimi-k2 --impl mok --comm-items \$n \
                --samples 5 --time-budget 14; done" ;;
    comm) step comm 80 $PY -m mok_jax.bench.comm --tokens 4096 --sms 8,16,24,32 --sweep-tokens 4096 --hidden 7168 \
            --top-k 8 --experts 12 --ranks 2 --budget-s 65 --out "$LOGS/comm.json" ;;
  esac
done
tar czf "$LOGS/all.tgz" -C "$LOGS" --exclude all.tgz . 2>/dev/null
echo; echo "=== summary ==="; printf '%s\n' "${SUMMARY[@]}"
