"""Where the layer's backward time goes, on one GPU (EP 1).

    python -m mok_jax.bench.backward [--model kimi-k2,...] [--tokens 2048] [--experts N] [--json out.json]
        [--trace DIR]

For each model (the one-GPU ep64-slice problem: E/32 experts unless --experts, uniform routing, bf16), in one
process, median ms of back-to-back calls (mok_jax.bench.timing):
- ``dense fwd`` and ``dense fwd+bwd``: the layer's FLOPs as dense SwiGLU FFNs (mok_jax.bench.dense: T k (+ T) rows,
  one weight pair, cuBLAS through XLA), the practical limit; every layer time is also given as "x dense";
- ``fwd``: the layer forward with ``implementation="mok"`` (the megakernel);
- ``fwd+bwd``: jax.grad of sum(y * dy) with respect to x, topk_weight and every weight, as mok-bench times it,
  with the default MoEConfig (keep="balanced": at EP 1 the forward keeps every slot's g, u (bf16) and the backward
  skips the gate/up recompute), and its kept bytes (``kept_bytes``, bf16 [T k + 128 E, 2I], and the shared expert's
  bf16 [T, 2Is]);
- ``fwd+bwd recompute``: the same with MoEConfig(keep="nothing") (the backward recomputes g, u);
- ``fwd+bwd keep``: with MoEConfig(keep="everything") (at EP 1 the default's rows, the same program);
- ``fwd+bwd ring``: with MoEConfig(keep="ring") (only the g, u of the slots of the tokens still in the forward's
  ring: the last ring_slots microbatches; the backward recomputes the others), and its kept bytes
  (``ring_kept_bytes``: bf16 [T' k, 2I] for the ring's T' tokens, and the shared expert's; "everything"'s when every
  token fits);
- ``experts op``: ``ops.experts_backward`` alone on the tokens, dy, the padded expert-major layout of the same
  routing and the shared expert's weights, as the layer calls it (it gathers the rows, gives the routed and the
  shared experts' gradients and sums each token's slot rows of dx; the layer's backward adds the layout);
- ``items`` and ``items kept``: where the op's kernel time goes, recompute and kept g, u: per kind of work item,
  the ms per SM its consumers spent in such items and the ms spent waiting for their inputs (the kernel's own
  counters, summed over the CTAs and divided by the SM count), and beside each the bytes a model says it moves
  (``item_bytes``) over its ms in items: the rate it moved them at, against the card's HBM rate;
- with ``--trace DIR``: the device time of the op's kernel (one persistent launch: the row gather, gate/up
  recompute, down dgrad with the SwiGLU backward, gate/up dgrad, the two weight-gradient GEMMs, the router-weight
  and per-token sums) from a jax.profiler trace of a few calls, the kernels with the most device time in the op
  and in the layer's fwd+bwd, and its TFLOP/s; and the traced fwd+bwd's span, busy and idle time per call.
Beside them, the rate of a dense bf16 8192^3 GEMM timed in the same process (the card's sustained clock).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import sys

from mok_jax.bench.breakdown import _device_events

__all__ = ["grad_of", "item_bytes", "item_ms", "layer_config", "main", "op_args", "run"]

MODELS = ("kimi-k2", "glm-5", "qwen3.5-397b-a17b", "deepseek-v4-pro")  # at 2048 tokens, E/32 experts
# (qwen3-30b-a3b's one-GPU problem, 8192 tokens and 16 of its 128 experts: --model qwen3-30b-a3b --tokens 8192
# --experts 16)
# The op's launches, and how to find each in a trace: (label, a substring of the kernel's name, launches per
# call). The op is one persistent kernel (ffi/src/experts_backward.cu) after two small memsets.
LAUNCHES = (("experts backward kernel", "experts_backward_kernel", 1),)
_TRACED_CALLS = 5


def layer_config(m, W, tokens: int):
    """The default MoEConfig of implementation="mok" with the knobs the layer resolves for this one-GPU problem
    (EP 1; model m, weights W, ``tokens`` tokens)."""
    import jax

    from mok_jax import tuning
    from mok_jax.config import MoEConfig

    key = tuning.ProblemKey(hidden=m.hidden_size, intermediate=m.intermediate_size, top_k=m.top_k,
                            experts_per_rank=W.gate_up.shape[0], ep=1, tokens=tokens)
    return MoEConfig(implementation="mok", kernel=tuning.resolve(None, key, jax.devices()[0].device_kind))


def grad_of(config):
    """The timed fwd+bwd, jitted: jax.grad of sum(y * dy) with respect to x, topk_weight and every weight."""
    import jax
    import jax.numpy as jnp

    from mok_jax.layer import moe

    return jax.jit(jax.grad(lambda x, i, w, W, dy: jnp.sum(moe(x, i, w, W, config=config).astype(jnp.float32) * dy),
                            argnums=(0, 2, 3)))


def op_args(x, dy, idx, w, W):
    """The arguments of ops.experts_backward as the layer calls it at EP 1: (positional, keywords), with the padded
    expert-major layout of the routing and the shared expert's weights (the op runs its backward too)."""
    import jax.numpy as jnp

    from mok_jax.expert_layout import padded_layout
    from mok_jax.ops.moe_backward import EXPERTS_BACKWARD_GROUP_ALIGN

    lay = padded_layout(idx, W.gate_up.shape[0], block=EXPERTS_BACKWARD_GROUP_ALIGN)
    shared = dict(shared_gate_up=W.shared_gate_up, shared_down=W.shared_down) if W.has_shared else {}
    return (x, dy, w.astype(jnp.float32), lay.pos, lay.src_slot, lay.group_sizes, W.gate_up, W.down), shared


