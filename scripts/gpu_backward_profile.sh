#!/usr/bin/env bash
# Where a megakernel waits (issue 33), on a lent H200: Nsight Compute (clocks left alone) on one launch of the
# backward (ops.experts_backward, kept g, u as the default keep hands them) or of the forward (the layer's forward)
# at a model's one-GPU problem (E/32 experts unless EXPERTS, T = 2048 unless TOKENS): every section, and its
# warp-stall samples per SASS instruction (bwd_sass.csv.gz / fwd_sass.csv.gz, for scripts/lab/sass_regions.py).
# Logs under $OUT.
# Usage there: [MODEL=kimi-k2] [WHICH=bwd|fwd] [TOKENS=2048] [EXPERTS=E/32] bash scripts/gpu_backward_profile.sh
# (qwen3-30b-a3b's problem: MODEL=qwen3-30b-a3b TOKENS=8192 EXPERTS=16)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=${OUT:-$PWD/out}; mkdir -p "$LOGS"
MODEL=${MODEL:-kimi-k2}
cat > /tmp/mok_profile_once.py <<'PY'
import sys
import jax, jax.numpy as jnp
from mok_jax import ops
from mok_jax.bench.backward import layer_config, op_args
from mok_jax.bench.breakdown import _problem
from mok_jax.layer import moe
T, E = int(sys.argv[3]), (int(sys.argv[4]) if sys.argv[4] else None)
m, x, idx, w, W, _ = _problem(sys.argv[1], T, 0, E)
if sys.argv[2] == "fwd":
    cfg = layer_config(m, W, T)
    fwd = jax.jit(lambda x, i, w, W: moe(x, i, w, W, config=cfg))
    for _ in range(4):
        y = fwd(x, idx, w, W)
    print("y finite", bool(jnp.isfinite(y.astype(jnp.float32)).all()))
else:
    dy = jax.random.normal(jax.random.key(1), x.shape, jnp.float32).astype(jnp.bfloat16)
    args = op_args(x, dy, idx, w, W)
    _, gu = jax.jit(lambda a, s: ops.experts_backward(*a, **s, return_gu=True))(*args)
    op = jax.jit(lambda a, s, gu: ops.experts_backward(*a, **s, gu=gu))
    for _ in range(3):
        out = op(*args, gu)
    jax.block_until_ready(out)
    print("status", int(out.status))
PY
WHICH=${WHICH:-bwd}
[ "$WHICH" = fwd ] && KERNEL=forward_kernel || KERNEL=experts_backward_kernel
# bwd launches: the return_gu call, then three kept calls (the third profiled); fwd: four calls (the third)
timeout ${NCU_LIMIT:-400} ncu --clock-control none --kernel-name-base demangled -k "regex:$KERNEL" \
  --launch-skip ${LAUNCH_SKIP:-2} --launch-count 1 --set full --import-source yes -o "$LOGS/${WHICH}_full" -f \
  python3 /tmp/mok_profile_once.py "$MODEL" "$WHICH" "${TOKENS:-2048}" "${EXPERTS:-}" > "$LOGS/ncu_run.log" 2>&1
echo "ncu exit $?"; tail -4 "$LOGS/ncu_run.log"
ncu --import "$LOGS/${WHICH}_full.ncu-rep" --page source --csv --print-source sass > "$LOGS/${WHICH}_sass.csv" 2>&1
ncu --import "$LOGS/${WHICH}_full.ncu-rep" --page details > "$LOGS/${WHICH}_details.txt" 2>&1
gzip -f "$LOGS/${WHICH}_sass.csv"
python3 scripts/lab/sass_regions.py "$LOGS/${WHICH}_sass.csv.gz" --min-share 0.01 --top 25
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers|Local" \
  "$LOGS/${WHICH}_details.txt" | cut -c1-150 | head -30
