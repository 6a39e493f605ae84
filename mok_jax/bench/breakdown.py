"""Where the megakernel's forward time goes, on one GPU: timing variants that leave one phase out.

    python -m mok_jax.bench.breakdown [--model kimi-k2,...] [--tokens 2048] [--json out.json] [--trace DIR]

For each model (the one-GPU ep64-slice problem: E/32 experts, uniform routing, bf16, the tuned kernel
config), in one process, median ms of back-to-back calls (mok_jax.bench.timing):
- ``mok``: the layer forward (emulated EP 1: the same kernel and plan as a one-rank mesh call);
- ``dispatch rows twice`` / ``reduce rows twice``: the kernel with that phase's row moves done twice
  (``ops.moe_forward(timing_mode=...)``; the outputs stay right): the difference to ``mok`` is what one
  pass of the phase costs the call beyond what the overlap hides;
- ``no dispatch rows`` / ``no reduce rows``: those row moves left out. The outputs are wrong, and so is the
  data the GEMMs then read (stale ring rows, perhaps zeros, which multiply faster), so these differences
  overstate a phase's cost; measured: they are kept beside the sound "twice" ones to show by how much;
- ``data path``: identity experts (dispatch and combine, no GEMMs, no shared expert);
- ``grouped FFN`` and ``shared FFN``: the standalone grouped FFN kernel over the same expert-major rows, and
  over the T rows of the shared expert; with ``data path`` they make an unfused lower bound;
- at emulated EP 2 (T/2 tokens per rank, the same total work): ``mok`` and ``-send rows`` (the owners'
  pre-summed partials left out), which is what choice (b)'s owner side costs.
Beside them: a dense bf16 GEMM of 8192^3 (the compute floor's reference) timed the same way, and the SM
clock and power that nvidia-smi reports while each variant runs. ``--trace DIR`` also records 40 calls of
``mok`` with jax.profiler (with ``--only-comm-items`` too) and prints the kernel's device time of the first and
last calls, and the median time from one launch of it to the next: what a call spends outside the kernel.
``--items`` also runs the kernel's "item times" form (the same work; ``mok, item times`` is its time) and prints,
per kind of work item, the consumers' busy and waiting ms per CTA and when the kind's first item started and its
last ended (item_times; the median of 5 calls). With a shared expert, ``--items`` also times the "shared down
early" order (the shared expert's down tiles before the first microbatch's gate/up tiles, where the production
order runs them after: the same work and bits) in the same form, ``mok, item times, shared down early``, and prints
its item times beside.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import subprocess
import sys
import threading

import numpy as np

__all__ = ["item_times", "main", "run"]

MODELS = ("kimi-k2", "glm-5", "qwen3.5-397b-a17b", "deepseek-v4-pro")


# nvidia-smi's clock event reasons (bits of clocks_event_reasons.active) that can hold the SM clock down.
_CLOCK_REASONS = {0x2: "applications clocks", 0x4: "sw power cap", 0x8: "hw slowdown", 0x10: "sync boost",
                  0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake", 0x100: "display clocks"}


class _Clocks:
    """nvidia-smi's SM clock (MHz), power (W) and clock event reasons, sampled every 50 ms while the block runs."""

    _query: str | None = None  # the fields this nvidia-smi answers (the reasons need driver 535 or later)

    def __init__(self):
        self.samples: list[tuple[float, float, int]] = []
        self._proc = None

    @classmethod
    def _fields(cls) -> str:
        if cls._query is None:
            full = "clocks.sm,power.draw,clocks_event_reasons.active"
            try:
                ok = subprocess.run(["nvidia-smi", f"--query-gpu={full}", "--format=csv,noheader"],
                                    capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                ok = False
            cls._query = full if ok else "clocks.sm,power.draw"
        return cls._query

    def __enter__(self):
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={self._fields()}", "--format=csv,noheader,nounits", "-lms", "50"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            sample = _parse_clock_line(line)
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
            self._thread.join(timeout=5)

    def summary(self) -> dict:
        if not self.samples:
            return {"sm_mhz": None, "watts": None}
        mhz = [s[0] for s in self.samples]
        reasons = 0
        for s in self.samples:
            reasons |= s[2]
        return {"sm_mhz": statistics.median(mhz), "sm_mhz_min": min(mhz),
                "watts": statistics.median(s[1] for s in self.samples),
                "clock_reasons": [name for bit, name in _CLOCK_REASONS.items() if reasons & bit]}


def _parse_clock_line(line: str) -> tuple[float, float, int] | None:
    """(MHz, W, reason bits) of one nvidia-smi line "1980, 412.3, 0x0000000000000004"; None for a line that is not
    one (a header, "[N/A]"). A missing or unreadable reasons field reads as 0."""
    parts = [p.strip() for p in line.split(",")]
    try:
        mhz, watts = float(parts[0]), float(parts[1])
    except (ValueError, IndexError):
        return None
    try:
        reasons = int(parts[2], 16) if len(parts) > 2 else 0
    except ValueError:
        reasons = 0
    return mhz, watts, reasons


def _timed(fn, args, timing_kw) -> dict:
    from mok_jax.bench.timing import time_fn

    with _Clocks() as clk:
        t = time_fn(fn, *args, **timing_kw)
    return {"ms": t.median_ms, "min_ms": t.min_ms, "max_ms": t.max_ms, "calls": t.calls_per_sample, **clk.summary()}


def _trace_events(trace_dir: str) -> list[dict]:
    """The events of the newest jax.profiler trace under trace_dir ([] when there is none)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not files:
        return []
    ev = json.load(gzip.open(files[-1]))
    return ev["traceEvents"] if isinstance(ev, dict) else ev


def _device_events(events: list[dict]) -> list[dict]:
    """The trace's complete events on the processes that its metadata names "/device:..." (every process's when it
    names none). The trace also names the host's launch of a kernel after the kernel (a few us each, one per call,
    at the host's pace): those are not the kernel's."""
    names = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, n in names.items() if str(n).startswith("/device:")}
    return [e for e in events if e.get("ph") == "X" and "dur" in e and (not devices or e.get("pid") in devices)]


def _kernel_events(events: list[dict], name: str) -> list[dict]:
    """The device's complete events whose name contains ``name``, in time order."""
    return sorted((e for e in _device_events(events) if name in e.get("name", "")), key=lambda e: e["ts"])


