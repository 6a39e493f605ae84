#!/usr/bin/env bash
# mok-bench on the 2-GPU H200 machine: the JAX-native baseline numbers of issue 3.
#
#   1. headline: the four benchmark models (kimi-k2, glm-5, qwen3.5-397b-a17b, deepseek-v4-pro) in ep64-slice
#      mode at 2048 tokens per GPU, bf16, fwd and fwd+bwd, implementations xla and xla-capacity;
#   2. sweep:    kimi-k2, 512..16384 tokens per GPU, xla and xla-capacity, fwd then fwd+bwd, with a plot;
#   3. ragged:   ragged_all_to_all + ragged_dot, measured once (kimi-k2, 2048 tokens per GPU), with xla as
#                its baseline and a jax.profiler trace of both.
#
# Writes under $OUT (default out/gpu_bench): headline.json, ragged.json, sweep.json, sweep.png, profile/,
# <step>.log (per-run progress) and <step>.txt (each step's full table); prints a short markdown table last.
# The whole script stays under about MOK_BENCH_BUDGET_S seconds (default 320) including JAX start-up and
# compilation: each step gets a --time-budget (runs not started by then are recorded as skipped, never lost)
# and a hard timeout; a failing step or configuration is recorded and the script goes on.
#
# Run from the repository root:  MOK_GIT_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_bench.sh
# (the commit is recorded in every JSON; the GPU machine's copy of the tree has no .git).
# Step caps (seconds of runs started), in order of priority: headline 170, sweep 120, ragged 35, each cut to
# what the total leaves.
# Compilation dominates (every run is a new program); when it is slower than expected the last runs of a
# step are recorded as skipped, and the step can be re-run alone (MOK_BENCH_STEPS=sweep, a larger budget).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out/gpu_bench}
PY=${PYTHON:-python3}
TOTAL=${MOK_BENCH_BUDGET_S:-320}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines
export MOK_GIT_COMMIT=${MOK_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
START=$SECONDS
# Overridable for a dry run elsewhere (e.g. a tiny TOML with 128 experts on CPU).
BENCH_MODELS=${MOK_BENCH_MODELS:-kimi-k2,glm-5,qwen3.5-397b-a17b,deepseek-v4-pro}
ONE_MODEL=${MOK_BENCH_MODEL:-kimi-k2}
TOKENS=${MOK_BENCH_TOKENS:-2048}
SWEEP=${MOK_BENCH_SWEEP:-512..16384}
STEPS=${MOK_BENCH_STEPS:-headline,ragged,sweep}  # to re-run one step alone: MOK_BENCH_STEPS=sweep
COMMON=(--ep-mode ep64-slice --dtype bf16 --pass fwd,fwd+bwd --routing uniform --seed 0 --no-progress)

echo "gpu_bench: commit $MOK_GIT_COMMIT, budget ${TOTAL}s, output $OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu_bench: GPU /'

# step NAME CAP_S ARGS...: one mok-bench process writing $OUT/NAME.json, at most CAP_S seconds of new runs
# (less when the script's budget is nearly spent); progress on the terminal, tables in $OUT/NAME.txt.
step() {
  local name=$1 cap=$2
  shift 2
  if [[ ",$STEPS," != *",$name,"* ]]; then return; fi
  local left=$((TOTAL - (SECONDS - START) - 15))
  local budget=$((cap < left ? cap : left))
  if ((budget < 20)); then
    echo "== $name: not run, the script's ${TOTAL}s budget is spent"
    return
  fi
  echo "== $name: up to ${budget}s of runs, $((SECONDS - START))s elapsed"
  echo "   python -m mok_jax.bench $* --time-budget $budget --json $OUT/$name.json"
  timeout -k 10 $((budget + 40)) "$PY" -m mok_jax.bench "$@" --time-budget "$budget" --json "$OUT/$name.json" \
    2>&1 >"$OUT/$name.txt" | tee "$OUT/$name.log" | grep -v '^mok-bench: JSON'
  echo "   $name: exit ${PIPESTATUS[0]} at $((SECONDS - START))s"
}

step headline 170 --model "$BENCH_MODELS" --tokens "$TOKENS" --impl xla,xla-capacity "${COMMON[@]}"
step sweep 120 --model "$ONE_MODEL" --tokens "$SWEEP" --impl xla,xla-capacity --samples 10 \
  --plot "$OUT/sweep.png" "${COMMON[@]}"
step ragged 35 --model "$ONE_MODEL" --tokens "$TOKENS" --impl xla,ragged --ragged-samples 3 \
  --profile "$OUT/profile" "${COMMON[@]}"

# the plot again from the JSON, in case the sweep process was stopped before it drew it
if [[ -s $OUT/sweep.json && ! -s $OUT/sweep.png ]]; then
  "$PY" -m mok_jax.bench --from-json "$OUT/sweep.json" --plot "$OUT/sweep.png" >/dev/null
fi

echo "== sweep ($ONE_MODEL, $OUT/sweep.png):"
[[ -s $OUT/sweep.json ]] && "$PY" -m mok_jax.bench --from-json "$OUT/sweep.json" --markdown 2>/dev/null | cut -c1-160
echo "== headline and ragged (ep64-slice, $TOKENS tokens/GPU, bf16, uniform routing), $((SECONDS - START))s in all:"
files=()
for f in "$OUT/headline.json" "$OUT/ragged.json"; do [[ -s $f ]] && files+=("$f"); done
if ((${#files[@]})); then
  "$PY" -m mok_jax.bench --from-json "${files[@]}" --markdown
else
  echo "no results: see $OUT/*.log"
fi
