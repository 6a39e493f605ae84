"""mok-bench's runs: the plan of (model, pass, tokens, implementation, kernel setting), which implementations can
run here, and ``run``, which times each and writes the table, the JSON report, the plot and the tuned table."""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from typing import Any

from mok_jax.bench import accounting as acc
from mok_jax.bench.options import (CPU_DEFAULTS, CPU_NOTICE, DENSE, FP8_IMPL, FP8_REFERENCE, GPU_DEFAULTS,
                                   MOK_IMPLS, NVLINK_GBPS, ONE_GPU_EXPERTS, PEAK_TFLOPS, BenchOptions, UsageError,
                                   implementations, kernel_settings)
from mok_jax.bench.problems import STANDARD_PROBLEMS, STANDARD_SET, standard_models
from mok_jax.bench.records import error_text, new_record, reference_gb
from mok_jax.bench.report import eprint, format_bytes
from mok_jax.bench.steps import RunArrays, measure, routing_and_traffic, write_profile

__all__ = ["Unavailable", "run"]

RAGGED_COLLECTIVE_IMPLS = ("ragged", "tokamax")  # at EP > 1 they dispatch with lax.ragged_all_to_all


def _resolve_models(names: tuple[str, ...]):
    """The ModelShapes of the model argument's names ('bench': the models of the standard problems); a name or TOML
    path that cannot be read is a UsageError naming it, in one line."""
    from mok_jax.config import load_model

    out = []
    for name in names:
        for n in (standard_models() if name == STANDARD_SET else [name]):
            try:
                out.append(load_model(n))
            except (OSError, ValueError, TypeError, KeyError) as e:  # no such file, bad TOML, missing/extra fields
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise UsageError(f"model {n!r}: {reason}") from None
    return out


def _problem(model, opts: BenchOptions, on_gpu: bool, num_gpus: int, ep_mode: str,
             defaults: dict) -> tuple[acc.BenchShape, tuple[int, ...]]:
    """(the BenchShape, the tokens per GPU) that ``model`` runs here: on a GPU its standard problem
    (mok_jax.bench.problems; a model without one: the defaults' tokens, and on one GPU ONE_GPU_EXPERTS experts),
    each part of which --tokens, --experts-per-gpu and --ep-mode override; on CPU the CPU defaults."""
    standard = STANDARD_PROBLEMS.get(model.name) if on_gpu else None
    tokens = opts.tokens or ((standard.tokens_per_gpu,) if standard else (defaults["tokens"],))
    experts = opts.experts_per_gpu
    if experts is None and on_gpu and not opts.ep_mode:
        experts = standard.experts_per_gpu(num_gpus) if standard else ONE_GPU_EXPERTS if num_gpus == 1 else None
    return acc.bench_shape(model, num_gpus, ep_mode, experts_per_gpu=experts), tokens


class Unavailable(RuntimeError):
    """An implementation asked for by name cannot run here (main() prints it and returns 2)."""


class _Interrupted(Exception):
    pass


def _raise_interrupted(signum, frame):
    raise _Interrupted(f"stopped by signal {signum}")


def _dtype_text(dtype: str) -> str:
    return f"bf16, {FP8_IMPL} with FP8 routed experts" if dtype == "fp8" else dtype


def _on_gpu(devices) -> bool:
    return devices[0].platform == "gpu"


def _gpu_kind() -> str | None:
    """The device kind mok_jax.moe resolves kernels for (the first GPU's), None without a GPU."""
    import jax

    return next((d.device_kind for d in jax.devices() if d.platform == "gpu"), None)


