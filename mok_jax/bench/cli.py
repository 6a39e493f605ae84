"""mok-bench: how fast the MoE layer runs here, against what a JAX user would write instead.

For every (model, tokens per GPU, pass, implementation): warm up, time many calls with device
synchronisation (``mok_jax.bench.timing.time_fn``), and report median/min/max, TFLOP/s, the fraction
of the compute roofline and of the NVLink communication floor (the H200's figures, on GPU only: a CPU
run reports neither unless --peak-tflops / --nvlink-gbps give them), and the ratio to a baseline
measured in the same process (accounting: ``mok_jax.bench.accounting``; implementations:
``mok_jax.bench.baselines``). Writes a table, and on request a JSON report, a plot and a profile.
``mok`` rows run the KernelConfig the knob options give (else the one mok_jax.tuning resolves) and record
it with their memory; ``--tune`` times mok over a grid of knobs and writes the device's tuned table
(``mok_jax.bench.tune``).

The baselines are in their strongest form: bf16 GEMM outputs (f32 accumulation inside the GEMM) and so bf16
cotangents in the backward (``mok_jax.bench.baselines``, "Precision"; the f32-output form of earlier sessions is
gone, its numbers are in git history). ``tokamax`` (tokamax.ragged_dot on its Mosaic GPU kernel, the extra
``mok_jax[tokamax]``) runs where it is installed and is dropped with the reason elsewhere. ``dense`` is the
layer's FLOPs as one dense SwiGLU FFN per device over T k (+ T shared) rows with one weight pair
(``mok_jax.bench.dense``; its own inputs, each device its own problem in one program): the practical limit on
this card, run right after the baseline, and every row's ``x dense`` is its median over dense's (same model,
tokens and pass). On a GPU, dense and tokamax are among the defaults; on CPU dense is (cheap at ci's shape).

The model argument ``bench`` is the standard set (``mok_jax.bench.problems``): kimi-k2, glm-5,
qwen3.5-397b-a17b and deepseek-v4-pro at 2048 tokens per GPU (E/32 experts on one GPU), and qwen3-30b-a3b at 8192
tokens with 16 experts per GPU, each model on a GPU at its own standard problem unless --tokens,
--experts-per-gpu or --ep-mode say otherwise.

``--dtype fp8`` also times ``mok-fp8``, the layer with FP8 routed experts (MoEConfig(precision="fp8")), right
after the bf16 ``mok`` (added when --impl lacks it) in the same process, with the same inputs and kernel knobs;
its row carries the ratio to that mok ("vs bf16"). Inputs, weights and the other implementations stay bf16. Its
forward takes the E4M3 weights quantised once outside the timed call (as a user quantises once per optimizer
step); its fwd+bwd quantises them inside the step, so that cost is timed. Its compute floor counts the forward's
routed GEMMs at the FP8 dense peak and the rest (shared expert, backward) at the bf16 peak
(``accounting.compute_floor_ms``), and its communication floor its E4M3 dispatch rows.

``--project`` runs nothing: it prints the per-rank time at EP 8 to 72 projected from the committed results
(``mok_jax.bench.project``, docs/projection.md).

Exit status (``main``): 0 when at least one run succeeded and none failed; 1 when a run failed or none ran; 2, with
one line saying why and before anything runs, on a bad option, a model or TOML that cannot be read, a --plot
format that cannot be written, a problem whose inputs, outputs and weights alone exceed a device's memory, or an
implementation named with --impl that cannot run here (``ragged`` and ``tokamax`` at EP > 1 on CPU: XLA:CPU has no
ragged-all-to-all). The code: options (the command line), runner (what runs, and the run), steps (inputs and
timed steps), records (a result's figures), report (the table, JSON and plot), and this entry.
"""

from __future__ import annotations

import os
import sys

from mok_jax.bench.options import (CPU_DEFAULTS, CPU_NOTICE, GPU_DEFAULTS, IMPLEMENTATIONS, MOK_IMPLS,
                                   PEAK_TFLOPS, BenchOptions, UsageError, build_parser, implementations,
                                   kernel_settings, parse_args, parse_experts_per_gpu, parse_tokens)
from mok_jax.bench.report import eprint
from mok_jax.bench.runner import Unavailable, run
from mok_jax.bench.timing import warn_if_untuned_xla

# the public names of options and runner, importable from here as before the split
__all__ = ["CPU_DEFAULTS", "CPU_NOTICE", "GPU_DEFAULTS", "IMPLEMENTATIONS", "MOK_IMPLS", "PEAK_TFLOPS", "BenchOptions",
           "Unavailable", "UsageError", "build_parser", "implementations", "kernel_settings", "main", "parse_args",
           "parse_experts_per_gpu", "parse_tokens", "run"]

CPU_DEVICES = 8  # host devices the CLI asks for on a CPU-only machine (unless XLA_FLAGS sets a count)


def _ask_for_cpu_devices() -> None:
    """On a CPU-only machine, run EP over CPU_DEVICES host devices (unless XLA_FLAGS already sets a count)."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
    except RuntimeError:  # backends already initialised (mok-bench called in-process): keep what exists
        pass


def _from_json(opts: BenchOptions) -> int:
    """Print (and plot) saved reports without running anything."""
    from mok_jax.bench import report as rep

    results, reports = rep.load_results(opts.from_json)
    cpu = any(r.get("cpu_numbers") for r in reports)
    peak = reports[0]["roofline"]["peak_tflops"] if reports else None
    if cpu:
        print(next(r.get("notice") for r in reports if r.get("cpu_numbers")) or CPU_NOTICE, flush=True)
    if opts.markdown:
        print(rep.format_markdown(results, peak_tflops=peak), flush=True)
    else:
        print(rep.format_table(results), flush=True)
    if opts.plot:
        dev = reports[0]["device"] if reports else {}
        models = ",".join(dict.fromkeys(r["model"] for r in results))
        r0 = results[0] if results else {}
        title = (f"{models} ({r0.get('ep_mode')}, {r0.get('dtype')}, {r0.get('routing')} routing) on "
                 f"{dev.get('kind')} x{dev.get('used')}")
        fp8_peak = None if cpu or not any(r.get("dtype") == "fp8" for r in results) else (
            reports[0]["roofline"].get("peak_tflops_fp8"))
        path = rep.plot_sweep(opts.plot, results, peak_tflops=None if cpu else peak, fp8_peak_tflops=fp8_peak,
                              title=title)
        eprint(f"mok-bench: plot written to {path}")
    return 0 if results else 1


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Returns 0 when at least one run succeeded and none failed (skipped and unsupported
    runs are not failures: --time-budget, a signal, a pass an implementation lacks), 1 when a run failed or none ran,
    2 on bad options or an implementation asked for by name that cannot run here (one line saying why)."""
    try:
        opts = parse_args(argv)
        if opts is None:
            return 0
        if opts.from_json:
            return _from_json(opts)
        if opts.project:  # no run: a projection from the committed results (mok_jax.bench.project)
            from mok_jax.bench import project_report

            return project_report.main(opts)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent GPU machines
        warn_if_untuned_xla("mok-bench")
        _ask_for_cpu_devices()
        report = run(opts, argv=["mok-bench", *(sys.argv[1:] if argv is None else argv)])
    except (ValueError, NotImplementedError, Unavailable) as e:
        eprint(f"mok-bench: error: {e}")
        return 2
    statuses = {r["status"] for r in report["results"]}
    return 0 if "ok" in statuses and "error" not in statuses else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
