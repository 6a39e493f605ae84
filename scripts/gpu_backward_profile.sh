#!/usr/bin/env bash
# Where a megakernel waits (issue 33), on a lent H200: Nsight Compute (clocks left alone) on one launch of the
# backward (ops.experts_backward, kept g, u as the default keep hands them) or of the forward (the layer's forward)
# at a model's one-GPU problem (E/32 experts, T = 2048): every section, and its warp-stall samples per SASS
# instruction (bwd_sass.csv.gz / fwd_sass.csv.gz, for scripts/lab/sass_regions.py). Logs under $OUT.
# Usage there: [MODEL=kimi-k2] [WHICH=bwd|fwd] bash scripts/gpu_backward_profile.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=${OUT:-$PWD/out}; mkdir -p "$LOGS"
MODEL=${MODEL:-kimi-k2}
cat > /tmp/mok_bwd_once.py <<'PY'
import sys
import jax, jax.numpy as jnp
from mok_jax import ops
from mok_jax.bench.breakdown import _problem
from mok_jax.expert_layout import padded_layout
from mok_jax.ops.moe_backward import EXPERTS_BACKWARD_GROUP_ALIGN
m, x, idx, w, W, _ = _problem(sys.argv[1], 2048, 0)
E = W.gate_up.shape[0]
dy = jax.random.normal(jax.random.key(1), x.shape, jnp.float32).astype(jnp.bfloat16)
lay = padded_layout(idx, E, block=EXPERTS_BACKWARD_GROUP_ALIGN)
shared = dict(shared_gate_up=W.shared_gate_up, shared_down=W.shared_down) if W.has_shared else {}
args = ((x, dy, w.astype(jnp.float32), lay.pos, lay.src_slot, lay.group_sizes, W.gate_up, W.down), shared)
_, gu = jax.jit(lambda a, s: ops.experts_backward(*a, **s, return_gu=True))(*args)
op = jax.jit(lambda a, s, gu: ops.experts_backward(*a, **s, gu=gu))
if sys.argv[2] == "fwd":
    from mok_jax import tuning
    from mok_jax.config import MoEConfig
    from mok_jax.layer import moe
    H, I, k = m.hidden_size, m.intermediate_size, m.top_k
    key = tuning.ProblemKey(hidden=H, intermediate=I, top_k=k, experts_per_rank=E, ep=1, tokens=2048)
    cfg = MoEConfig(implementation="mok", kernel=tuning.resolve(None, key, jax.devices()[0].device_kind))
    fwd = jax.jit(lambda x, i, w, W: moe(x, i, w, W, config=cfg))
    for _ in range(4):
        y = fwd(x, idx, w, W)
    print("y finite", bool(jnp.isfinite(y.astype(jnp.float32)).all()))
else:
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
  python3 /tmp/mok_bwd_once.py "$MODEL" "$WHICH" > "$LOGS/ncu_run.log" 2>&1
echo "ncu exit $?"; tail -4 "$LOGS/ncu_run.log"
ncu --import "$LOGS/${WHICH}_full.ncu-rep" --page source --csv --print-source sass > "$LOGS/${WHICH}_sass.csv" 2>&1
ncu --import "$LOGS/${WHICH}_full.ncu-rep" --page details > "$LOGS/${WHICH}_details.txt" 2>&1
python3 - "$LOGS" "$WHICH" <<'PY'
import csv, sys
logs = sys.argv[1]
for name in (f"{sys.argv[2]}_sass",):
    hits, cols, tot = [], None, 0.0
    for r in csv.reader(open(f"{logs}/{name}.csv")):
        if "Source" in r and any(c.startswith("Warp Stall Sampling (All") for c in r):
            cols = r
            i_s = cols.index(next(c for c in cols if c.startswith("Warp Stall Sampling (All")))
            i_src = cols.index("Source")
            continue
        if cols is None or len(r) <= i_s:
            continue
        try:
            v = float(r[i_s] or 0)
        except ValueError:
            continue
        tot += v
        hits.append((v, r[0][:8], r[i_src].strip()[:110]))
    print(f"{name}: stall samples {tot:.0f}; top lines:")
    for v, a, src in sorted(hits, key=lambda h: -h[0])[:25]:
        print(f"  {v / max(tot, 1):6.1%}  {a:>8}  {src}")
PY
gzip -f "$LOGS/${WHICH}_sass.csv"
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers|Local" \
  "$LOGS/${WHICH}_details.txt" | cut -c1-150 | head -30