def item_ms(ns) -> dict[str, dict[str, float]]:
    """The op's per-kind counters (return_item_ns: [3, kinds] ns summed over the CTAs) as ms per SM in items,
    waiting for their inputs and, of the first, in a GEMM tile's epilogue (the kernel runs one CTA per SM)."""
    import jax

    from mok_jax.ops.moe_backward import ITEM_KINDS, ITEM_TIMES

    ctas = getattr(jax.devices()[0], "core_count", None) or 132
    ns = jax.device_get(ns)
    return {kind: {f"{what}_ms": float(ns[i, q]) / ctas / 1e6 for i, what in enumerate(ITEM_TIMES)}
            for q, kind in enumerate(ITEM_KINDS)}


def item_bytes(rows: int, tokens: int, hidden: int, inter: int, *, kept: bool, shared_inter: int = 0) -> dict:
    """A model of the HBM bytes each kind of the op's work items moves at EP 1 (benchmarks/results/training.md, "The
    bytes the backward moves"): bf16 rows, every intermediate written once and read once by each item that uses it,
    the gather's x and dy rows read once per slot (a rate above the HBM's then means L2 hits), the weights and their
    gradients not counted. ``rows``: the routed slots' rows; ``kept``: the forward's g | u handed to the op (no
    gate/up recompute of the routed rows); ``shared_inter``: the shared expert's I (0: none), whose tiles run in the
    same kinds over the ``tokens`` rows, read in place, their g, u always recomputed and their dx written in f32."""
    H, b = hidden, 2

    def tiles(m: int, i: int, dx_bytes: int) -> dict:
        return {"gate/up recompute": m * H * b + m * 2 * i * b,   # x rows; g | u written
                "down dgrad + SwiGLU bwd": m * H * b + 2 * m * 2 * i * b + m * i * b,  # dy, g | u; dg | du, hw
                "gate/up dgrad": m * 2 * i * b + m * H * dx_bytes,  # dg | du; the rows' dx
                "d_down": m * i * b + m * H * b,                   # hw, dy
                "d_gate_up": m * H * b + m * 2 * i * b}            # x, dg | du

    out = {"gather": 4 * rows * H * b,  # x and dy rows read, x_e and dy_e written
           "slot sum": rows * H * b + tokens * H * 4 + (tokens * H * 4 if shared_inter else 0)}
    for kind, n in tiles(rows, inter, b).items():
        if not (kind == "gate/up recompute" and kept):
            out[kind] = n
    if shared_inter:
        for kind, n in tiles(tokens, shared_inter, 4).items():
            out[kind] = out.get(kind, 0) + n
    return out


