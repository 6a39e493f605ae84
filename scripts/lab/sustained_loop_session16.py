"""Where the timed fwd+bwd's 14-18% over the traced span goes (sixteenth session): the timed median, then a traced
loop of 40 back-to-back calls after 10 more, per call: the period between forward kernels, its busy and idle time,
the big kernels' durations, the SM clock sampled beside each.

    PYTHONPATH=. python3 scripts/lab/sustained_loop_session16.py kimi-k2,qwen3.5-397b-a17b

A lab script (the sixteenth session's; docs/performance_history.md), not part of the package. It writes
$OUT/gap.json (OUT defaults to /tmp/out); GAP_CALLS sets the traced loop's length (40).
"""
import argparse, json, os, statistics, time

import jax
import jax.numpy as jnp

from mok_jax import tuning
from mok_jax.bench.backward import _gpu_events
from mok_jax.bench.breakdown import _Clocks, _problem, _trace_events
from mok_jax.bench.timing import time_fn
from mok_jax.config import MoEConfig
from mok_jax import moe

def main(models: str) -> None:
    OUT = os.environ.get("OUT", "/tmp/out")
    N = int(os.environ.get("GAP_CALLS", "40"))
    res = {}
    for name in models.split(","):
        m, x, idx, w, W, flops = _problem(name, 2048, 0)
        E, H, I, k = W.gate_up.shape[0], m.hidden_size, m.intermediate_size, m.top_k
        key = tuning.ProblemKey(hidden=H, intermediate=I, top_k=k, experts_per_rank=E, ep=1, tokens=2048)
        cfg = MoEConfig(implementation="mok", kernel=tuning.resolve(None, key, jax.devices()[0].device_kind))
        dy = jax.random.normal(jax.random.key(1), x.shape, jnp.float32).astype(jnp.bfloat16)
        grad = jax.jit(jax.grad(lambda x, i, w, W, dy: jnp.sum(moe(x, i, w, W, config=cfg).astype(jnp.float32) * dy),
                                argnums=(0, 2, 3)))
        args = (x, idx, w, W, dy)
        jax.block_until_ready(grad(*args))
        r = {}
        with _Clocks() as c:
            t = time_fn(grad, *args, samples=20, target_sample_ms=100.0)
        r["timed_ms"], r["timed_calls"], r["timed_clock"] = t.median_ms, t.calls_per_sample, c.summary()
        # a long back-to-back loop under the profiler, after 1 s of sustained load inside the trace
        d = f"/tmp/gap_trace_{name}"
        with _Clocks() as c:
            with jax.profiler.trace(d):
                for _ in range(N // 4):
                    g = grad(*args)
                jax.block_until_ready(g)
                t0 = time.perf_counter()
                for _ in range(N):
                    g = grad(*args)
                jax.block_until_ready(g)
                wall = (time.perf_counter() - t0) * 1e3 / N
        r["trace_clock"] = c.summary()
        r["trace_wall_ms"] = wall
        ev = sorted(_gpu_events(_trace_events(d)), key=lambda e: e["ts"])
        starts = [i for i, e in enumerate(ev) if "forward_kernel" in e["name"]]
        r["forward_launches"] = len(starts)
        starts = starts[-(N + 1):]  # the N periods between the last N + 1 forward kernels
        periods, busy, idle, kern = [], [], [], {}
        for a_, b_ in zip(starts, starts[1:]):
            cev = ev[a_:b_]
            t0_, t1_ = ev[a_]["ts"], ev[b_]["ts"]
            periods.append((t1_ - t0_) / 1e3)
            end, bz = t0_, 0.0
            for e in cev:
                st, sp = max(e["ts"], end), min(e["ts"] + e["dur"], t1_)
                if sp > st:
                    bz += sp - st
                end = max(end, e["ts"] + e["dur"])
            busy.append(bz / 1e3)
            idle.append((t1_ - t0_ - bz) / 1e3)
            for e in cev:
                if e["dur"] > 200:
                    kern.setdefault(e["name"][:60], []).append(e["dur"] / 1e3)
        r["events_per_call"] = len(ev) / max(1, len(starts))
        r["span_ms"] = {"median": statistics.median(periods), "first5": periods[:5], "last5": periods[-5:]}
        r["busy_ms_median"] = statistics.median(busy)
        r["between_calls_ms"] = {"median": statistics.median(idle), "max": max(idle),
                                 "sum_per_call": sum(idle) / len(idle)}
        r["device_ms_per_call"] = (ev[starts[-1]]["ts"] - ev[starts[0]]["ts"]) / 1e3 / (len(starts) - 1)
        r["big_kernels_ms"] = {n: {"median": statistics.median(v), "first3": v[:3], "last3": v[-3:], "min": min(v),
                                   "max": max(v)} for n, v in kern.items()}
        res[name] = r
        print(name, json.dumps(r, indent=1), flush=True)
    json.dump(res, open(f"{OUT}/gap.json", "w"), indent=1)
    print("=== summary ===")
    for name, r in res.items():
        print(f"{name}: timed {r['timed_ms']:.3f} ms (x{r['timed_calls']}, clock med {r['timed_clock'].get('sm_mhz')} "
              f"min {r['timed_clock'].get('sm_mhz_min')}); traced loop wall {r['trace_wall_ms']:.3f}, device "
              f"{r['device_ms_per_call']:.3f}/call, span med {r['span_ms']['median']:.3f}, "
              f"busy {r['busy_ms_median']:.3f}, "
              f"idle per call med {r['between_calls_ms']['median']:.3f} max {r['between_calls_ms']['max']:.3f}; "
              f"clock med {r['trace_clock'].get('sm_mhz')} min {r['trace_clock'].get('sm_mhz_min')}")
        for n, v in r["big_kernels_ms"].items():
            print(f"   {n}: med {v['median']:.3f} min {v['min']:.3f} max {v['max']:.3f} "
                  f"first {v['first3']} last {v['last3']}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", help="comma-separated model names, e.g. kimi-k2,qwen3.5-397b-a17b")
    main(ap.parse_args().models)