def _kernel_times(events: list[dict], name: str) -> list[float]:
    """ms of each complete event whose name contains ``name``, in time order."""
    return [e["dur"] / 1e3 for e in _kernel_events(events, name)]


def _kernel_periods(events: list[dict], name: str) -> list[float]:
    """ms from each start of a complete event whose name contains ``name`` to the next one's, in time order: beside
    the kernel's own durations, what back-to-back calls spend between two of its launches (the other kernels of
    the call, the launch gaps)."""
    ks = _kernel_events(events, name)
    return [(b["ts"] - a["ts"]) / 1e3 for a, b in zip(ks, ks[1:])]


def _problem(model_name: str, tokens: int, seed: int, experts: int | None = None):
    """The one-GPU problem of ``model_name``: ``experts`` routed experts (default E/32: the whole 2-GPU ep64-slice
    problem), ``tokens`` tokens, uniform routing, random bf16 weights scaled by fan-in."""
    import jax
    import jax.numpy as jnp

    from mok_jax.bench.routing import make_routing
    from mok_jax.config import load_model
    from mok_jax.weights import MoEWeights

    m = load_model(model_name)
    E = m.num_experts // 32 if experts is None else experts
    H, I, k, Is = m.hidden_size, m.intermediate_size, m.top_k, m.shared_size
    idx, w = make_routing("uniform", num_ranks=1, tokens_per_rank=tokens, num_experts=E, top_k=k, seed=seed)
    keys = jax.random.split(jax.random.key(seed), 5)
    normal = lambda key, s, fan_in: (jax.random.normal(key, s, jnp.float32) * fan_in**-0.5).astype(jnp.bfloat16)
    W = MoEWeights(normal(keys[0], (E, H, 2 * I), H), normal(keys[1], (E, I, H), I),
                   normal(keys[2], (H, 2 * Is), H) if Is else None, normal(keys[3], (Is, H), Is) if Is else None)
    x = normal(keys[4], (tokens, H), 1.0)
    flops = 2 * tokens * 3 * H * (k * I + Is)
    return m, x, jnp.asarray(idx), jnp.asarray(w), W, flops


