"""mok-bench output: the terminal table, the JSON report (schema below) and the sweep plot.

JSON (``SCHEMA``): {
  "schema": "mok-bench/1", "created_utc": ISO time, "command": argv, "config": the parsed options,
  "cpu_numbers": true when measured on CPU, "notice": a sentence saying so (or null),
  "device": {"platform", "kind", "count", "used", "platform_version"},
  "versions": {"python", "jax", "jaxlib", "flax", "numpy", "mok_jax"},
  "git": {"commit", "dirty"}, "roofline": {"peak_tflops", "peak_tflops_fp8", "nvlink_gbps"} (null on CPU unless
  given: the H200's figures do not apply there; the floors and fractions of the results are null with them;
  peak_tflops_fp8 floors mok-fp8's forward routed GEMMs only, accounting.compute_floor_ms),
  "results": [one record per (model, tokens, pass, implementation, and for mok kernel setting), with exactly
              the keys RESULT_KEYS; status "ok" | "error" | "skipped" | "unsupported" (the implementation cannot
              run this pass, e.g. mok's backward), and error: why (or, with status "ok", a profile that failed);
              mok rows also carry "kernel" (the KernelConfig's fields), "kernel_source" (explicit | tuned |
              heuristic) and the memory per rank in bytes (fwd rows; accounting.mok_memory_per_rank); dtype is
              the routed experts' forward ("fp8" for mok-fp8, whose rows also carry bf16_median_ms and
              speedup_vs_bf16: the bf16 mok of the same model, tokens, pass and kernel, same process); every ok
              row carries dense_median_ms and x_dense (median / dense's median) when ``dense`` ran beside it],
  "unavailable_impls": {implementation: why} for defaults that cannot run here, "elapsed_s",
  "stopped": why the runs stopped early (a signal), or null,
  "tuned": with --tune: {"path", "entries" written or replaced, "incomplete" problems not written}, else absent
}
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform as _platform
import subprocess
import sys
from typing import Any, Iterable

from mok_jax.config import RENAMED_KERNEL_FIELDS

__all__ = [
    "RESULT_KEYS", "SCHEMA", "environment", "fill_dense_ratios", "fill_fp8_ratios", "fmt", "format_bytes", "format_markdown",
    "format_memory",
    "format_table", "git_info", "kernel_label", "load_results", "plot_sweep", "write_json",
]

SCHEMA = "mok-bench/1"

# Every result record has exactly these keys (None where a figure does not apply or a run failed).
RESULT_KEYS = (
    # what ran
    "model", "ep_mode", "num_gpus", "experts_per_gpu", "total_experts", "top_k", "hidden_size",
    "intermediate_size", "shared_size", "tokens_per_gpu", "pass", "dtype", "routing", "zipf_s", "seed", "impl",
    "status", "error",
    # time (ms per call, device-synchronised; first_call_s includes compilation)
    "median_ms", "min_ms", "max_ms", "samples", "calls_per_sample", "warmup", "first_call_s",
    # compute
    "flops_per_gpu", "tflops", "compute_floor_ms", "compute_fraction", "executed_flops_per_gpu",
    "padding_overhead", "load_imbalance",
    # communication (per GPU, one dispatch; comm floors count every transfer of the pass)
    "dispatch_bytes_per_gpu", "remote_dispatch_bytes_per_gpu_uniform", "remote_dispatch_bytes_per_gpu",
    "unique_remote_dispatch_bytes_per_gpu", "comm_floor_ms", "comm_fraction", "comm_floor_unique_ms",
    "comm_fraction_unique",
    # against the baseline measured in the same process
    "baseline", "baseline_median_ms", "speedup_vs_baseline",
    # against ``dense`` (the layer's FLOPs as one dense FFN) of the same model, tokens and pass, same process
    "dense_median_ms", "x_dense",
    # capacity baseline
    "capacity", "dropped_slots", "dropped_fraction",
    # the megakernel (mok rows): its KernelConfig, where that came from, and its memory per rank in bytes
    "kernel", "kernel_source", "workspace_bytes_per_rank", "scratch_bytes_per_rank", "backward_scratch_bytes_per_rank",
    "residual_bytes_per_rank", "fp8_weight_bytes_per_rank",
    # the FP8 layer (mok-fp8 rows, --dtype fp8) against the bf16 mok measured in the same process
    "bf16_median_ms", "speedup_vs_bf16",
)


def git_info() -> dict[str, Any]:
    """Commit of the source tree (or $MOK_GIT_COMMIT where there is no git checkout) and whether it is dirty."""
    root = pathlib.Path(__file__).resolve().parents[2]
    info: dict[str, Any] = {"commit": os.environ.get("MOK_GIT_COMMIT") or "unknown", "dirty": None}
    try:
        run = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, timeout=10)
        head = run("rev-parse", "HEAD")
        if head.returncode == 0:
            info["commit"] = head.stdout.strip()
            info["dirty"] = bool(run("status", "--porcelain", "--untracked-files=no").stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def environment(devices: list, used: int) -> dict[str, Any]:
    """The "device" and "versions" sections."""
    import jax
    import jaxlib
    import numpy

    import mok_jax

    versions = {"python": _platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                "numpy": numpy.__version__, "mok_jax": mok_jax.__version__}
    try:
        import flax

        versions["flax"] = flax.__version__
    except ImportError:
        versions["flax"] = None
    d0 = devices[0]
    try:
        platform_version = jax.extend.backend.get_backend(d0.platform).platform_version
    except Exception:  # noqa: BLE001 - informative only
        platform_version = None
    device = {"platform": d0.platform, "kind": d0.device_kind, "count": len(devices), "used": used,
              "platform_version": platform_version, "host": _platform.node()}
    return {"device": device, "versions": versions}


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def _finite(o):
    """NaN and infinities (not JSON) become null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def write_json(path: str | os.PathLike, report: dict) -> None:
    """Write ``report`` atomically (a reader never sees half a file; rewritten after every run)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_finite(report), indent=1, default=_json_default, allow_nan=False) + "\n")
    tmp.replace(path)


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def fmt(v, spec: str, none: str = "-") -> str:
    """format(v, spec), but with 3 significant digits where ``spec`` would show fewer (CPU-sized figures)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    if v and abs(v) < 10.0 ** (1 - int(spec[1:-1] or 0)):
        return format(v, ".3g")
    return format(v, spec)


