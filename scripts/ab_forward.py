"""One tree's side of a forward A/B (WHICH=fwd bash scripts/gpu_backward_ab.sh A B runs it once per tree, A B B A,
each in its own process): for each problem, the CRC32 of y at emulated EP 1, 2, 4 and 8 (the same tokens and
experts split over the ranks: the same total work on one GPU), whether they agree across EP sizes, then the median
ms of the dense FFN of the same FLOPs, of the layer's forward (EP 1, the default config) and of each emulated EP
size's forward, with the SM clock while each ran. One JSON line per problem on stdout. AB_PRECISION=fp8: the same
for the layer's FP8 form (precision="fp8", the weights quantised once outside the timed calls). AB_EPS="1 2": only
those emulated EP sizes (default 1 2 4 8).

    python scripts/ab_forward.py kimi-k2:2048:16 qwen3-30b-a3b:8192:16
    python scripts/ab_forward.py --summary LOGS A B     (what gpu_backward_ab.sh prints last)
"""
import os
import sys

from ab_backward import ab_main, ab_rows, crc  # this script's folder, first on sys.path when it runs

SAMPLES = 5
EPS = tuple(int(e) for e in os.environ.get("AB_EPS", "1 2 4 8").split())


def case(spec: str) -> dict:
    import jax  # here, so that --summary runs where the package is not installed

    import mok_jax as mj
    from mok_jax.bench.breakdown import _problem, _timed
    from mok_jax.bench.dense import dense_groups, dense_problem, dense_step
    from mok_jax.emulation import emulated_moe

    name, tokens, experts = (spec.split(":") + [None, None])[:3]
    tokens = int(tokens or 2048)
    experts = int(experts) if experts else None
    timing_kw = {"samples": SAMPLES, "target_sample_ms": 80.0}
    m, x, idx, w, W, flops = _problem(name, tokens, 3, experts)
    E = W.gate_up.shape[0]
    eps = [ep for ep in EPS if E % ep == 0 and tokens % ep == 0]
    precision = os.environ.get("AB_PRECISION", "bf16")
    w8 = mj.fp8.quantize_expert_weights(W.gate_up, W.down) if precision == "fp8" else None
    config = mj.MoEConfig(implementation="mok", precision=precision)
    layer = jax.jit(lambda x, i, w, W: mj.moe(x, i, w, W, config=config, fp8_weights=w8))
    emulated = {ep: jax.jit(lambda x, i, w, W, ep=ep: emulated_moe(x, i, w, W, ep=ep, precision=precision,
                                                                    fp8_weights=w8)[0]) for ep in eps}
    res = {"problem": spec, "precision": precision, "experts": E, "bits": {"layer": crc(layer(x, idx, w, W))}}
    for ep in eps:
        res["bits"][f"ep{ep}"] = crc(emulated[ep](x, idx, w, W))
    res["same bits at every EP size"] = len(set(res["bits"].values())) == 1
    dense = dense_problem(dense_groups(tokens, m.top_k, m.intermediate_size, m.shared_size), m.hidden_size, seed=3)
    res["dense fwd"] = _timed(dense_step("fwd"), (dense.xs, dense.weights), timing_kw)
    res["layer fwd"] = _timed(layer, (x, idx, w, W), timing_kw)
    for ep in eps:
        res[f"ep{ep} fwd"] = _timed(emulated[ep], (x, idx, w, W), timing_kw)
    res["dense fwd after"] = _timed(dense_step("fwd"), (dense.xs, dense.weights), timing_kw)
    res["useful TFLOP"] = flops / 1e12
    return res


def summary(logs: str, *trees: str) -> None:
    for p, order, rows in ab_rows(logs, *trees):
        ok = [r for r in rows if r]
        print(f"== {ok[0]['problem'] if ok else p}")
        for t, r in zip(order, rows):
            if not r:
                continue
            clock = r["layer fwd"].get("sm_mhz")
            times = "  ".join(f"{k.split()[0]} {r[k]['ms']:.3f}" for k in r if k.endswith(" fwd") and k != "dense fwd")
            print(f"   {t:>10}: EP bits {'same' if r['same bits at every EP size'] else 'DIFFER'} "
                  f"({','.join(sorted(set(r['bits'].values())))})  dense {r['dense fwd']['ms']:.3f}/"
                  f"{r['dense fwd after']['ms']:.3f}  {times}  (SM clock {clock})")


if __name__ == "__main__":
    sys.exit(ab_main(sys.argv[1:], case, summary))