def item_times(calls) -> dict:
    """Per kind of the forward's work items, from the "item times" words of one rank in calls (uint32[..., 12, 5, 2]
    each, ops.moe_forward): the items, the consumers' busy and waiting ms per CTA and the first start and last end
    in us after the consumers' first start; the median over the calls of each. Kinds without items are left out."""
    from mok_jax.ops.moe_forward import ITEM_TIME_FIELDS, ITEM_TIME_KINDS

    per_call = []
    for words in calls:
        w = np.asarray(words, dtype=np.uint64).reshape(len(ITEM_TIME_KINDS), len(ITEM_TIME_FIELDS), 2)
        f = w[..., 0] | (w[..., 1] << np.uint64(32))  # the u64 fields
        ctas = int(f[-1, 2])  # the consumers' row counts the CTAs
        if ctas == 0:
            raise ValueError("item_times: no CTA recorded its run (was the call made with the \"item times\" bit?)")
        t0 = int(~f[-1, 3])  # the consumers' first start
        kinds = {}
        for i, kind in enumerate(ITEM_TIME_KINDS):
            if f[i, 2] == 0:
                continue
            kinds[kind] = {"items": int(f[i, 2]), "busy ms per CTA": int(f[i, 0]) / ctas / 1e6,
                           "waited ms per CTA": int(f[i, 1]) / ctas / 1e6,
                           "first start us": (int(~f[i, 3]) - t0) / 1e3, "last end us": (int(f[i, 4]) - t0) / 1e3}
        per_call.append(kinds)
    return {kind: {k: statistics.median(c[kind][k] for c in per_call) for k in per_call[0][kind]}
            for kind in per_call[0]}