def _pair_key(r: dict) -> tuple:
    kernel = tuple(sorted((r.get("kernel") or {}).items()))
    return r["model"], r["ep_mode"], r["tokens_per_gpu"], r["pass"], kernel


def fill_fp8_ratios(results: list[dict], *, fp8_impl: str, reference: str) -> None:
    """Give each ok ``fp8_impl`` row bf16_median_ms and speedup_vs_bf16 from the ok ``reference`` row of the same
    model, mode, tokens, pass and kernel (in place; rows without such a twin are left as they are)."""
    bf16 = {_pair_key(r): r["median_ms"] for r in results if r["impl"] == reference and r["status"] == "ok"}
    for r in results:
        if r["impl"] == fp8_impl and r["status"] == "ok" and _pair_key(r) in bf16:
            r["bf16_median_ms"] = bf16[_pair_key(r)]
            r["speedup_vs_bf16"] = r["bf16_median_ms"] / r["median_ms"]


def fill_dense_ratios(results: list[dict], *, dense: str) -> None:
    """Give each ok row dense_median_ms and x_dense (its median over that of the ok ``dense`` row of the same
    model, mode, tokens and pass; the dense row itself 1.0), in place; rows without such a dense row keep None."""
    key = lambda r: (r["model"], r["ep_mode"], r["tokens_per_gpu"], r["pass"])
    dense_ms = {key(r): r["median_ms"] for r in results if r["impl"] == dense and r["status"] == "ok"}
    for r in results:
        if r["status"] == "ok" and key(r) in dense_ms:
            r["dense_median_ms"] = dense_ms[key(r)]
            r["x_dense"] = r["median_ms"] / r["dense_median_ms"]


def _has_dense(results: list[dict]) -> bool:
    return any(r.get("x_dense") is not None for r in results)


def _has_fp8(results: list[dict]) -> bool:
    return any(r.get("dtype") == "fp8" for r in results)


def _ratio(v) -> str:
    return fmt(v, ".2f") + "x" if v else "-"


def _note(r: dict) -> str:
    if r["status"] != "ok":
        msg = (r.get("error") or "").splitlines()[0] if r.get("error") else ""
        return f"{r['status']}: {msg[:70]}"
    notes = []
    if r.get("dropped_slots") is not None:
        notes.append(f"dropped {r['dropped_fraction'] * 100:.1f}%")
    if r.get("padding_overhead") and r["padding_overhead"] > 1.0001:
        notes.append(f"pads {r['padding_overhead']:.2f}x")
    return ", ".join(notes)


