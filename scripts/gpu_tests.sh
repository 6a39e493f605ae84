#!/usr/bin/env bash
# The one-GPU test files in parts that each fit one call of the GPU machine (10 minutes), so that a session runs
# the whole suite in a few calls and knows which part is left: each file under what is left of the part's budget,
# pytest -rA and the slowest durations in its log under $OUT, a table of every file last.
# Parts (by the times of the earlier runs on one H100; the H200 is faster):
#   1  the forward megakernel and the workspace: test_moe_gpu, test_native_gpu, test_reference_gpu,
#      test_command_buffers_gpu, test_workspace_lifetime_gpu, test_workspace_vmm_gpu
#   2  the backward: test_moe_backward_gpu, test_moe_backward_kept_gpu
#   3  the standalone grouped FFN in both precisions: test_grouped_ffn_gpu, test_fp8_grouped_ffn_gpu
#   4  the FP8 layer, EP 16-64 and the programs: test_moe_fp8_gpu, test_moe_ep64_gpu, test_programs_gpu,
#      test_programs_grad_gpu
# (the multigpu files need more than one GPU: scripts/gpu_ep2.sh.)
# Usage there: NCCL_NVLS_ENABLE=0 [BUDGET=560] bash scripts/gpu_tests.sh PART [PART ...] [-- pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MOK_JAX_LIB=${MOK_JAX_LIB:-$PWD/build/native/libmok_ffi.so}
# XLA's GEMM autotuning only slows the references' matmuls here (the kernels are ours): off for the tests.
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_autotune_level=0"
LOGS=${OUT:-$PWD/out}; mkdir -p "$LOGS"
parts=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do parts+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#parts[@]} -ge 1 ] || { echo "usage: bash scripts/gpu_tests.sh PART [PART ...] [-- pytest args]" >&2; exit 2; }
files=()
for part in "${parts[@]}"; do
  case $part in
    1) files+=(test_moe_gpu test_native_gpu test_reference_gpu test_command_buffers_gpu test_workspace_lifetime_gpu
               test_workspace_vmm_gpu) ;;
    2) files+=(test_moe_backward_gpu test_moe_backward_kept_gpu) ;;
    3) files+=(test_grouped_ffn_gpu test_fp8_grouped_ffn_gpu) ;;
    4) files+=(test_moe_fp8_gpu test_moe_ep64_gpu test_programs_gpu test_programs_grad_gpu) ;;
    *) echo "unknown part $part (1-4)" >&2; exit 2 ;;
  esac
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader > "$LOGS/gpu.txt" 2>&1
source scripts/step.sh
STEP_WIDTH=32 STEP_TAIL=${STEP_TAIL:-3}
start=$SECONDS; budget=${BUDGET:-560}
for f in "${files[@]}"; do
  left=$((budget - (SECONDS - start)))
  if [ $left -lt 30 ]; then SUMMARY+=("$(printf '%-32s %-14s' "$f" "NOT RUN")"); continue; fi
  step "$f" $left python3 -m pytest -q -rA -p no:cacheprovider --durations=5 "tests/$f.py" "$@"
done
echo; echo "=== $(cat "$LOGS/gpu.txt"), parts ${parts[*]} (logs in $LOGS)"
grep -hE '^(FAILED|ERROR) ' "$LOGS"/test_*.log | head -20
printf '%s\n' "${SUMMARY[@]}"
pack_logs "$LOGS" "tests_part_$(IFS=_; echo "${parts[*]}")"
! printf '%s\n' "${SUMMARY[@]}" | grep -qE 'FAILED|TIMED OUT|NOT RUN'