def _case(model_name: str, tokens: int, timing_kw, seed: int, trace: str | None, experts: int | None = None) -> dict:
    import jax
    import jax.numpy as jnp

    from mok_jax import ops
    from mok_jax.bench.accounting import KEPT_GU_BYTES
    from mok_jax.bench.breakdown import _kernel_times, _problem, _timed, _trace_events
    from mok_jax.bench.dense import dense_groups, dense_problem, dense_step
    from mok_jax.layer import kept_rows, moe
    from mok_jax.memory import kept_shared_gu_bytes
    from mok_jax.ops.moe_forward import first_ring_token

    m, x, idx, w, W, flops = _problem(model_name, tokens, seed, experts)
    E, H, I, k = W.gate_up.shape[0], m.hidden_size, m.intermediate_size, m.top_k
    cfg = layer_config(m, W, tokens)
    dy = jax.random.normal(jax.random.key(seed + 1), x.shape, jnp.float32).astype(jnp.bfloat16)
    fwd = jax.jit(lambda x, i, w, W: moe(x, i, w, W, config=cfg))
    grad = grad_of(cfg)
    grad_recompute = grad_of(dataclasses.replace(cfg, keep="nothing"))
    grad_keep = grad_of(dataclasses.replace(cfg, keep="everything"))
    grad_ring = grad_of(dataclasses.replace(cfg, keep="ring"))
    moe_mod = importlib.import_module("mok_jax.layer")

    default = moe_mod._SHARED_IN_OP
    moe_mod._SHARED_IN_OP = not default  # traced now: the other place for the shared expert's backward
    try:
        grad_other_shared = grad_of(cfg).lower(x, idx, w, W, dy).compile()
    finally:
        moe_mod._SHARED_IN_OP = default
    # the op as the layer calls it: with the shared expert, whose backward it runs too
    op = jax.jit(lambda a, s: ops.experts_backward(*a, **s))
    args = op_args(x, dy, idx, w, W)
    group_sizes = args[0][5]  # the padded layout's
    status = int(op(*args).status)
    t0 = first_ring_token(cfg.kernel, tokens)  # keep="ring" keeps the slots of tokens t0..: all when 0
    rows_of = dict(tokens=tokens, top_k=k, local_experts=E)
    dense = dense_problem(dense_groups(tokens, k, I, m.shared_size), H, seed=seed)
    res = {"model": model_name, "tokens": tokens, "kernel": str(cfg.kernel), "keep": cfg.keep, "E": E, "H": H,
           "I": I, "k": k, "fwd_flops": flops,
           "rows": int(jnp.sum(group_sizes)), "slots": int(jnp.sum(idx >= 0)), "op_status": status,
           "dense fwd": _timed(dense_step("fwd"), (dense.xs, dense.weights), timing_kw),
           "dense fwd+bwd": _timed(dense_step("fwd+bwd"), tuple(dense), timing_kw),
           "fwd": _timed(fwd, (x, idx, w, W), timing_kw),
           "fwd+bwd": _timed(grad, (x, idx, w, W, dy), timing_kw),
           "fwd+bwd recompute": _timed(grad_recompute, (x, idx, w, W, dy), timing_kw),
           "fwd+bwd keep": _timed(grad_keep, (x, idx, w, W, dy), timing_kw),
           "fwd+bwd ring": _timed(grad_ring, (x, idx, w, W, dy), timing_kw),
           "shared_in_op": bool(default),
           "fwd+bwd other shared": _timed(grad_other_shared, (x, idx, w, W, dy), timing_kw),
           "kept_bytes": kept_rows(cfg.keep, cfg.kernel, **rows_of) * 2 * I * KEPT_GU_BYTES
                         + kept_shared_gu_bytes(cfg.keep, tokens=tokens, shared_inter=m.shared_size),
           "ring_tokens": tokens - t0,
           "ring_kept_bytes": kept_rows("ring", cfg.kernel, **rows_of) * 2 * I * KEPT_GU_BYTES
                              + kept_shared_gu_bytes("ring", tokens=tokens, shared_inter=m.shared_size),
           "experts op": _timed(op, args, timing_kw)}
    # the op fed its own g, u (what keep="everything" hands it), and where each setting's kernel time goes
    _, gu = jax.jit(lambda a, s: ops.experts_backward(*a, **s, return_gu=True))(*args)
    op_kept = jax.jit(lambda a, s, gu: ops.experts_backward(*a, **s, gu=gu))
    res["experts op kept"] = _timed(op_kept, (*args, gu), timing_kw)
    for label, extra in (("items", {}), ("items kept", {"gu": gu})):
        _, ns = jax.jit(lambda a, s, kw: ops.experts_backward(*a, **s, **kw, return_item_ns=True))(*args, extra)
        res[label] = item_ms(ns)
    # FLOPs the op executes (gate/up twice: the recompute and its dgrad) over the slots' rows, and the shared
    # expert's over the tokens.
    Is = W.shared_down.shape[0] if W.has_shared else 0
    res["op_flops"] = 2 * (res["slots"] * I + tokens * Is) * H * (2 + 1 + 1 + 2 + 2)
    res["item_bytes"] = {label: item_bytes(res["slots"], tokens, H, I, kept=label == "items kept", shared_inter=Is)
                         for label in ("items", "items kept")}
    if trace:
        jax.block_until_ready(op(*args))
        with jax.profiler.trace(trace):
            for _ in range(_TRACED_CALLS):
                out = op(*args)
            jax.block_until_ready(out)
        events = _trace_events(trace)  # read once for every launch
        per = {}
        for name, key, launches in LAUNCHES:
            times = _kernel_times(events, key)[-launches * _TRACED_CALLS:]
            per[name] = statistics.median(times) * launches if times else None
        res["launch_ms"] = per
        res["op_kernels"] = _top_kernels(events, _TRACED_CALLS)
        jax.block_until_ready(grad(x, idx, w, W, dy))
        with jax.profiler.trace(trace + "/fwd_bwd"):
            for _ in range(_TRACED_CALLS):
                g = grad(x, idx, w, W, dy)
            jax.block_until_ready(g)
        fb_events = _trace_events(trace + "/fwd_bwd")
        res["fwd+bwd_kernels"] = _top_kernels(fb_events, _TRACED_CALLS)
        res["fwd+bwd_timeline"] = _timeline(fb_events, _TRACED_CALLS)
    return res