def kernel_label(r: dict, varying: Iterable[str] = ()) -> str:
    """A mok row's kernel in a few characters: "g=2048", plus the ``varying`` other knobs ("-" for other rows)."""
    k = r.get("kernel")
    if not k:
        return "-"
    short = {"comm_items_fwd": "items", "ring_slots": "ring", "dispatch": "disp", "combine": "comb"}
    return " ".join([f"g={k['granularity']}"] + [f"{short.get(n, n)}={k[n]}" for n in varying])


def _varying_knobs(results: list[dict]) -> list[str]:
    """The knobs besides granularity that differ between the mok rows (shown next to it)."""
    kernels = [r["kernel"] for r in results if r.get("kernel")]
    return [n for n in ("comm_items_fwd", "ring_slots", "dispatch", "combine") if len({k[n] for k in kernels}) > 1]


def _rooflines(results: list[dict]) -> tuple[bool, bool]:
    """(any record has a compute floor, any has a communication floor): a CPU run has neither, and its table
    shows no roofline columns."""
    return (any(r.get("compute_floor_ms") is not None for r in results),
            any(r.get("comm_floor_ms") is not None for r in results))


def format_table(results: Iterable[dict]) -> str:
    """Aligned text table, one row per result (a "kernel" column when mok rows are present; the roofline columns
    only when the records have rooflines, i.e. not for a CPU run)."""
    results = list(results)
    with_kernel = any(r.get("kernel") for r in results)
    with_peak, with_comm = _rooflines(results)
    varying = _varying_knobs(results)
    percent = lambda v: fmt(v and v * 100, ".1f")
    columns = [  # (heading, cell of one record, numeric); a cell None means "-" for a run that is not ok
        ("model", lambda r: r["model"], False), ("mode", lambda r: r["ep_mode"], False),
        ("T/GPU", lambda r: str(r["tokens_per_gpu"]), True), ("pass", lambda r: r["pass"], False),
        ("impl", lambda r: r["impl"], False)]
    if with_kernel:
        columns.append(("kernel", lambda r: kernel_label(r, varying), False))
    columns += [("median ms", lambda r: fmt(r["median_ms"], ".3f"), True),
                ("min..max ms", lambda r: f"{r['min_ms']:.3f}..{r['max_ms']:.3f}", True),
                ("TFLOP/s", lambda r: fmt(r["tflops"], ".1f"), True)]
    if with_peak:
        columns.append(("%peak", lambda r: percent(r["compute_fraction"]), True))
    if with_comm:
        columns += [("comm ms", lambda r: fmt(r["comm_floor_ms"], ".3f"), True),
                    ("%comm", lambda r: percent(r["comm_fraction"]), True)]
    columns.append(("vs base", lambda r: _ratio(r["speedup_vs_baseline"]), True))
    if _has_dense(results):
        columns.append(("x dense", lambda r: _ratio(r.get("x_dense")), True))
    if _has_fp8(results):
        columns.append(("vs bf16", lambda r: _ratio(r.get("speedup_vs_bf16")), True))
    columns.append(("note", _note, False))
    always = {"model", "mode", "T/GPU", "pass", "impl", "kernel", "comm ms", "note"}  # known before a run
    rows = [[cell(r) if r["status"] == "ok" or head in always else "-" for head, cell, _ in columns]
            for r in results]
    widths = [max(len(head), *(len(row[i]) for row in rows)) if rows else len(head)
              for i, (head, _, _) in enumerate(columns)]
    line = lambda cells: "  ".join(c.rjust(w) if numeric else c.ljust(w)
                                   for c, w, (_, _, numeric) in zip(cells, widths, columns)).rstrip()
    out = [line([head for head, _, _ in columns]), line(["-" * w for w in widths])] + [line(row) for row in rows]
    foot = []
    if with_peak:
        foot.append("%peak: the compute floor over the median (TFLOP/s over the bf16 roofline" +
                    ("; fp8 rows: the forward's routed GEMMs at the FP8 peak, the rest at bf16's)" if _has_fp8(results)
                     else ")"))
    if with_comm:
        foot.append("comm ms: dispatch+combine floor at the NVLink bandwidth (busiest GPU); %comm: that floor over "
                    "the median")
    foot.append("vs base: baseline median / this median" +
                ("; x dense: this median / dense's (the layer's FLOPs as one dense FFN)" if _has_dense(results)
                 else "") +
                ("; vs bf16: the bf16 mok's median (same kernel) / this median." if _has_fp8(results) else "."))
    out.append("; ".join(foot))
    return "\n".join(out)


