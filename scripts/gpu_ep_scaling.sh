#!/usr/bin/env bash
# EP 4 / EP 8 run (issue 5) on the 4- or 8-GPU H200 machine, in one command, under 9 minutes:
#   1. environment  GPUs, NVLink topology, JAX's devices, the native library (carried as build/native)
#   2. tests_sp     tests/test_comm_multigpu.py, one process driving the GPUs, at every EP size > 2 present
#                   (8 and 4 on 8 GPUs; largest first)
#   3. tests_mp     tests/test_comm_multiprocess_multigpu.py, one process per GPU, same EP sizes
#   4. comm_bench   dispatch/combine alone (python -m mok_jax.bench.comm) at every EP size present (2 too),
#                   2048 tokens/GPU, H 7168, k 8, 6 experts per GPU (kimi-k2 in ep64-slice: 384/64),
#                   uniform routing, 24 and 32 communication items
#   5. layer_bench  mok-bench, the whole layer: python -m mok_jax.bench --model kimi-k2,glm-5,
#                   qwen3.5-397b-a17b,deepseek-v4-pro --ep-mode ep64-slice --tokens 2048 --impl xla,xla-capacity
#                   --pass fwd,fwd+bwd (every GPU present: ep64-slice gives each GPU E/64 experts)
#   6. tests_ep2    the EP 2 cases of both test files (already run on the 2-GPU machine), if time is left
# Steps 2-3 come before the benchmarks and the EP 2 tests last, so a slow run loses what is known already.
#
# Every step runs under `timeout`, capped by what is left of MOK_EP_BUDGET_S (default 525 s; a step that
# would get under 20 s is recorded as not run). Logs and JSON go under $WORK (default ./out/ep_scaling);
# at most 8 files are copied to $OUT (the device tool's fetch limit): summary.md, environment.log,
# tests_sp.log, tests_mp.log, comm_bench.json, layer_bench.json, layer_bench.txt and all.tgz (everything).
# A short table is printed last (also in summary.md).
#
# Before (here): bash scripts/build_native.sh. Then, through the device tool (kind nvidia-h200-x8, or -x4),
# carrying build/native, with this tree's commit written in (the machine's copy has no .git):
#   MOK_GIT_COMMIT=<sha> bash scripts/gpu_ep_scaling.sh
# Knobs: MOK_EP_SIZES (e.g. "8,4"; default: the GPU count and the powers of two below it, down to 2), MOK_EP_BUDGET_S,
# MOK_EP_STEPS (e.g. "comm_bench,layer_bench" to re-run steps alone), PY (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export MOK_GIT_COMMIT=${MOK_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
FETCH=${OUT:-}
WORK=${WORK:-$PWD/out/ep_scaling}
mkdir -p "$WORK"
PY=${PY:-python3}
TOTAL=${MOK_EP_BUDGET_S:-525}
STEPS=${MOK_EP_STEPS:-environment,tests_sp,tests_mp,comm_bench,layer_bench,tests_ep2}
RESERVE=25  # the summary, the copies and timeout's 10 s kill grace of the last step
START=$SECONDS
: >"$WORK/steps.tsv"

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ -z ${MOK_EP_SIZES:-} ]]; then  # the GPU count, then the powers of two below it: 8 -> 8,4,2; 6 -> 6,4,2
  sizes=()
  ((NGPU >= 2)) && sizes+=("$NGPU")
  for ((p = 2; p < NGPU; p *= 2)); do sizes+=("$p"); done
  MOK_EP_SIZES=$( ((${#sizes[@]})) && printf '%s\n' "${sizes[@]}" | sort -rn | uniq | paste -sd, -)
fi
BIG_SIZES=$(tr ',' '\n' <<<"$MOK_EP_SIZES" | awk '$1 > 2' | paste -sd, -)
echo "gpu_ep_scaling: commit $MOK_GIT_COMMIT, $NGPU GPUs, EP sizes ${MOK_EP_SIZES:-none} (> 2: ${BIG_SIZES:-none}),"\
     "budget ${TOTAL}s, logs in $WORK"

# step NAME CAP_S CMD...: run CMD under timeout (CAP_S, or less when the budget is nearly spent), output
# to $WORK/NAME.log; one line per step in steps.tsv: name, verdict, seconds, limit.
step() {
  local name=$1 cap=$2
  shift 2
  if [[ ",$STEPS," != *",$name,"* ]]; then return; fi
  local left=$((TOTAL - (SECONDS - START) - RESERVE))
  local limit=$((cap < left ? cap : left))
  if ((limit < 20)); then
    echo "== $name: not run (${TOTAL}s budget spent)"
    printf '%s\tnot run (budget spent)\t0\t0\n' "$name" >>"$WORK/steps.tsv"
    return
  fi
  echo "== $name: up to ${limit}s, $((SECONDS - START))s elapsed: $*"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  local verdict=ok took=$((SECONDS - t0))
  ((rc != 0)) && verdict="FAILED rc=$rc"
  ((rc == 137 && took < limit)) && verdict="KILLED rc=137 (out of memory?)"
  ((rc == 124 || (rc == 137 && took >= limit))) && verdict="TIMED OUT"
  printf '%s\t%s\t%d\t%d\n' "$name" "$verdict" "$took" "$limit" >>"$WORK/steps.tsv"
  echo "   $name: $verdict after ${took}s"
  tail -n 6 "$WORK/$name.log" | cut -c1-200
}

PYTEST=("$PY" -m pytest -v -rs -p no:cacheprovider --timeout=90 --durations=8)

step environment 45 bash -c "nvidia-smi -L; nvidia-smi topo -m 2>&1 | head -12; $PY -c '
import jax, sys
print(\"python\", sys.version.split()[0], \"jax\", jax.__version__, \"devices\", jax.devices())
from mok_jax._native import native_status
print(\"native library:\", native_status())
'"
if [[ -n $BIG_SIZES ]]; then
  step tests_sp 180 env MOK_COMM_EP="$BIG_SIZES" XLA_FLAGS=--xla_gpu_autotune_level=0 \
    "${PYTEST[@]}" tests/test_comm_multigpu.py
  step tests_mp 100 env MOK_COMM_PROCS="$BIG_SIZES" MOK_COMM_MP_TIMEOUT_S=75 XLA_FLAGS=--xla_gpu_autotune_level=0 \
    "${PYTEST[@]}" tests/test_comm_multiprocess_multigpu.py
fi
# The benchmarks' own budgets (--budget-s, --time-budget) stop new measurements; what each needs beyond
# them (start-up, the measurement in flight, writing JSON) is what separates them from the step's limit.
# The comm bench writes its JSON after each EP size, so a run cut short keeps the sizes it finished.
cap=$((TOTAL - (SECONDS - START) - RESERVE)); ((cap > 75)) && cap=75
step comm_bench 75 "$PY" -m mok_jax.bench.comm --ranks "$MOK_EP_SIZES" --tokens 2048 --sweep-tokens 2048 \
  --sms 24 --default-sms 24 --hidden 7168 --top-k 8 --experts-per-gpu 6 --routing uniform \
  --budget-s $((cap > 50 ? cap - 30 : 20)) --out "$WORK/comm_bench.json"
cap=$((TOTAL - (SECONDS - START) - RESERVE)); ((cap > 150)) && cap=150
# mok-bench: tables on stdout (layer_bench.txt), progress on stderr (layer_bench.log)
step layer_bench 150 bash -c 'out=$1; shift; exec "$@" >"$out"' _ "$WORK/layer_bench.txt" \
  "$PY" -m mok_jax.bench --model kimi-k2,glm-5,qwen3.5-397b-a17b,deepseek-v4-pro --ep-mode ep64-slice \
  --tokens 2048 --impl xla,xla-capacity --pass fwd,fwd+bwd --dtype bf16 --routing uniform --seed 0 --no-progress \
  --time-budget $((cap > 65 ? cap - 45 : 20)) --json "$WORK/layer_bench.json"
if [[ ,$MOK_EP_SIZES, == *,2,* ]]; then
  step tests_ep2 120 env MOK_COMM_EP=2 MOK_COMM_PROCS=2 XLA_FLAGS=--xla_gpu_autotune_level=0 \
    "${PYTEST[@]}" tests/test_comm_multigpu.py tests/test_comm_multiprocess_multigpu.py
fi

# --- summary: step verdicts, test counts per EP size, dispatch/combine per EP size, the layer table ------
"$PY" - "$WORK" "$MOK_GIT_COMMIT" "$NGPU" <<'EOF' >"$WORK/summary.md" 2>&1
import collections, json, pathlib, re, sys

work, commit, ngpu = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
print(f"# EP scaling run: {ngpu} GPUs, commit {commit}\n")
env = work / "environment.log"
for line in (env.read_text(errors="replace").splitlines() if env.exists() else []):
    if line.startswith(("native library:", "python ")):
        print(f"    {line[:200]}")
print("| step | verdict | s (limit) |\n| --- | --- | --- |")
for line in (work / "steps.tsv").read_text().splitlines():
    name, verdict, secs, limit = line.split("\t")
    print(f"| {name} | {verdict} | {secs} ({limit}) |")

counts = collections.defaultdict(collections.Counter)
pat = re.compile(r"^tests/(test_comm_\w+)\.py::(\w+)\[(ep\d+|\d+procs)[^\]]*\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
for log in ("tests_sp.log", "tests_mp.log", "tests_ep2.log"):
    p = work / log
    for line in (p.read_text(errors="replace").splitlines() if p.exists() else []):
        m = pat.match(line)
        if m:
            kind = "one process" if m.group(3).startswith("ep") else "process per GPU"
            size = int(re.sub(r"\D", "", m.group(3)))
            counts[(size, kind)][m.group(4)] += 1
if counts:
    print("\n| EP | tests | passed | failed | skipped | errors |\n| --- | --- | --- | --- | --- | --- |")
    for (size, kind), c in sorted(counts.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        print(f"| {size} | {kind} | {c['PASSED']} | {c['FAILED']} | {c['SKIPPED']} | {c['ERROR']} |")
    failed = [line for log in ("tests_sp.log", "tests_mp.log", "tests_ep2.log") if (work / log).exists()
              for line in (work / log).read_text(errors="replace").splitlines()
              if re.match(r"^(FAILED|ERROR) ", line)]
    for line in failed[:12]:
        print(f"    {line[:180]}")

p = work / "comm_bench.json"
if p.exists():
    d = json.loads(p.read_text())
    rows = collections.defaultdict(dict)
    for r in d["records"]:
        if r["tokens"] == 2048 and r["num_sms"] in (24, 0) and r["zero_padding"]:
            rows[r["ep"]][r["op"] + ("" if r["mode"] == "-" else " " + r["mode"]) + (" tm" if r["note"] else "")] = r
    cols = ["dispatch pull", "dispatch push", "combine push", "combine pull", "dispatch pull tm", "xla_all_to_all"]
    print("\ndispatch/combine alone, 2048 tokens/GPU, H 7168, k 8, 6 experts/GPU, uniform, 24 SMs: "
          "us (unique remote GB/s per GPU)")
    print("| EP | remote MB/GPU | " + " | ".join(c.replace(" tm", " token-major") for c in cols) + " |")
    print("| --- | --- |" + " --- |" * len(cols))
    for ep in sorted(rows, reverse=True):
        rb = rows[ep]["dispatch pull"]["remote_bytes_per_gpu"] / 1e6 if "dispatch pull" in rows[ep] else float("nan")
        cells = [f"{rows[ep][c]['time_us']:.0f} ({rows[ep][c]['gbps']:.0f})" if c in rows[ep] else "-" for c in cols]
        print(f"| {ep} | {rb:.1f} | " + " | ".join(cells) + " |")
    for ep, err in d["meta"].get("errors", {}).items():
        print(f"    comm bench EP {ep} FAILED: {err[:300]}")

p = work / "layer_bench.json"
base = pathlib.Path("benchmarks/results/comm_ep2/baselines/headline.json")
if p.exists():
    d = json.loads(p.read_text())
    ref = {}
    if base.exists():
        for r in json.loads(base.read_text())["results"]:
            if r.get("median_ms"):
                ref.setdefault((r["model"], r["pass"], r["impl"]), r["median_ms"])
    print("\nwhole layer (mok-bench), ep64-slice, 2048 tokens/GPU, bf16, uniform; "
          "EP 2 ms: the committed 2-GPU baseline (benchmarks/results/comm_ep2/baselines)")
    print("| model | pass | impl | GPUs | ms | TFLOP/s | EP 2 ms | note |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in d["results"]:
        note = "" if r.get("median_ms") else (r.get("error") or r.get("status") or "")[:70]
        print(f"| {r['model']} | {r['pass']} | {r['impl']} | {r.get('num_gpus')} | {fmt(r.get('median_ms'), '.3f')} | "
              f"{fmt(r.get('tflops'), '.1f')} | {fmt(ref.get((r['model'], r['pass'], r['impl'])), '.3f')} | {note} |")
EOF

if [[ -n $FETCH && $FETCH != "$WORK" ]]; then
  mkdir -p "$FETCH"
  for f in summary.md environment.log tests_sp.log tests_mp.log comm_bench.json layer_bench.json layer_bench.txt; do
    [[ -f $WORK/$f ]] && cp "$WORK/$f" "$FETCH/"
  done
  tar czf "$FETCH/all.tgz" -C "$WORK" . 2>/dev/null
fi
echo
echo "=== summary ($((SECONDS - START))s, logs in $WORK) ==="
cat "$WORK/summary.md"