def _availability(impl: str, mesh, shape: acc.BenchShape, tokens: int, dtype, kernel=None) -> str | None:
    """None when ``impl`` can run here, else why not (traced with abstract inputs: no device work)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mok_jax.bench import baselines
    from mok_jax.weights import MoEWeights

    platform = mesh.devices.flat[0].platform
    if impl in RAGGED_COLLECTIVE_IMPLS and platform == "cpu" and mesh.size > 1:
        return (f"XLA:CPU has no ragged-all-to-all, which {impl} dispatches with at EP > 1; on CPU it runs at "
                f"--devices 1, where it needs no collective")
    if impl not in (*MOK_IMPLS, "reference", "tokamax"):
        return None
    try:
        fn = baselines.build(impl, mesh, kernel=kernel)
        n, E, H, I, Is, k = (shape.num_gpus * tokens, shape.total_experts, shape.hidden_size,
                             shape.intermediate_size, shape.shared_size, shape.top_k)
        tok, rep = NamedSharding(mesh, P("ep")), NamedSharding(mesh, P())
        sds = lambda s, dt, sh: jax.ShapeDtypeStruct(s, dt, sharding=sh)
        W = MoEWeights(sds((E, H, 2 * I), dtype, tok), sds((E, I, H), dtype, tok),
                       sds((H, 2 * Is), dtype, rep) if Is else None, sds((Is, H), dtype, rep) if Is else None)
        jax.eval_shape(fn, sds((n, H), dtype, tok), sds((n, k), jnp.int32, tok), sds((n, k), jnp.float32, tok), W)
    except Exception as e:  # noqa: BLE001 - the reason is the message
        return error_text(e)
    return None


def _device_memory(devices) -> tuple[int, str]:
    """(bytes of memory one of ``devices`` has, where that figure comes from): XLA's allocator limit on a GPU; the
    host's memory shared among the devices on CPU (its host devices all live in the one host's memory)."""
    import os

    stats = devices[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"XLA's limit on {devices[0].device_kind}"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // len(devices), f"the host's {format_bytes(host)} shared by {len(devices)} host devices"


def _check_memory(problems, passes, devices) -> None:
    """A problem that cannot fit is refused before anything runs: UsageError when the lower bound of what any
    implementation holds (accounting.min_bytes_per_gpu) exceeds one device's memory."""
    memory, source = _device_memory(devices)
    for shape, tokens_list in problems:
        for tokens in tokens_list:
            need, pass_ = max((acc.min_bytes_per_gpu(shape, tokens, p), p) for p in passes)
            if need > memory:
                held = "inputs, outputs and weights" + ("" if pass_ == "fwd" else " and their gradients")
                raise UsageError(f"--tokens {tokens}: {shape.model} {pass_} needs at least {format_bytes(need)} "
                                 f"per device (its {held}), more than the {format_bytes(memory)} of a device here "
                                 f"({source})")


def _runnable(opts: BenchOptions, defaults: dict, mesh, shape: acc.BenchShape, tokens: int,
              gpu_kind: str | None) -> tuple[list[str], str, dict[str, str]]:
    """(the implementations that can run here, the baseline first; the baseline; {dropped: why}). One asked for by
    name that cannot run raises Unavailable."""
    import jax.numpy as jnp

    from mok_jax.bench import tune

    impls, asked = implementations(opts, defaults)
    dropped = {}
    for impl in list(impls):
        kernel = None
        if impl in MOK_IMPLS:
            knobs = kernel_settings(opts, tokens)[0]
            kernel = tune.resolve_kernel(tune.problem_key(shape, tokens), knobs, gpu_kind)[0]
        why = _availability(impl, mesh, shape, tokens, jnp.bfloat16, kernel)
        if why is None:
            continue
        if impl in asked:  # asked for by name: say why it cannot run, in one line, and stop
            raise Unavailable(f"implementation {impl!r} is not available here: {why.splitlines()[0]}")
        impls.remove(impl)
        dropped[impl] = why
    if not impls:
        raise Unavailable(f"no implementation can run here: {dropped}")
    baseline = opts.baseline or ("xla" if "xla" in impls else impls[0])
    if baseline not in impls:
        impls.insert(0, baseline)
    impls.sort(key=lambda i: (i != baseline, i != DENSE))  # the baseline, then dense: every ratio's denominator first
    return impls, baseline, dropped


