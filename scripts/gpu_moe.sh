#!/usr/bin/env bash
# The MoE layer's kernels on a lent H200, in one command: environment, the GPU tests of the megakernel and of
# the grouped FFN (whose GEMM pieces it shares), then mok-bench against the JAX baselines in the same process.
# Logs under $OUT (the device tool's folder) or ./out. A short summary is printed last.
# Usage there: NCCL_NVLS_ENABLE=0 [BENCH_STEPS='tune headline train fp8 backward ring curve curve-fp8 zipf granularity sweep breakdown profile'] bash scripts/gpu_moe.sh [pytest -k expr]
# (SKIP_TESTS=1 skips the tests; BENCH_STEPS='' skips the benchmarks).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=${OUT:-$PWD/out}; mkdir -p "$LOGS"
PY=${PY:-python3}
STEP_WIDTH=12 STEP_TAIL=${TAIL:-25}
source scripts/step.sh
step env 60 bash -c "nvidia-smi -L; $PY -c 'import jax, mok_jax; from mok_jax._native import native_status; print(jax.__version__, jax.devices(), native_status())'"
[ -z "${SKIP_TESTS:-}" ] && step tests ${TEST_LIMIT:-330} env XLA_FLAGS="--xla_gpu_autotune_level=0" MOK_TEST_METRICS="$LOGS/metrics.jsonl" \
  $PY -m pytest -q -rs --timeout=${TEST_TIMEOUT:-120} -p no:cacheprovider ${TEST_FILES:-tests/test_moe_gpu.py tests/test_grouped_ffn_gpu.py} ${1:+-k "$1"}
# mok-bench on one GPU: the whole 2-GPU ep64-slice problem (E/32 experts), bf16, uniform routing; train = fwd+bwd
BENCH=($PY -m mok_jax.bench --experts-per-gpu E/32 --dtype bf16 --pass fwd --no-progress --samples ${SAMPLES:-10}
       --target-sample-ms ${SAMPLE_MS:-100})
