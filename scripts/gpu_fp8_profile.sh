#!/usr/bin/env bash
# Where the FP8 grouped FFN's two GEMMs wait (issues 12, 34), on a lent GPU: Nsight Compute (clocks left alone) on
# the first gate/up and down launches of mok_jax.bench.grouped_ffn's ep64 problem of MODEL (kimi-k2 unless set);
# FULL=1 adds each GEMM's stalls per SASS instruction and opcode. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=${OUT:-$PWD/out}; mkdir -p "$LOGS"
MODEL=${MODEL:-kimi-k2}
if [ -z "${SKIP_SECTIONS:-}" ]; then  # a few sections of both GEMMs
  timeout ${NCU_LIMIT:-400} ncu --clock-control none --kernel-name-base demangled -k "regex:Fp8BlockScaledMainloop" \
    --launch-count 2 --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section LaunchStats -o "$LOGS/fp8_gemms" -f \
    python3 -m mok_jax.bench.grouped_ffn --models "$MODEL" --settings ep64 --samples 2 > "$LOGS/ncu_run.log" 2>&1
  echo "ncu exit $?"; tail -5 "$LOGS/ncu_run.log"
fi
if [ -n "${FULL:-}" ]; then  # each FP8 GEMM (launch 0: gate/up, 1: down): its stalls per SASS instruction and opcode
  # (--set full crashed ncu on this program in the forty-second session: exit 139; these sections ran)
  for skip in 0 1; do
    name=$([ $skip = 0 ] && echo gateup || echo down)
    timeout ${NCU_LIMIT:-400} ncu --clock-control none --kernel-name-base demangled -k "regex:Fp8BlockScaledMainloop" \
      --launch-skip $skip --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
      --section SchedulerStats --import-source no -o "$LOGS/fp8_${name}_stalls" -f \
      python3 -m mok_jax.bench.grouped_ffn --models "$MODEL" --settings ep64 --samples 2 > "$LOGS/ncu_${name}.log" 2>&1
    echo "$name: ncu exit $?"
    ncu --import "$LOGS/fp8_${name}_stalls.ncu-rep" --page source --csv --print-source sass > "$LOGS/fp8_${name}_sass.csv" 2>&1
    python3 - "$LOGS/fp8_${name}_sass.csv" <<'PY'
import collections, csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if "Source" in r)
cols, body = rows[head], [r for r in rows[head + 1:] if len(r) >= len(rows[head])]
i_s = cols.index(next(c for c in cols if c.startswith("Warp Stall Sampling (All")))
i_src, i_e = cols.index("Source"), cols.index("Instructions Executed")
num = lambda v: float((v or "0").replace(",", ""))  # noqa: E731
tot = sum(num(r[i_s]) for r in body)
print(f"stall samples: {tot:.0f}; top instructions (share, SASS):")
for r in sorted(body, key=lambda r: -num(r[i_s]))[:12]:
    print(f"  {num(r[i_s]) / tot:6.1%}  {r[i_src][:100]}")
share, execd = collections.Counter(), collections.Counter()
for r in body:
    words = r[i_src].split()
    op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else (words or ["?"])[0]).split(".")[0]
    share[op] += num(r[i_s]); execd[op] += num(r[i_e])
print("by opcode (share of stall samples, instructions executed):")
for op, v in share.most_common(10):
    print(f"  {op:12s} {v / tot:6.1%}  {execd[op]:.3g}")
PY
  done
fi
ncu --import "$LOGS/fp8_gemms.ncu-rep" --page details > "$LOGS/fp8_gemms_details.txt" 2>&1
grep -E "sm90_grouped_gemm_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|Tensor|Issue Slots Busy|No Eligible|Stall|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Shared Memory|Registers" \
  "$LOGS/fp8_gemms_details.txt" | cut -c1-160 | head -80
# then FP8 against bf16 without the profiler, every model (BENCH_MODELS='' skips it)
BENCH_MODELS=${BENCH_MODELS-kimi-k2 glm-5 qwen3.5-397b-a17b deepseek-v4-pro}
[ -n "$BENCH_MODELS" ] && timeout ${BENCH_LIMIT:-200} python3 -m mok_jax.bench.grouped_ffn --models $BENCH_MODELS \
  --settings ep64 --out "$LOGS/fp8_vs_bf16.json" 2>&1 | tail -8