def _timeline(events: list[dict], calls: int, top: int = 8) -> dict:
    """Where a traced run of ``calls`` back-to-back calls leaves the GPU idle: per call the span (first launch's
    start to last one's end), the busy time (the union of the device events) and the idle rest, and the
    largest idle gaps summed by the pair of events around them (µs per call)."""
    ev = sorted(_device_events(events), key=lambda e: e["ts"])
    if not ev:
        return {}
    busy, gaps, end, last = 0.0, {}, ev[0]["ts"], ev[0]["name"]
    for e in ev:
        if e["ts"] > end:
            key = f"{last[:48]} -> {e['name'][:48]}"
            gaps[key] = gaps.get(key, 0.0) + (e["ts"] - end)
        start = max(e["ts"], end)
        stop = e["ts"] + e["dur"]
        if stop > start:
            busy += stop - start
        if stop >= end:
            end, last = stop, e["name"]
    span = end - ev[0]["ts"]
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:top]
    return {"span_ms": span / calls / 1e3, "busy_ms": busy / calls / 1e3, "idle_ms": (span - busy) / calls / 1e3,
            "events": round(len(ev) / calls), "gaps_us": [(k, v / calls) for k, v in worst]}


def _top_kernels(events: list[dict], calls: int, top: int = 14) -> list[tuple[str, float, int]]:
    """(name, ms per call, launches per call) of the GPU kernels with the most device time in a trace's events,
    over ``calls`` calls."""
    tot: dict[str, list[float]] = {}
    for e in _device_events(events):
        tot.setdefault(e["name"], []).append(e["dur"] / 1e3)
    rows = sorted(((n[:160], sum(d) / calls, round(len(d) / calls)) for n, d in tot.items()), key=lambda r: -r[1])
    return rows[:top]


def run(models=MODELS, tokens: int = 2048, *, samples: int = 15, sample_ms: float = 100.0, seed: int = 0,
        trace: str | None = None, experts: int | None = None) -> dict:
    from mok_jax.bench.breakdown import _dense

    timing_kw = {"samples": samples, "target_sample_ms": sample_ms}
    out = {"dense": _dense(timing_kw), "cases": []}
    for name in models:
        out["cases"].append(_case(name, tokens, timing_kw, seed, trace and f"{trace}/{name}", experts))
    return out