MODELS=${MODELS:-kimi-k2,glm-5,qwen3.5-397b-a17b,deepseek-v4-pro}
for s in ${BENCH_STEPS-headline granularity}; do
  case $s in
    tune) step tune 170 "${BENCH[@]}" --model "$MODELS" --tokens 2048 --tune --time-budget ${TUNE_BUDGET:-120} \
            --json "$LOGS/tune.json"
          cp configs/tuned/*/kernel.toml "$LOGS/" 2>/dev/null ;;
    # headline (fwd) and train (fwd+bwd): the five standard problems (mok_jax.bench.problems: the four models at 2048
    # tokens with E/32 experts, qwen3-30b-a3b at 8192 with 16) with mok-bench's GPU defaults: mok, dense, xla,
    # xla-capacity and tokamax (bf16 GEMM outputs; tokamax from the wheels in .whl, installed under /tmp, or dropped
    # with the reason); HEADLINE_IMPLS / TRAIN_IMPLS name others (named ones that cannot run stop the step, rc 2)
    headline) [ -d .whl ] && [ ! -d /tmp/mok_wheels ] && $PY -m pip install -q --no-index --no-deps --target /tmp/mok_wheels .whl/*.whl
              step headline ${HEADLINE_LIMIT:-480} env PYTHONPATH="$PYTHONPATH:/tmp/mok_wheels" $PY -m mok_jax.bench \
                "${STD_MODELS:-bench}" --pass fwd ${HEADLINE_IMPLS:+--impl $HEADLINE_IMPLS} --no-progress \
                --samples ${SAMPLES:-10} --target-sample-ms ${SAMPLE_MS:-100} --time-budget ${HEADLINE_BUDGET:-420} \
                --json "$LOGS/headline.json" ;;
    train) [ -d .whl ] && [ ! -d /tmp/mok_wheels ] && $PY -m pip install -q --no-index --no-deps --target /tmp/mok_wheels .whl/*.whl
           step train ${TRAIN_LIMIT:-540} env PYTHONPATH="$PYTHONPATH:/tmp/mok_wheels" $PY -m mok_jax.bench \
             "${STD_MODELS:-bench}" --pass fwd+bwd ${TRAIN_IMPLS:+--impl $TRAIN_IMPLS} --no-progress \
             --samples ${SAMPLES:-10} --target-sample-ms ${SAMPLE_MS:-100} --time-budget ${TRAIN_BUDGET:-480} \
             --json "$LOGS/train.json" ;;
    backward) step backward ${BACKWARD_LIMIT:-300} $PY -m mok_jax.bench.backward --model "$MODELS" \
                --samples ${SAMPLES:-10} --sample-ms ${SAMPLE_MS:-100} --trace "$LOGS/backward_trace" --json "$LOGS/backward.json"
              rm -rf "$LOGS/backward_trace" ;;
    # qwen3-30b-a3b's one-GPU problem: 8192 tokens, 16 of its 128 experts (fine-grained, no shared expert)
    backward-q30) step backward-q30 ${BACKWARD_LIMIT:-200} $PY -m mok_jax.bench.backward --model qwen3-30b-a3b \
                    --tokens 8192 --experts 16 --samples ${SAMPLES:-10} --sample-ms ${SAMPLE_MS:-100} \
                    --trace "$LOGS/backward_trace" --json "$LOGS/backward_q30.json"
                  rm -rf "$LOGS/backward_trace" ;;
    tune-q30) step tune-q30 200 "${BENCH[@]/E\/32/16}" --model qwen3-30b-a3b --tokens 8192 --tune \
                --time-budget ${TUNE_BUDGET:-170} --json "$LOGS/tune_q30.json"
              cp configs/tuned/*/kernel.toml "$LOGS/" 2>/dev/null ;;
    ring) step ring ${RING_LIMIT:-300} $PY -m mok_jax.bench.backward --model "${RING_MODELS:-kimi-k2,qwen3.5-397b-a17b}" \
            --tokens ${RING_TOKENS:-8192} --samples ${SAMPLES:-10} --sample-ms ${SAMPLE_MS:-100} \
            --json "$LOGS/backward_ring.json" ;;
    curve) step curve 200 $PY -m mok_jax.bench.train_curve --steps ${CURVE_STEPS:-50} --json "$LOGS/train_curve.json" \
             --plot "$LOGS/train_curve.png" ;;
    # issue 12: the FP8 layer trained 200 steps beside the bf16 one (the gap column is against mok)
    curve-fp8) step curve-fp8 ${CURVE_FP8_LIMIT:-300} $PY -m mok_jax.bench.train_curve --steps ${FP8_CURVE_STEPS:-200} \
                 --impl mok,mok-fp8 ${FP8_TOLERANCE:+--tolerance $FP8_TOLERANCE} --json "$LOGS/train_curve_fp8.json" \
                 --plot "$LOGS/train_curve_fp8.png" ;;
    # mok-fp8 (FP8 routed experts) timed right after the bf16 mok, forward and fwd+bwd: 'vs bf16' is their ratio
    fp8) FP8_BENCH=("${BENCH[@]/bf16/fp8}")
         step fp8 ${FP8_LIMIT:-300} "${FP8_BENCH[@]/fwd/fwd,fwd+bwd}" --model "$MODELS" --tokens 2048 \
           --impl ${FP8_IMPLS:-mok} --time-budget ${FP8_BUDGET:-250} --json "$LOGS/fp8.json" ;;
    zipf) step zipf 150 "${BENCH[@]}" --model "$MODELS" --tokens 2048 --routing zipf --zipf-s 1.2 \
            --impl xla,xla-capacity,mok --time-budget 120 --json "$LOGS/zipf.json" ;;
    granularity) step granularity 150 "${BENCH[@]}" --model kimi-k2 --tokens ${GTOKENS:-2048} --impl mok \
                   --granularity ${GRANS:-512,1024,2048} --time-budget 120 --json "$LOGS/granularity.json" ;;
    sweep) step sweep 200 "${BENCH[@]}" --model kimi-k2 --tokens 16384 --impl mok,xla-capacity \
             --granularity 512,1024,2048,4096,8192,16384 --time-budget 170 --json "$LOGS/sweep.json" ;;
    breakdown) step breakdown ${BREAKDOWN_LIMIT:-300} $PY -m mok_jax.bench.breakdown --model "$MODELS" \
                 --samples ${SAMPLES:-10} --sample-ms ${SAMPLE_MS:-100} --trace "$LOGS/breakdown_trace" \
                 --json "$LOGS/breakdown.json"
               tar czf "$LOGS/breakdown_trace.tgz" -C "$LOGS" breakdown_trace 2>/dev/null && rm -rf "$LOGS/breakdown_trace" ;;
    profile) step profile 120 "${BENCH[@]}" --model kimi-k2 --tokens 2048 --impl mok,xla-capacity --samples 3 \
               --profile "$LOGS/profile" --time-budget 60 --json "$LOGS/profile.json" ;;
  esac
done
echo; echo "=== summary ==="; printf '%s\n' "${SUMMARY[@]}"
