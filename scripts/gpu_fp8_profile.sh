#!/usr/bin/env bash
# Where the FP8 grouped FFN's two GEMMs wait (issue 12), on a lent H200: Nsight Compute (clocks left alone) on
# the first gate/up and down launches of mok_jax.bench.grouped_ffn's kimi-k2 ep64 problem. Logs under $OUT.
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
if [ -n "${FULL:-}" ]; then  # every section of the first FP8 GEMM launch (gate/up), and its stalls per SASS instruction
  timeout ${NCU_LIMIT:-400} ncu --clock-control none --kernel-name-base demangled -k "regex:Fp8BlockScaledMainloop" \
    --launch-count 1 --set full -o "$LOGS/fp8_gateup_full" -f \
    python3 -m mok_jax.bench.grouped_ffn --models "$MODEL" --settings ep64 --samples 2 > "$LOGS/ncu_full_run.log" 2>&1
  ncu --import "$LOGS/fp8_gateup_full.ncu-rep" --page source --csv --print-source sass > "$LOGS/fp8_gateup_sass.csv" 2>&1
  ncu --import "$LOGS/fp8_gateup_full.ncu-rep" --page raw --csv > "$LOGS/fp8_gateup_raw.csv" 2>&1
  python3 - "$LOGS" <<'PY'
import csv, sys
logs = sys.argv[1]
rows = list(csv.reader(open(f"{logs}/fp8_gateup_sass.csv")))
head = next(i for i, r in enumerate(rows) if "Source" in r)
cols, body = rows[head], rows[head + 1:]
samp = next(c for c in cols if c.startswith("Warp Stall Sampling (All"))
i_s, i_src = cols.index(samp), cols.index("Source")
tot = sum(float(r[i_s] or 0) for r in body if len(r) > i_s)
print(f"stall samples: {tot:.0f}; top instructions (share, address, SASS):")
for r in sorted((r for r in body if len(r) > i_s), key=lambda r: -float(r[i_s] or 0))[:25]:
    print(f"  {float(r[i_s] or 0) / tot:6.1%}  {r[0][:8]:>8}  {r[i_src][:110]}")
raw = list(csv.reader(open(f"{logs}/fp8_gateup_raw.csv")))
names, vals = raw[0], raw[2] if len(raw) > 2 else raw[-1]
for n, v in zip(names, vals):
    if "issue_stalled" in n and n.endswith("per_warp_active.pct") and v not in ("", "0"):
        try:
            if float(v.replace(",", "")) >= 1.0:
                print(f"  {n}: {v}")
        except ValueError:
            pass
PY
fi
ncu --import "$LOGS/fp8_gemms.ncu-rep" --page details > "$LOGS/fp8_gemms_details.txt" 2>&1
grep -E "sm90_grouped_gemm_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|Tensor|Issue Slots Busy|No Eligible|Stall|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Shared Memory|Registers" \
  "$LOGS/fp8_gemms_details.txt" | cut -c1-160 | head -80
# then FP8 against bf16 without the profiler, every model (BENCH_MODELS='' skips it)
BENCH_MODELS=${BENCH_MODELS-kimi-k2 glm-5 qwen3.5-397b-a17b deepseek-v4-pro}
[ -n "$BENCH_MODELS" ] && timeout ${BENCH_LIMIT:-200} python3 -m mok_jax.bench.grouped_ffn --models $BENCH_MODELS \
  --settings ep64 --out "$LOGS/fp8_vs_bf16.json" 2>&1 | tail -8