def format_markdown(results: Iterable[dict], *, peak_tflops: float | None = None) -> str:
    """A short markdown table (for the README): one row per result (mok rows name their kernel; the roofline
    columns only when the records have rooflines, i.e. not for a CPU run)."""
    results = list(results)
    varying = _varying_knobs(results)
    with_peak, with_comm = _rooflines(results)
    head = ["model", "mode", "T/GPU", "pass", "impl", "median ms", "TFLOP/s"]
    fp8 = _has_fp8(results)
    head += [f"% of {peak_tflops:g}" if peak_tflops and not fp8 else "% of roofline"] if with_peak else []
    head += ["comm floor ms"] if with_comm else []
    dense = _has_dense(results)
    head += ["vs baseline"] + (["x dense"] if dense else []) + (["vs bf16 mok"] if fp8 else []) + ["note"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 5 + ["--:"] * (len(head) - 6) + ["---"]) + "|"]
    for r in results:
        ok = r["status"] == "ok"
        impl = f"`{r['impl']}`" + (f" ({kernel_label(r, varying)})" if r.get("kernel") else "")
        cells = [r["model"], r["ep_mode"], str(r["tokens_per_gpu"]), r["pass"], impl,
                 fmt(r["median_ms"], ".3f") if ok else "-", fmt(r["tflops"], ".1f") if ok else "-"]
        if with_peak:
            cells.append(fmt(r["compute_fraction"] and r["compute_fraction"] * 100, ".1f") if ok else "-")
        if with_comm:
            cells.append(fmt(r["comm_floor_ms"], ".3f"))
        cells.append((fmt(r["speedup_vs_baseline"], ".2f") + f"x {r['baseline']}")
                     if ok and r["speedup_vs_baseline"] else "-")
        if dense:
            cells.append(_ratio(r.get("x_dense")) if ok else "-")
        if fp8:
            cells.append(_ratio(r.get("speedup_vs_bf16")) if ok else "-")
        cells.append(_note(r).replace("|", "/"))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def format_bytes(n: int | None) -> str:
    """A byte count in B, kB, MB or GB (decimal), '?' for None."""
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


_KEPT = {  # what each mok implementation's residuals are
    "mok": "the forward's bf16 g, u of the rows a balanced routing fills, per layer",
    "mok-recompute": "the forward keeps only its inputs",
    "mok-ring": "the forward's bf16 g, u of the ring's tokens, per layer",
    "mok-keep": "the forward's bf16 g, u, per layer",
    "mok-fp8": "the forward keeps only its inputs",
}


def _bytes_over_settings(rs: list[dict], key: str) -> str:
    """``key``'s bytes in the mok rows ``rs`` of one problem: one figure, or the range over their kernel settings (the
    ring, ring_slots x one microbatch, sets the forward's scratch; with keep="ring" the settings also decide whether
    the backward takes the kept g, u as its own scratch)."""
    values = {r.get(key) for r in rs}
    if len(values) == 1:
        return format_bytes(next(iter(values)))
    known = sorted(v for v in values if v is not None)
    return f"{format_bytes(known[0])}..{format_bytes(known[-1])} over {len(rs)} kernel settings" if known else "?"


