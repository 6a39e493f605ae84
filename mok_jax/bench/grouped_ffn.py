"""Benchmark of the Hopper grouped expert FFN (mok_jax.ops.grouped_ffn) on one GPU.

    python -m mok_jax.bench.grouped_ffn [--out results.json] [--models kimi-k2 ...] [--settings ep64 ep2]

Settings (the benchmark problems of the H200 machines), 2048 tokens per GPU, M = 2048 * top_k rows, uniform routing:
  ep64: the GPU holds E/64 experts (about 2,700 rows each): compute-bound. Compared, in the same process,
        with a dense bf16 GEMM pair of the same FLOPs through XLA (cuBLAS; SwiGLU unfused) and with the
        XLA batched einsum at exact capacity (groups padded to the largest one).
  ep2:  the GPU holds E/2 experts (about 85 rows each): bound by reading the weights. Reported as the
        weight bytes over the time, against the 4.26 TB/s device-to-device copy measured on one H200 and the
        4.8 TB/s nominal HBM rate. (The in-run XLA elementwise `v + 1` over 4 GiB, read + write, is also
        recorded as `copy_bandwidth_bytes_per_s`, but it reached only 3.2 TB/s on 2026-11-30, below the
        kernel's own weight-read rate, so it is not used as the ceiling.)
The kernel runs with every SM and with 108 SMs (the rest left to communication in the megakernel); the FP8
kernel (mok_jax.ops.fp8_grouped_ffn, E4M3 with DeepSeek-V3 block scales, weights quantised once outside the
timing) with every SM in the same process, reported beside bf16 as TFLOP/s and as the bf16 time over the FP8
time (--no-fp8 leaves it out). --kernels-only times the two kernels with every SM and nothing else, and records a
CRC of each output: the A/B of two builds of the library, one process each (MOK_JAX_LIB), compares their times
and checks that a change moved no bit (scripts/gpu_fp8_ab.sh).
Times: median of device-synchronised samples (mok_jax.bench.timing.time_fn). A short table is printed last.
Without a CUDA GPU (or the native library) it says so in one line and exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._native import native_status
from mok_jax.bench.timing import kernels_unavailable, time_fn
from mok_jax.config import load_model
from mok_jax.fp8 import quantize_expert_weights
from mok_jax.ops.grouped_ffn import fp8_grouped_ffn
from mok_jax.ops.grouped_ffn import grouped_ffn

__all__ = ["main", "run"]

MODELS = ("kimi-k2", "glm-5", "qwen3.5-397b-a17b", "deepseek-v4-pro")
TOKENS_PER_GPU = 2048
EP_DEGREE = {"ep64": 64, "ep2": 2}
REDUCED_SMS = 108
HBM_NOMINAL_BYTES_PER_S = 4.8e12
HARDWARE_MD_COPY_BYTES_PER_S = 4.26e12  # device-to-device copy measured on one H200 (read + written)
COPY_BYTES = 4 << 30  # device copy used as the measured bandwidth ceiling: well past the 60 MB L2


def _uniform_sizes(rows: int, experts: int) -> np.ndarray:
    sizes = np.full(experts, rows // experts, np.int32)
    sizes[: rows % experts] += 1
    return sizes


def _measure_copy_bandwidth(timing_kw) -> float:
    a = jnp.ones((COPY_BYTES // 2,), jnp.bfloat16)
    f = jax.jit(lambda v: v + jnp.bfloat16(1))
    t = time_fn(f, a, **timing_kw)
    del a
    return 2 * COPY_BYTES / (t.median_ms * 1e-3)  # bytes read + written


def _dense_pair(x, w1, w2):
    gate, up = jnp.split(x @ w1, 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ w2


def _batched_einsum(xb, gate_up, down):
    gu = jnp.einsum("ech,ehn->ecn", xb, gate_up, preferred_element_type=jnp.float32)
    gate, up = jnp.split(gu, 2, axis=-1)
    h = (jax.nn.silu(gate) * up).astype(xb.dtype)
    return jnp.einsum("eci,eih->ech", h, down)


def _digest(a: jax.Array) -> int:
    return zlib.crc32(np.asarray(a).tobytes())


def _bench_case(model: str, setting: str, timing_kw, num_sms_full: int, fp8: bool = True,
                kernels_only: bool = False) -> dict:
    shape = load_model(model)
    hidden, inter = shape.hidden_size, shape.intermediate_size
    experts = shape.num_experts // EP_DEGREE[setting]
    m = TOKENS_PER_GPU * shape.top_k
    sizes = _uniform_sizes(m, experts)
    key = jax.random.key(zlib.crc32(f"{model}/{setting}".encode()))
    kx, kg, kd = jax.random.split(key, 3)
    x = jax.random.normal(kx, (m, hidden), jnp.bfloat16)
    gate_up = (jax.random.normal(kg, (experts, hidden, 2 * inter), jnp.bfloat16) * hidden**-0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(kd, (experts, inter, hidden), jnp.bfloat16) * inter**-0.5).astype(jnp.bfloat16)
    group_sizes = jnp.asarray(sizes)
    flops = 6.0 * m * hidden * inter
    weight_bytes = 3.0 * experts * hidden * inter * 2
    out = {"model": model, "setting": setting, "rows": m, "experts": experts, "hidden": hidden,
           "intermediate": inter, "flops": flops, "weight_bytes": weight_bytes}

    runs = (("kernel_all_sms", None),) + (() if kernels_only else ((f"kernel_{REDUCED_SMS}_sms", REDUCED_SMS),))
    for label, n in runs:
        f = jax.jit(lambda a, g, w1, w2, n=n: grouped_ffn(a, g, w1, w2, num_sms=n))
        y, h, status = jax.block_until_ready(f(x, group_sizes, gate_up, down))
        ok = int(status) == 0 and bool(jnp.isfinite(y.astype(jnp.float32)).all())
        t = time_fn(f, x, group_sizes, gate_up, down, **timing_kw)
        out[label] = {"ms": t.median_ms, "tflops": flops / (t.median_ms * 1e-3) / 1e12, "sane_output": ok,
                      "timing": t.as_dict(), "num_sms": n or num_sms_full, "y_crc32": _digest(y)}
        del y, h

    if fp8:  # the FP8 kernel, every SM; the weights are quantised once, outside the timing
        w8 = jax.block_until_ready(jax.jit(quantize_expert_weights)(gate_up, down))
        f = jax.jit(lambda a, g, w: fp8_grouped_ffn(a, g, w).y)
        y = jax.block_until_ready(f(x, group_sizes, w8))
        status = int(jax.jit(lambda a, g, w: fp8_grouped_ffn(a, g, w).status)(x, group_sizes, w8))
        ok = status == 0 and bool(jnp.isfinite(y.astype(jnp.float32)).all())
        t = time_fn(f, x, group_sizes, w8, **timing_kw)
        out["fp8_all_sms"] = {"ms": t.median_ms, "tflops": flops / (t.median_ms * 1e-3) / 1e12, "sane_output": ok,
                              "timing": t.as_dict(), "num_sms": num_sms_full,
                              "speedup_over_bf16": out["kernel_all_sms"]["ms"] / t.median_ms, "y_crc32": _digest(y)}
        del y, w8
    if kernels_only:
        return out

    # Dense GEMM pair of the same FLOPs: all M rows against one expert's weights (XLA -> cuBLAS).
    f = jax.jit(_dense_pair)
    t = time_fn(f, x, gate_up[0], down[0], **timing_kw)
    out["dense_same_flops"] = {"ms": t.median_ms, "tflops": flops / (t.median_ms * 1e-3) / 1e12,
                               "timing": t.as_dict()}

    # XLA batched einsum at exact capacity (every group padded to the largest): timed on the padded batch.
    cap = int(sizes.max())
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows = np.minimum(offsets[:, None] + np.arange(cap)[None, :], m - 1)
    xb = x[jnp.asarray(rows)]
    f = jax.jit(_batched_einsum)
    t = time_fn(f, xb, gate_up, down, **timing_kw)
    out["xla_batched_einsum"] = {"ms": t.median_ms, "tflops": flops / (t.median_ms * 1e-3) / 1e12,
                                 "capacity": cap, "timing": t.as_dict()}
    del x, gate_up, down, xb
    return out


def run(models=MODELS, settings=("ep64", "ep2"), *, samples: int = 10, fp8: bool = True,
        kernels_only: bool = False) -> dict:
    dev = jax.devices()[0]
    num_sms = getattr(dev, "core_count", None) or 132
    timing_kw = dict(warmup=2, samples=samples, target_sample_ms=15.0)
    copy_bw = None if kernels_only else _measure_copy_bandwidth(timing_kw)
    print(f"device {dev.device_kind}, {num_sms} SMs" +
          ("" if copy_bw is None else f"; device copy {copy_bw / 1e12:.2f} TB/s (read + write)"), flush=True)
    cases = []
    for setting in settings:
        for model in models:
            try:
                c = _bench_case(model, setting, timing_kw, num_sms, fp8, kernels_only)
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                # A case too large for this card (deepseek-v4-pro's ep2 slice, 25 GB of bf16 weights, on an 80 GB
                # H100): recorded as such, and the others still run.
                c = {"model": model, "setting": setting, "error": _out_of_memory(e, dev)}
                cases.append(c)
                print(json.dumps(c), flush=True)
                continue
            if not kernels_only:  # the rooflines: the dense pair and the copy were timed
                dense = c["dense_same_flops"]["ms"]
                for label in ("kernel_all_sms", f"kernel_{REDUCED_SMS}_sms"):
                    k = c[label]
                    k["fraction_of_dense_rate"] = dense / k["ms"]
                    k["weight_bandwidth_bytes_per_s"] = c["weight_bytes"] / (k["ms"] * 1e-3)
                    k["fraction_of_copy_bandwidth"] = k["weight_bandwidth_bytes_per_s"] / copy_bw
                    k["fraction_of_hardware_md_copy"] = k["weight_bandwidth_bytes_per_s"] / HARDWARE_MD_COPY_BYTES_PER_S
                    k["fraction_of_nominal_hbm"] = k["weight_bandwidth_bytes_per_s"] / HBM_NOMINAL_BYTES_PER_S
            cases.append(c)
            print(json.dumps({kk: (vv if not isinstance(vv, dict) else {a: b for a, b in vv.items() if a != "timing"})
                              for kk, vv in c.items()}), flush=True)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": dev.device_kind, "num_sms": num_sms, "jax": jax.__version__,
            "library": native_status(), "tokens_per_gpu": TOKENS_PER_GPU, "copy_bandwidth_bytes_per_s": copy_bw,
            "hbm_nominal_bytes_per_s": HBM_NOMINAL_BYTES_PER_S, "cases": cases}


def _out_of_memory(e: Exception, dev) -> str:
    first = next((line for line in str(e).splitlines() if "RESOURCE_EXHAUSTED" in line), str(e).splitlines()[0])
    return f"out of memory on {dev.device_kind}: {first.strip()[:200]}"


def _skipped(result: dict) -> list[str]:
    return [f"- {c['setting']} {c['model']}: not timed, {c['error']}" for c in result["cases"] if "error" in c]


def _kernels_table(result: dict) -> str:
    lines = [f"grouped FFN kernels on {result['device']} ({result['num_sms']} SMs), {result['tokens_per_gpu']} "
             f"tokens/GPU, every SM; library: {result.get('library')}",
             "| setting | model | bf16 ms (TF/s) | fp8 ms (TF/s) | fp8 speedup | bf16 y crc32 | fp8 y crc32 |",
             "|" + " --- |" * 7]
    for c in (c for c in result["cases"] if "error" not in c):
        k, f8 = c["kernel_all_sms"], c.get("fp8_all_sms")
        fp8_cols = (f"{f8['ms']:.3f} ({f8['tflops']:.0f}) | {f8['speedup_over_bf16']:.2f}x" if f8 else "- | -")
        lines.append(f"| {c['setting']} | {c['model']} | {k['ms']:.3f} ({k['tflops']:.0f}) | {fp8_cols} | "
                     f"{k['y_crc32']} | {f8['y_crc32'] if f8 else '-'} |")
    return "\n".join(lines + _skipped(result))


def table(result: dict) -> str:
    timed = [c for c in result["cases"] if "error" not in c]
    if (timed and "dense_same_flops" not in timed[0]) or result.get("copy_bandwidth_bytes_per_s") is None:
        return _kernels_table(result)
    r = REDUCED_SMS
    copy = HARDWARE_MD_COPY_BYTES_PER_S
    lines = [f"grouped FFN on {result['device']} ({result['num_sms']} SMs), {result['tokens_per_gpu']} tokens/GPU; "
             f"in-run XLA elementwise (read + write) {result['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s",
             f"| setting | model | M | E | kernel all SMs ms (TF/s) | kernel {r} SMs ms (TF/s) | dense pair ms (TF/s) | "
             f"XLA einsum ms (TF/s) | all/dense | {r}/dense | weights TB/s (all / {r} SMs) | "
             f"% of {copy / 1e12:.2f} TB/s copy | % of 4.8 TB/s (all / {r} SMs) |",
             "|" + " --- |" * 13]
    for c in timed:
        k, k2 = c["kernel_all_sms"], c[f"kernel_{r}_sms"]
        d, e = c["dense_same_flops"], c["xla_batched_einsum"]
        lines.append(
            f"| {c['setting']} | {c['model']} | {c['rows']} | {c['experts']} | {k['ms']:.3f} ({k['tflops']:.0f}) | "
            f"{k2['ms']:.3f} ({k2['tflops']:.0f}) | {d['ms']:.3f} ({d['tflops']:.0f}) | {e['ms']:.3f} ({e['tflops']:.0f}) | "
            f"{k['fraction_of_dense_rate']:.0%} | {k2['fraction_of_dense_rate']:.0%} | "
            f"{k['weight_bandwidth_bytes_per_s'] / 1e12:.2f} / {k2['weight_bandwidth_bytes_per_s'] / 1e12:.2f} | "
            f"{k['weight_bandwidth_bytes_per_s'] / copy:.0%} | "
            f"{k['fraction_of_nominal_hbm']:.0%} / {k2['fraction_of_nominal_hbm']:.0%} |")
    fp8_cases = [c for c in timed if "fp8_all_sms" in c]
    if fp8_cases:
        lines += ["", "| setting | model | bf16 all SMs ms (TF/s) | fp8 all SMs ms (TF/s) | fp8 speedup | fp8 sane |",
                  "|" + " --- |" * 6]
        for c in fp8_cases:
            k, f8 = c["kernel_all_sms"], c["fp8_all_sms"]
            lines.append(f"| {c['setting']} | {c['model']} | {k['ms']:.3f} ({k['tflops']:.0f}) | "
                         f"{f8['ms']:.3f} ({f8['tflops']:.0f}) | {f8['speedup_over_bf16']:.2f}x | "
                         f"{f8['sane_output']} |")
    skipped = _skipped(result)
    return "\n".join(lines + ([""] + skipped if skipped else []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON here (and a .md table beside it)")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--settings", nargs="+", default=["ep64", "ep2"], choices=sorted(EP_DEGREE))
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--no-fp8", action="store_true", help="leave out the FP8 kernel")
    ap.add_argument("--kernels-only", action="store_true",
                    help="time only the bf16 and FP8 kernels with every SM, with a CRC of each output "
                         "(an A/B of two builds of the library)")
    args = ap.parse_args(argv)
    if why := kernels_unavailable():
        print(f"python -m mok_jax.bench.grouped_ffn: {why}", file=sys.stderr, flush=True)
        return 1
    result = run(args.models, args.settings, samples=args.samples, fp8=not args.no_fp8,
                 kernels_only=args.kernels_only)
    text = table(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