def run(opts: BenchOptions, argv: list[str] | None = None) -> dict:
    """Run every configuration of ``opts``; print the table; write JSON / plot / profile as asked.
    Returns the report (the JSON's content)."""
    import jax
    from jax.sharding import AxisType

    from mok_jax.bench import baselines, report as rep, tune

    t_start = time.perf_counter()
    devices = jax.devices()
    on_gpu = _on_gpu(devices)
    if opts.tune and not on_gpu:
        raise Unavailable(f"--tune needs a GPU (it times the mok megakernel); this machine has only "
                          f"{devices[0].platform} devices")
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    n = opts.devices or len(devices)
    if n > len(devices):
        raise UsageError(f"--devices {n}: only {len(devices)} {devices[0].platform} device(s) here")
    models = _resolve_models(opts.models or (defaults["model"],))
    ep_mode = opts.ep_mode or defaults["ep_mode"]
    # the H200's rooflines on GPU; on CPU only what the command line gives (none by default)
    peaks = {"bf16": opts.peak_tflops or (PEAK_TFLOPS["bf16"] if on_gpu else None),
             "fp8": opts.peak_tflops_fp8 or (PEAK_TFLOPS["fp8"] if on_gpu else None)}
    peak = peaks["bf16"]
    nvlink = opts.nvlink_gbps or (NVLINK_GBPS if on_gpu else None)
    dtype = jax.numpy.bfloat16  # inputs and weights, for either --dtype (fp8 is mok-fp8's math inside the layer)
    mesh = jax.make_mesh((n,), ("ep",), devices=devices[:n], axis_types=(AxisType.Explicit,))
    problems = [_problem(m, opts, on_gpu, n, ep_mode, defaults) for m in models]  # ValueError: rc 2 in main()
    _check_memory(problems, opts.passes, devices[:n])
    gpu_kind = _gpu_kind()

    first_shape, first_tokens = problems[0]
    impls, baseline, dropped_impls = _runnable(opts, defaults, mesh, first_shape, first_tokens[0], gpu_kind)

    config = dataclasses.asdict(opts)
    config.update(models=[m.name for m in models], tokens=list(dict.fromkeys(t for _, ts in problems for t in ts)),
                  problems={s.model: {"tokens": list(ts), "ep_mode": s.ep_mode, "experts_per_gpu": s.experts_per_gpu}
                            for s, ts in problems},
                  ep_mode=ep_mode, impls=impls, baseline=baseline, peak_tflops=peak, peak_tflops_fp8=peaks["fp8"],
                  nvlink_gbps=nvlink, devices=n, passes=list(opts.passes))
    report = {"schema": rep.SCHEMA, "created_utc": rep.now_utc(), "command": argv or ["mok-bench"], "config": config,
              "cpu_numbers": not on_gpu, "notice": None if on_gpu else CPU_NOTICE,
              **rep.environment(devices, n), "git": rep.git_info(),
              "roofline": {"peak_tflops": peak, "peak_tflops_fp8": peaks["fp8"], "nvlink_gbps": nvlink},
              "unavailable_impls": dropped_impls, "results": []}
    results = report["results"]
    # pass-major, so a sweep cut short by --time-budget still has whole curves for the first pass; mok once per
    # kernel setting (--granularity list, --tune grid), the others once
    plan = [(s, p, t, i, knobs) for s, ts in problems for p in opts.passes for t in ts for i in impls
            for knobs in (kernel_settings(opts, t) if i in MOK_IMPLS else [None])]

    if not on_gpu:  # once, above everything the runs print (stdout: it heads the table in a redirected file)
        print(CPU_NOTICE, flush=True)
    from tqdm import tqdm

    # disable=None: a bar on a terminal only (a log file gets the per-run lines instead)
    bar = tqdm(total=len(plan), desc="mok-bench", unit="run", file=sys.stderr,
               disable=None if opts.progress else True, dynamic_ncols=True)
    say = (lambda msg: None) if opts.quiet else (lambda msg: tqdm.write(msg, file=sys.stderr))
    try:  # SIGTERM (e.g. from `timeout`) ends the sweep cleanly: finished runs are written, the rest skipped
        old_handler = signal.signal(signal.SIGTERM, _raise_interrupted)
    except ValueError:  # not the main thread: no handler
        old_handler = None
    arrays = RunArrays(mesh, dtype, opts)
    routings: dict[int, Any] = {}  # per tokens, for the current model (host arrays)
    current_shape = None
    base_ms: dict[tuple, float] = {}  # baseline median per (model, tokens, pass)
    dropped: dict[tuple, int] = {}  # dropped slots per (model, tokens, impl)
    stop_reason = None
    try:
        for shape, pass_, tokens, impl, knobs in plan:
            if current_shape is not shape:
                current_shape = shape
                routings.clear()
            if tokens not in routings:
                routings[tokens] = routing_and_traffic(shape, tokens, opts)
            routing, traffic = routings[tokens]
            r = new_record(shape, tokens, pass_, impl, opts, traffic, peaks, nvlink)
            r["baseline"] = baseline
            results.append(r)
            label = f"[{len(results)}/{len(plan)}] {shape.model} T={tokens} {pass_} {impl}"
            try:
                kernel = None  # what the builder gets: None lets mok_jax.tuning resolve inside the layer
                if impl in MOK_IMPLS:
                    kernel, ran, r["kernel_source"] = tune.resolve_kernel(tune.problem_key(shape, tokens), knobs,
                                                                          gpu_kind)
                    r["kernel"] = dataclasses.asdict(ran)
                    label += f" [{rep.kernel_label(r, ('comm_items_fwd', 'ring_slots'))}]"
                    if pass_ == "fwd":  # the forward's memory; the backward's is not sized yet
                        r.update(acc.mok_memory_per_rank(shape, tokens, ran,
                                                         **baselines.MOK_IMPLEMENTATIONS[impl]._asdict()))
                if stop_reason:
                    raise _Skip(stop_reason)
                if opts.time_budget_s and time.perf_counter() - t_start > opts.time_budget_s:
                    raise _Skip(f"time budget of {opts.time_budget_s:g} s (--time-budget) spent")
                gb = reference_gb(shape, tokens, pass_)
                if impl == "reference" and on_gpu and gb > opts.reference_max_gb:
                    raise _Skip(f"reference is dense: {gb:.1f} GB of activations > --reference-max-gb "
                                f"{opts.reference_max_gb:g}")
                step, args = arrays.step_and_args(shape, tokens, routing, pass_, impl, kernel)
                measure(r, step, args, slow=impl == "ragged", opts=opts)
                if impl == "xla-capacity":
                    key = (shape.model, tokens, impl)
                    if key not in dropped:
                        dropped[key] = int(arrays.fn(impl, kernel)(*args[:4])[1]["dropped_slots"])
                    r["dropped_slots"] = dropped[key]
                    r["dropped_fraction"] = dropped[key] / (n * tokens * shape.top_k)
                if impl == baseline and (shape.model, tokens, pass_) not in base_ms:  # mok as baseline: its first
                    base_ms[shape.model, tokens, pass_] = r["median_ms"]  # kernel setting (--tune, --granularity)
                if (shape.model, tokens, pass_) in base_ms:
                    r["baseline_median_ms"] = base_ms[shape.model, tokens, pass_]
                    r["speedup_vs_baseline"] = r["baseline_median_ms"] / r["median_ms"]
                if impl in (FP8_IMPL, FP8_REFERENCE):
                    rep.fill_fp8_ratios(results, fp8_impl=FP8_IMPL, reference=FP8_REFERENCE)
                rep.fill_dense_ratios(results, dense=DENSE)  # dense runs second: the rows after it get theirs
                of_peak = "" if r["compute_fraction"] is None else f", {r['compute_fraction'] * 100:.1f}% of peak"
                x_dense = "" if r["x_dense"] is None or impl == DENSE else f", {r['x_dense']:.2f}x dense"
                vs_bf16 = "" if r["speedup_vs_bf16"] is None else f", {r['speedup_vs_bf16']:.2f}x {FP8_REFERENCE}"
                say(f"{label}: {r['median_ms']:.3f} ms ({rep.fmt(r['tflops'], '.1f')} TFLOP/s{of_peak}{x_dense}"
                    f"{vs_bf16}; first call {r['first_call_s']:.1f} s)")
                if opts.profile:
                    try:  # a trace that cannot be taken (no CUPTI, say) costs the trace, not the timing
                        write_profile(opts.profile, r, step, args)
                    except Exception as e:  # noqa: BLE001
                        r["error"] = f"profile not written: {error_text(e)}"
                        say(f"{label}: {r['error'].splitlines()[0][:300]}")
            except _Skip as e:
                r.update(status="skipped", error=str(e))
                say(f"{label}: skipped ({e})")
            except _Interrupted as e:
                stop_reason = str(e)
                r.update(status="skipped", error=stop_reason)
            except NotImplementedError as e:  # a pass an implementation lacks (raised at trace time): this pass only
                r.update(status="unsupported", error=error_text(e))
                say(f"{label}: unsupported ({error_text(e).splitlines()[0][:300]})")
            except Exception as e:  # noqa: BLE001 - recorded; the other runs go on
                r.update(status="error", error=error_text(e))
                say(f"{label}: ERROR {error_text(e).splitlines()[0][:300]}")
            bar.update(1)
            if opts.json:
                rep.write_json(opts.json, report)
    except KeyboardInterrupt:
        stop_reason = "interrupted (Ctrl-C)"
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
        bar.close()
        arrays.clear()
    if opts.tune:
        report["tuned"] = _write_tuned(results, devices[0].device_kind, report["git"])
    report["elapsed_s"] = time.perf_counter() - t_start
    report["stopped"] = stop_reason
    if opts.json:
        rep.write_json(opts.json, report)
    title = f"{report['device']['kind']} x{n}"
    if opts.markdown:
        print(rep.format_markdown(results, peak_tflops=peak), flush=True)
    else:
        print(rep.format_table(results), flush=True)
    memory = rep.format_memory(results) if on_gpu else ""
    if memory:
        print(memory, flush=True)
    if opts.tune:
        t = report["tuned"]
        for e in t["entries"]:
            eprint(f"mok-bench: tuned {e['model']} T={e['tokens']}: granularity {e['granularity']}, comm items "
                   f"{e['comm_items_fwd']}, ring slots {e['ring_slots']} ({e['median_ms']:.3f} ms)")
        if t["incomplete"]:
            eprint(f"mok-bench: not tuned (grid cut short or every setting failed): {', '.join(t['incomplete'])}")
        eprint(f"mok-bench: tuned table {'written to ' + t['path'] if t['entries'] else 'unchanged: nothing to write'}")
    if dropped_impls:
        eprint(f"mok-bench: not run (unavailable here): {', '.join(dropped_impls)}")
    if FP8_IMPL in dropped_impls:  # --dtype fp8 asked for it: say why, the bf16 rows above ran without it
        eprint(f"mok-bench: --dtype fp8: {FP8_IMPL} (the FP8 layer) cannot run here: "
               f"{dropped_impls[FP8_IMPL].splitlines()[0][:300]}")
    if opts.plot:
        models_txt = ",".join(dict.fromkeys(r["model"] for r in results))
        modes = ",".join(dict.fromkeys(s.ep_mode for s, _ in problems))
        path = rep.plot_sweep(opts.plot, results, peak_tflops=peak if on_gpu else None,
                              fp8_peak_tflops=peaks["fp8"] if on_gpu and opts.dtype == "fp8" else None,
                              title=f"{models_txt} ({modes}, {_dtype_text(opts.dtype)}, {opts.routing} routing) on "
                                    f"{title}")
        eprint(f"mok-bench: plot written to {path}")
    if opts.json:
        eprint(f"mok-bench: JSON written to {opts.json}")
    failed = [r for r in results if r["status"] == "error"]
    if failed:  # the last line, so a log's tail says why the exit status is 1
        first, impls_failed = failed[0], ", ".join(dict.fromkeys(r["impl"] for r in failed))
        eprint(f"mok-bench: failed: {len(failed)} of {len(results)} runs ({impls_failed}); first: {first['model']} "
               f"T={first['tokens_per_gpu']} {first['pass']} {first['impl']}: {first['error'].splitlines()[0][:200]}")
    return report


class _Skip(Exception):
    pass


def _write_tuned(results: list[dict], device_kind: str, git: dict) -> dict:
    """--tune: the fastest setting of each fully timed problem, merged into the device's tuned table."""
    from mok_jax import tuning
    from mok_jax.bench import tune

    entries, incomplete = tune.best_entries(results)
    path = tuning.table_path(device_kind, root=tune.tuned_root())
    if entries:
        tune.write_table(path, entries, commit=git.get("commit", "unknown"), dirty=git.get("dirty"))
    return {"path": str(path), "entries": entries, "incomplete": incomplete}