def format_memory(results: Iterable[dict]) -> str:
    """One line per (model, tokens) of a mok layer's device memory per rank (from the mok fwd rows)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if r["impl"] in _KEPT and r.get("workspace_bytes_per_rank") is not None:
            groups.setdefault((r["model"], r["ep_mode"], r["tokens_per_gpu"], r["impl"]), []).append(r)
    lines = []
    for (model, mode, tokens, impl), rs in groups.items():
        workspace = format_bytes(rs[0]["workspace_bytes_per_rank"])
        kept = _KEPT[impl]
        fp8 = rs[0].get("fp8_weight_bytes_per_rank")
        fp8_txt = "" if fp8 is None else f", E4M3 weights {format_bytes(fp8)} (beside the bf16 ones, per layer)"
        scratch = _bytes_over_settings(rs, "scratch_bytes_per_rank")
        backward = _bytes_over_settings(rs, "backward_scratch_bytes_per_rank")
        lines.append(f"{impl} memory per rank, {model} {mode} T={tokens}: workspace {workspace} (symmetric, per "
                     f"layer), scratch {scratch} (per call), backward scratch {backward} (per call), residuals "
                     f"{format_bytes(rs[0]['residual_bytes_per_rank'])} ({kept}){fp8_txt}")
    return "\n".join(lines)


def load_results(paths: Iterable[str | os.PathLike]) -> tuple[list[dict], list[dict]]:
    """(results, reports) from mok-bench JSON files, results concatenated in file order, each result's kernel knobs
    under today's names (mok_jax.config.RENAMED_KERNEL_FIELDS)."""
    reports = []
    for p in paths:
        rep = json.loads(pathlib.Path(p).read_text())
        if rep.get("schema") != SCHEMA:
            raise ValueError(f"{p}: not a {SCHEMA} report (schema {rep.get('schema')!r})")
        reports.append(rep)
    results = [r for rep in reports for r in rep["results"]]
    for r in results:  # a file written before issue 35 names two knobs comm_sms_fwd, comm_sms_bwd
        if isinstance(r.get("kernel"), dict):
            r["kernel"] = {RENAMED_KERNEL_FIELDS.get(n, n): v for n, v in r["kernel"].items()}
    return results, reports


def plot_sweep(path: str | os.PathLike, results: Iterable[dict], *, peak_tflops: float | None = None,
               fp8_peak_tflops: float | None = None, title: str | None = None) -> pathlib.Path:
    """Time and TFLOP/s against tokens per GPU, one line per implementation (and model / pass when several);
    ``fp8_peak_tflops``: a second roofline line, the FP8 dense peak (of mok-fp8's forward routed GEMMs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ok = [r for r in results if r["status"] == "ok"]
    keys = ("model", "ep_mode", "pass", "impl")
    varying = [k for k in keys[:-1] if len({r[k] for r in ok}) > 1]
    # one line per granularity when a --granularity sweep ran several (resolved kernels may differ per token
    # count: those rows stay one line)
    explicit = lambda r: r.get("kernel") and r.get("kernel_source") == "explicit"
    several = len({r["kernel"]["granularity"] for r in ok if explicit(r)}) > 1
    series: dict[tuple, list[dict]] = {}
    for r in ok:
        impl = f"{r['impl']} {kernel_label(r)}" if several and explicit(r) else r["impl"]
        series.setdefault((r["model"], r["ep_mode"], r["pass"], impl), []).append(r)
    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(12, 4.6))
    # one colour per implementation (per model too when several), dashed for fwd+bwd
    colour_keys = list(dict.fromkeys((k[0], k[3]) for k in sorted(series)))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for key, rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["tokens_per_gpu"])
        label = " ".join([key[-1]] + [str(key[keys.index(k)]) for k in varying])
        tokens = [r["tokens_per_gpu"] for r in rs]
        style = dict(linestyle="--" if key[2] == "fwd+bwd" else "-", marker="o", label=label,
                     color=colours[colour_keys.index((key[0], key[3])) % len(colours)])
        ax_t.plot(tokens, [r["median_ms"] for r in rs], **style)
        ax_f.plot(tokens, [r["tflops"] for r in rs], **style)
    all_tokens = sorted({r["tokens_per_gpu"] for r in ok})
    for ax in (ax_t, ax_f):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_tokens, [str(t) for t in all_tokens])
        ax.minorticks_off()
        ax.set_xlabel("tokens per GPU")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax_t.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax_t.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_t.legend(fontsize=8)
    ax_t.set_ylabel("time per call (ms, median)")
    ax_f.set_ylabel("TFLOP/s per GPU (useful FLOPs)")
    if peak_tflops:
        ax_f.axhline(peak_tflops, color="gray", linestyle=":", label=f"roofline {peak_tflops:g}")
    if fp8_peak_tflops:
        ax_f.axhline(fp8_peak_tflops, color="gray", linestyle="-.", label=f"fp8 dense peak {fp8_peak_tflops:g}")
    ax_f.set_ylim(bottom=0)
    ax_f.legend(fontsize=8)
    if ok:
        r0 = ok[0]
        default = f"{r0['model']} ({r0['ep_mode']}, {r0['num_gpus']} device(s), {r0['dtype']}, {r0['routing']} routing)"
        fig.suptitle(title or default)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def eprint(*a) -> None:
    print(*a, file=sys.stderr, flush=True)