def _case(model_name: str, tokens: int, timing_kw, seed: int, trace: str | None, comm_items=(),
          only_sweep=False, items=False, experts: int | None = None) -> dict:
    import jax
    import jax.numpy as jnp

    from mok_jax import ops, tuning
    from mok_jax.emulation import emulated_moe
    from mok_jax.ops.moe_forward import TIMING_MODES

    m, x, idx, w, W, flops = _problem(model_name, tokens, seed, experts)
    E, H = W.gate_up.shape[0], x.shape[1]
    out = {"model": model_name, "tokens": tokens, "experts": E, "flops": flops}

    key = tuning.ProblemKey(hidden=H, intermediate=m.intermediate_size, top_k=m.top_k, experts_per_rank=E, ep=1,
                            tokens=tokens)
    tuned = tuning.resolve(None, key, jax.devices()[0].device_kind)
    out["kernel"] = str(tuned)

    def layer(ep=1, timing_mode=0, identity=False, kernel=None):
        return jax.jit(lambda x, i, w, W: emulated_moe(x, i, w, W, ep=ep, timing_mode=timing_mode, kernel=kernel,
                                                        identity_experts=identity)[0])

    args = (x, idx, w, W)
    rows = {}
    for c in comm_items:  # the tuned config with another count of communication items
        kernel = tuned.replace(comm_items_fwd=c, comm_items_bwd=c)
        rows[f"comm items {c}"] = _timed(layer(kernel=kernel), args, timing_kw)
    rows["mok"] = _timed(layer(), args, timing_kw)
    if items:  # the "item times" form: its time beside mok's, and the times of 5 calls' items
        timed = jax.jit(lambda x, i, w, W: emulated_moe(x, i, w, W, ep=1, timing_mode=TIMING_MODES["item times"]))
        rows["mok, item times"] = _timed(jax.jit(lambda *a: timed(*a)[0]), args, timing_kw)
        out["item times"] = item_times([np.asarray(timed(*args)[2][0]) for _ in range(5)])
        if W.shared_gate_up is not None:  # the other order of the shared expert's down tiles, in the same form
            early = TIMING_MODES["item times"] | TIMING_MODES["shared down early"]
            timed_early = jax.jit(lambda x, i, w, W: emulated_moe(x, i, w, W, ep=1, timing_mode=early))
            rows["mok, item times, shared down early"] = _timed(jax.jit(lambda *a: timed_early(*a)[0]), args,
                                                                timing_kw)
            out["item times, shared down early"] = item_times([np.asarray(timed_early(*args)[2][0])
                                                               for _ in range(5)])
    if trace:
        _trace_case(layer(), args, trace, model_name, out)
    if only_sweep:
        out["rows"] = rows
        return out
    rows["dispatch rows twice"] = _timed(layer(timing_mode=TIMING_MODES["dispatch rows twice"]), args, timing_kw)
    rows["reduce rows twice"] = _timed(layer(timing_mode=TIMING_MODES["reduce rows twice"]), args, timing_kw)
    rows["no dispatch rows"] = _timed(layer(timing_mode=TIMING_MODES["no dispatch rows"]), args, timing_kw)
    rows["no reduce rows"] = _timed(layer(timing_mode=TIMING_MODES["no reduce rows"]), args, timing_kw)
    rows["data path"] = _timed(layer(identity=True), args, timing_kw)

    # The standalone grouped FFN over the same expert-major rows, and the shared expert as one group of T rows.
    flat = np.asarray(idx).reshape(-1)
    order = np.argsort(flat, kind="stable")
    sizes = jnp.asarray(np.bincount(flat, minlength=E).astype(np.int32))
    xr = jnp.asarray(x)[jnp.asarray(order // idx.shape[1])]
    gffn = jax.jit(lambda a, g, w1, w2: ops.grouped_ffn(a, g, w1, w2).y)
    rows["grouped FFN"] = _timed(gffn, (xr, sizes, W.gate_up, W.down), timing_kw)
    if W.shared_gate_up is not None:
        rows["shared FFN"] = _timed(gffn, (x, jnp.asarray([tokens], jnp.int32), W.shared_gate_up[None],
                                           W.shared_down[None]), timing_kw)

    # Emulated EP 2 with the same total work: choice (b)'s owner side.
    if E % 2 == 0 and tokens % 2 == 0:
        rows["ep2 mok"] = _timed(layer(ep=2), args, timing_kw)
        rows["ep2 no send rows"] = _timed(layer(ep=2, timing_mode=TIMING_MODES["no send rows"]), args, timing_kw)

    out["rows"] = rows
    return out


def _trace_case(fn, args, trace: str, model_name: str, out: dict) -> None:
    """40 back-to-back calls of fn under jax.profiler: the forward kernel's device ms per call and the ms from one
    launch of it to the next (trace_kernel_ms, trace_period_ms)."""
    import jax

    jax.block_until_ready(fn(*args))
    d = os.path.join(trace, model_name)
    with jax.profiler.trace(d):
        for _ in range(40):
            y = fn(*args)
        jax.block_until_ready(y)
    events = _trace_events(d)
    out["trace_kernel_ms"] = _kernel_times(events, "forward_kernel")
    out["trace_period_ms"] = _kernel_periods(events, "forward_kernel")


def _dense(timing_kw) -> dict:
    import jax
    import jax.numpy as jnp

    n = 8192
    ka, kb = jax.random.split(jax.random.key(7))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    r = _timed(jax.jit(lambda a, b: a @ b), (a, b), timing_kw)
    r["tflops"] = 2 * n**3 / r["ms"] / 1e9
    return r


def run(models=MODELS, tokens: int = 2048, *, samples: int = 15, sample_ms: float = 100.0, seed: int = 0,
        trace: str | None = None, comm_items=(), only_sweep: bool = False, items: bool = False,
        experts: int | None = None) -> dict:
    import jax

    timing_kw = dict(samples=samples, target_sample_ms=sample_ms)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "tokens": tokens,
           "dense_before": _dense(timing_kw), "cases": []}
    for name in models:
        res["cases"].append(_case(name, tokens, timing_kw, seed, trace, comm_items, only_sweep, items, experts))
        print(table({**res, "cases": res["cases"][-1:]}, header=False), flush=True)
    res["dense_after"] = _dense(timing_kw)
    return res


def table(res: dict, header: bool = True) -> str:
    lines = []
    if header:
        for key in ("dense_before", "dense_after"):
            d = res.get(key)
            if d:
                lines.append(f"dense bf16 GEMM 8192^3 ({key[6:]}): {d['ms']:.3f} ms = {d['tflops']:.0f} TFLOP/s "
                             f"(SM {d['sm_mhz']} MHz, {d['watts']} W)")
    for c in res["cases"]:
        floor = c["flops"] / 805e9
        lines.append(f"{c['model']} ({c['experts']} experts, {c['tokens']} tokens; floor {floor:.3f} ms at 805 "
                     f"TFLOP/s; {c['kernel']})")
        lines.append("| variant | ms | vs mok | SM MHz (min) | W |")
        lines.append("| --- | --: | --: | --: | --: |")
        base = c["rows"]["mok"]["ms"]
        for name, r in c["rows"].items():
            lines.append(f"| {name} | {r['ms']:.3f} | {r['ms'] - base:+.3f} | {r['sm_mhz']} ({r.get('sm_mhz_min')}) "
                         f"| {r['watts']} |")
        for key in ("item times", "item times, shared down early"):
            if not c.get(key):
                continue
            lines.append(f"| item kind ({key}) | items | busy ms per CTA | waited ms per CTA | first start us "
                         "| last end us |")
            lines.append("| --- | --: | --: | --: | --: | --: |")
            for kind, r in c[key].items():
                lines.append(f"| {kind} | {r['items']:.0f} | {r['busy ms per CTA']:.3f} | {r['waited ms per CTA']:.3f} "
                             f"| {r['first start us']:.1f} | {r['last end us']:.1f} |")
        ks = c.get("trace_kernel_ms")
        if ks:
            ps = c.get("trace_period_ms") or [float("nan")]
            lines.append(f"profiler: {len(ks)} kernels, first 3 {[round(v, 3) for v in ks[:3]]}, last 3 "
                         f"{[round(v, 3) for v in ks[-3:]]}, median {statistics.median(ks):.3f} ms; from one launch "
                         f"to the next, median {statistics.median(ps):.3f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mok_jax.bench.breakdown", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=",".join(MODELS))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--experts", type=int, default=None, help="experts of the one GPU (default E/32 of the model)")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--sample-ms", type=float, default=100.0)
    p.add_argument("--json")
    p.add_argument("--trace")
    p.add_argument("--comm-items", default="", help="comma list: also time the tuned config at these counts of "
                   "communication items (KernelConfig.comm_items_fwd and comm_items_bwd)")
    p.add_argument("--only-comm-items", action="store_true", help="time only the --comm-items sweep and mok")
    p.add_argument("--items", action="store_true", help="also the item times of the kernel's consumers, per kind")
    renamed = {"--comm-sms": "--comm-items", "--only-comm-sms": "--only-comm-items"}  # with KernelConfig's fields
    for old in renamed:  # refused, naming the new flag
        p.add_argument(old, dest="renamed_" + old[2:].replace("-", "_"), nargs="?", const="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for old, new in renamed.items():
        if getattr(a, "renamed_" + old[2:].replace("-", "_")) is not None:
            p.error(f"{old} is now {new}: it counts the communication work items, not SMs set aside")
    import jax

    if not any(d.platform == "gpu" for d in jax.devices()):
        print("mok_jax.bench.breakdown: no GPU here; it times the CUDA megakernel and needs one.")
        return 2
    res = run(tuple(a.model.split(",")), a.tokens, samples=a.samples, sample_ms=a.sample_ms, trace=a.trace,
              comm_items=tuple(int(c) for c in a.comm_items.split(",") if c), only_sweep=a.only_comm_items,
              items=a.items, experts=a.experts)
    print(table({**res, "cases": []}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