def table(res: dict) -> str:
    rate = res["dense"]["tflops"] if "tflops" in res["dense"] else None
    lines = [f"dense bf16 8192^3 GEMM: {rate:.0f} TFLOP/s" if rate else "dense GEMM: not measured",
             "x dense: the time over the dense FFN of the same FLOPs (mok_jax.bench.dense) timed in this process"]
    lines.append(f"{'model':<18} {'T':>5} {'E':>3} {'dense fwd':>9} {'fwd ms':>8} {'x dense':>8} {'dense f+b':>9} "
                 f"{'fwd+bwd':>8} {'x dense':>8} {'recompute':>9} {'x dense':>8} {'bwd':>7} {'op ms':>7} "
                 f"{'op TF/s':>8} {'keep':>8} {'kept MB':>8} {'ring':>8} {'ring MB':>8}")
    for c in res["cases"]:
        fb, df, dfb = c["fwd+bwd"]["ms"], c["dense fwd"]["ms"], c["dense fwd+bwd"]["ms"]
        rc = c["fwd+bwd recompute"]["ms"]
        lines.append(f"{c['model']:<18} {c['tokens']:>5} {c['E']:>3} {df:>9.3f} {c['fwd']['ms']:>8.3f} "
                     f"{c['fwd']['ms'] / df:>7.3f}x {dfb:>9.3f} {fb:>8.3f} {fb / dfb:>7.3f}x {rc:>9.3f} "
                     f"{rc / dfb:>7.3f}x {fb - c['fwd']['ms']:>7.3f} {c['experts op']['ms']:>7.3f} "
                     f"{c['op_flops'] / c['experts op']['ms'] / 1e9:>8.0f} {c['fwd+bwd keep']['ms']:>8.3f} "
                     f"{c['kept_bytes'] / 1e6:>8.0f} {c['fwd+bwd ring']['ms']:>8.3f} "
                     f"{c['ring_kept_bytes'] / 1e6:>8.0f}")
        for label in ("items", "items kept"):
            if c.get(label):
                parts = ", ".join(f"{n} {v['busy_ms']:.3f}/{v['wait_ms']:.3f}/{v['epilogue_ms']:.3f}"
                                  for n, v in c[label].items() if v["busy_ms"] or v["wait_ms"])
                lines.append(f"{'':<18} {label} (ms per SM, in/waiting/of which epilogue): {parts}")
                moved = c.get("item_bytes", {}).get(label, {})
                rates = ", ".join(f"{n} {moved[n] / 1e6:.0f} MB {moved[n] / (v['busy_ms'] * 1e-3) / 1e12:.2f} TB/s"
                                  for n, v in c[label].items() if moved.get(n) and v["busy_ms"])
                if rates:
                    lines.append(f"{'':<18} {label}, bytes by the model (item_bytes) over ms in items: {rates}")
        if c.get("launch_ms"):
            parts = ", ".join(f"{n} {v:.3f}" for n, v in c["launch_ms"].items() if v is not None)
            lines.append(f"{'':<18} launches (ms): {parts}")
        for what in ("op_kernels", "fwd+bwd_kernels"):
            if c.get(what):
                lines.append(f"{'':<18} {what}, ms per call: " + "; ".join(
                    f"{n[:70]} {ms:.3f} (x{cnt})" for n, ms, cnt in c[what]))
        if c.get("fwd+bwd other shared"):
            here, there = ("the op", "XLA") if c["shared_in_op"] else ("XLA", "the op")
            lines.append(f"{'':<18} fwd+bwd with the shared expert's backward in {there} instead of {here}: "
                         f"{c['fwd+bwd other shared']['ms']:.3f} ms (in {here}: {fb:.3f})")
        fbc = c["fwd+bwd"]
        if fbc.get("sm_mhz"):
            lines.append(f"{'':<18} SM clock while fwd+bwd was timed: median {fbc['sm_mhz']:.0f} MHz, lowest "
                         f"{fbc['sm_mhz_min']:.0f}; clock event reasons seen: "
                         f"{', '.join(fbc.get('clock_reasons') or []) or 'none'}")
        if c.get("fwd+bwd_timeline"):
            tl = c["fwd+bwd_timeline"]
            lines.append(f"{'':<18} fwd+bwd on the GPU, ms per call: span {tl['span_ms']:.3f}, "
                         f"busy {tl['busy_ms']:.3f}, idle {tl['idle_ms']:.3f} ({tl['events']} device events); "
                         "largest gaps (us per call): "
                         + "; ".join(f"{k} {v:.0f}" for k, v in tl["gaps_us"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mok_jax.bench.backward", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=",".join(MODELS))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--experts", type=int, help="routed experts on the GPU (default: the model's E/32)")
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--sample-ms", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", help="record a jax.profiler trace of the op here and print its launches' times")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from mok_jax.bench.timing import kernels_unavailable, warn_if_untuned_xla

    warn_if_untuned_xla("mok_jax.bench.backward")
    why = kernels_unavailable()
    if why:
        print(f"mok_jax.bench.backward: {why}")
        return 2
    if a.experts is not None and a.experts <= 0:
        ap.error(f"--experts must be a positive count, got {a.experts}")
    res = run(tuple(s for s in a.model.split(",") if s), a.tokens, samples=a.samples, sample_ms=a.sample_ms,
              seed=a.seed, trace=a.trace, experts=a.experts)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
