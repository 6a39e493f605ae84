"""mok-bench's command line, JSON report, table, plot and profile, on CPU (tiny runs: 1 call per sample)."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from mok_jax.bench import cli, runner
from mok_jax.bench.report import RESULT_KEYS, SCHEMA

# Timing knobs that keep a run to its compilation plus a few calls.
FAST = ["--samples", "2", "--warmup", "1", "--target-sample-ms", "1", "--no-progress"]


def test_parse_tokens():
    assert cli.parse_tokens("2048") == (2048,)
    assert cli.parse_tokens("512..4096") == (512, 1024, 2048, 4096)
    assert cli.parse_tokens("512..16384") == (512, 1024, 2048, 4096, 8192, 16384)
    assert cli.parse_tokens("3..8,100,4") == (3, 6, 100, 4)  # doubling from 3; duplicates dropped
    for bad in ("0", "x", "8..4", "-2", ""):
        with pytest.raises(cli.UsageError):
            cli.parse_tokens(bad)


def test_parse_args():
    o = cli.parse_args([])
    assert o.models is None and o.tokens is None and o.impls is None  # platform defaults, resolved at run time
    assert o.passes == ("fwd",) and o.dtype == "bf16" and o.routing == "uniform" and o.capacity_factor == 1.25
    o = cli.parse_args(["kimi-k2,glm-5", "-t", "512..1024", "--pass", "fwd,fwd+bwd", "--impl", "xla,ragged",
                        "--ep-mode", "ep64-slice", "--routing", "zipf", "--zipf-s", "0.8", "--peak-tflops", "700",
                        "--nvlink-gbps", "300", "--capacity-factor", "2"])
    assert o.models == ("kimi-k2", "glm-5") and o.tokens == (512, 1024) and o.passes == ("fwd", "fwd+bwd")
    assert o.impls == ("xla", "ragged") and o.ep_mode == "ep64-slice" and o.zipf_s == 0.8
    assert (o.peak_tflops, o.nvlink_gbps, o.capacity_factor) == (700, 300, 2)
    assert cli.parse_args(["--model", "ci"]).models == ("ci",)
    with pytest.raises(cli.UsageError, match="--pass"):
        cli.parse_args(["--pass", "bwd"])
    with pytest.raises(cli.UsageError, match="--impl"):
        cli.parse_args(["--impl", "xla,torch"])
    with pytest.raises(cli.UsageError, match="once"):
        cli.parse_args(["ci", "--model", "ci"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--routing", "sorted"])  # argparse's own choices


def test_main_rejects_bad_options(capsys):
    assert cli.main(["--impl", "mok-fp8"]) == 2
    assert "mok-bench: error: --impl/--baseline mok-fp8 is the FP8 layer: give --dtype fp8" in capsys.readouterr().err
    assert cli.main(["--tokens", "0"]) == 2
    assert cli.main(["ci", "--ep-mode", "ep64-slice"]) == 2  # 16 experts: not a multiple of 64
    assert "not a multiple of 64" in capsys.readouterr().err


def test_mok_asked_for_by_name_but_unavailable(capsys, cpu_devices):
    assert cli.main(["ci", "--impl", "mok,xla", "--tokens", "8", *FAST]) == 2
    assert "'mok' is not available here" in capsys.readouterr().err


def _cpu_only(*argv: str) -> subprocess.CompletedProcess:
    """``python -m <argv>`` in a fresh process that sees only CPU devices (as on a machine without a GPU)."""
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_impl_mok_without_a_gpu_exits_nonzero_with_one_line():
    done = _cpu_only("mok_jax.bench", "--impl", "mok")
    assert done.returncode == 2 and done.stdout == ""  # nothing ran, so no CPU notice and no table
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mok-bench: error: implementation 'mok' is not available here: ")
    assert "needs a CUDA GPU" in lines[0]


def test_default_run_without_a_gpu_exits_zero_says_cpu_once_and_shows_no_gpu_roofline():
    """The plain command on a CPU-only machine: the reference paths on the ci shape (CPU_DEFAULTS), exit 0, the
    CPU notice once (not above and below the table, not again on stderr), no %peak / NVLink columns."""
    done = _cpu_only("mok_jax.bench")
    assert done.returncode == 0, done.stderr[-3000:]
    both = done.stdout + done.stderr
    assert both.count("CPU NUMBERS") == 1 and done.stdout.startswith(cli.CPU_NOTICE + "\n")
    header = done.stdout.splitlines()[1].split()
    assert header[:5] == ["model", "mode", "T/GPU", "pass", "impl"] and "TFLOP/s" in header
    for gpu_figure in ("%peak", "% of peak", "comm ms", "%comm", "NVLink"):
        assert gpu_figure not in both, gpu_figure
    for peak in cli.PEAK_TFLOPS.values():  # as a figure of its own, not inside a time such as 0.805 ms
        assert not re.search(rf"(?<![\d.]){peak:g}(?![\d.])", both), peak
    assert "x dense" in done.stdout.splitlines()[1]  # dense runs on CPU too: every row has its ratio to it
    rows = [ln.split() for ln in done.stdout.splitlines()[3:7]]
    assert [r[4] for r in rows] == ["xla", "dense", "reference", "xla-capacity"] and {r[0] for r in rows} == {"ci"}


@pytest.mark.parametrize("module", ["mok_jax.bench.grouped_ffn", "mok_jax.bench.comm"])
def test_kernel_benchmarks_without_a_gpu_say_so_and_exit_nonzero(module):
    done = _cpu_only(module)
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert lines == [f"python -m {module}: needs a CUDA GPU; this machine has only cpu devices, so nothing was "
                     "timed"]


def test_grouped_ffn_kernels_only_table_names_the_library_and_the_output_crcs():
    """--kernels-only (the A/B of two library builds, scripts/gpu_fp8_ab.sh): its table has the two kernels'
    times, the FP8 speedup and each output's CRC, and the library it ran; without FP8, dashes."""
    from mok_jax.bench.grouped_ffn import table

    k = {"ms": 2.0, "tflops": 700.0, "y_crc32": 123}
    f8 = {"ms": 1.6, "tflops": 875.0, "speedup_over_bf16": 1.25, "y_crc32": 456}
    result = {"device": "H200", "num_sms": 132, "tokens_per_gpu": 2048, "library": "loaded from /x/lib.so",
              "cases": [{"setting": "ep64", "model": "kimi-k2", "kernel_all_sms": k, "fp8_all_sms": f8},
                        {"setting": "ep64", "model": "glm-5", "kernel_all_sms": k}]}
    lines = table(result).splitlines()
    assert "library: loaded from /x/lib.so" in lines[0]
    assert lines[3] == "| ep64 | kimi-k2 | 2.000 (700) | 1.600 (875) | 1.25x | 123 | 456 |"
    assert lines[4] == "| ep64 | glm-5 | 2.000 (700) | - | - | 123 | - |"


def test_grouped_ffn_records_a_case_out_of_device_memory_and_runs_the_rest(monkeypatch):
    """A case that runs out of device memory (deepseek-v4-pro's ep2 slice on an 80 GB H100 did, in the FP8 weight
    quantiser's autotuning) is recorded with the error and named under the table; the other cases still run. Any
    other runtime error still stops the run."""
    import jax

    from mok_jax.bench import grouped_ffn as g

    oom = "NOT_FOUND: All configs failed\nEXECUTION FAILED: RESOURCE_EXHAUSTED: Out of memory allocating 7.89GiB"
    ran = []

    def case(model, setting, timing_kw, num_sms, fp8, kernels_only):
        ran.append(model)
        if model == "glm-5":
            raise jax.errors.JaxRuntimeError(oom)
        if model == "broken":
            raise jax.errors.JaxRuntimeError("INTERNAL: something else")
        return {"setting": setting, "model": model, "kernel_all_sms": {"ms": 2.0, "tflops": 700.0, "y_crc32": 1}}

    monkeypatch.setattr(g, "_bench_case", case)
    result = g.run(["kimi-k2", "glm-5", "deepseek-v4-pro"], ["ep2"], kernels_only=True)
    assert ran == ["kimi-k2", "glm-5", "deepseek-v4-pro"]
    kind = jax.devices()[0].device_kind
    assert result["cases"][1] == {"model": "glm-5", "setting": "ep2", "error": f"out of memory on {kind}: "
                                  "EXECUTION FAILED: RESOURCE_EXHAUSTED: Out of memory allocating 7.89GiB"}
    lines = g.table(result).splitlines()
    assert [line.split(" | ")[1] for line in lines[3:5]] == ["kimi-k2", "deepseek-v4-pro"]
    assert lines[5] == f"- ep2 glm-5: not timed, {result['cases'][1]['error']}"
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        g.run(["broken"], ["ep2"], kernels_only=True)


def test_list_models(capsys):
    assert cli.main(["--list-models"]) == 0
    out = capsys.readouterr().out
    assert "kimi-k2" in out and "deepseek-v4-pro" in out and "(in 'bench')" in out


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The CPU default (ci model, all 8 host devices, reference + dense + xla + xla-capacity), both passes, with
    every output asked for."""
    d = tmp_path_factory.mktemp("bench")
    paths = {"json": d / "r.json", "plot": d / "r.png", "profile": d / "prof"}
    argv = ["--pass", "fwd,fwd+bwd", "--json", str(paths["json"]), "--plot", str(paths["plot"]), "--profile",
            str(paths["profile"]), *FAST]
    rc = cli.main(argv)
    return rc, paths, json.loads(paths["json"].read_text())


def test_default_run_json_schema(default_run, cpu_devices):
    rc, _, rep = default_run
    assert rc == 0
    assert rep["schema"] == SCHEMA
    assert rep["cpu_numbers"] is True and "CPU" in rep["notice"]
    assert rep["device"]["platform"] == "cpu" and rep["device"]["used"] == 8
    assert {"python", "jax", "jaxlib", "numpy", "mok_jax", "flax"} <= set(rep["versions"])
    assert isinstance(rep["git"]["commit"], str) and rep["git"]["commit"]
    assert rep["roofline"] == {"peak_tflops": None, "peak_tflops_fp8": None, "nvlink_gbps": None}  # H200's: not CPU
    cfg = rep["config"]
    assert cfg["models"] == ["ci"] and cfg["tokens"] == [32] and cfg["ep_mode"] == "full" and cfg["baseline"] == "xla"
    assert cfg["problems"] == {"ci": {"tokens": [32], "ep_mode": "full", "experts_per_gpu": 2}}  # 16 over 8 devices
    assert cfg["peak_tflops"] is None and cfg["peak_tflops_fp8"] is None and cfg["nvlink_gbps"] is None
    assert rep["command"][0] == "mok-bench"
    results = rep["results"]
    assert [(r["pass"], r["impl"]) for r in results] == [  # pass-major, the baseline first, then dense
        (p, i) for p in ("fwd", "fwd+bwd") for i in ("xla", "dense", "reference", "xla-capacity")]
    for r in results:
        assert tuple(r) == RESULT_KEYS  # every record has exactly the documented keys, in order
        assert r["status"] == "ok", r["error"]
        assert r["dtype"] == "bf16" and r["speedup_vs_bf16"] is None
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["samples"] == 2
        assert r["tflops"] == pytest.approx(r["flops_per_gpu"] / r["median_ms"] / 1e9)
        for figure in ("compute_floor_ms", "compute_fraction", "comm_floor_ms", "comm_fraction",
                       "comm_floor_unique_ms", "comm_fraction_unique"):
            assert r[figure] is None, figure  # no roofline on CPU
        # ci: H 64, I 32, Is 48, k 4, T 32: fwd = 2*32*4*3*64*32 + 2*32*3*64*48 = 1572864 + 589824
        assert r["flops_per_gpu"] == (1572864 + 589824) * (1 if r["pass"] == "fwd" else 3)
        assert r["dispatch_bytes_per_gpu"] == 32 * 4 * 64 * 2
        assert r["remote_dispatch_bytes_per_gpu_uniform"] == 32 * 4 * 64 * 2 * 7 / 8
    base = {r["pass"]: r["median_ms"] for r in results if r["impl"] == "xla"}
    dense = {r["pass"]: r["median_ms"] for r in results if r["impl"] == "dense"}
    for r in results:
        assert r["speedup_vs_baseline"] == pytest.approx(base[r["pass"]] / r["median_ms"])
        assert r["dense_median_ms"] == dense[r["pass"]]  # the dense row of the same model, tokens and pass
        assert r["x_dense"] == pytest.approx(r["median_ms"] / dense[r["pass"]])
    cap = [r for r in results if r["impl"] == "xla-capacity"]
    assert all(r["dropped_slots"] == 0 and r["capacity"] == 10 for r in cap)  # uniform: ceil(1.25*32*4/16) = 10


def test_default_run_plot_profile_and_table(default_run, capsys):
    rc, paths, rep = default_run
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    traces = list(paths["profile"].rglob("*.xplane.pb"))
    assert len(traces) == len(rep["results"])  # one trace per run
    capsys.readouterr()
    assert cli.main(["--from-json", str(paths["json"])]) == 0
    out = capsys.readouterr().out
    assert out.count("CPU NUMBERS") == 1 and out.startswith(rep["notice"])  # once, above the table
    assert "%peak" not in out and "comm ms" not in out
    assert cli.main(["--from-json", str(paths["json"]), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| ci | full | 32 | fwd+bwd | `xla-capacity` |" in out and out.count("CPU NUMBERS") == 1
    assert "% of" not in out and "comm floor" not in out


def test_a_failed_implementation_exits_nonzero(tmp_path, cpu_devices, monkeypatch, capsys):
    # an implementation that fails when it is traced: the run is recorded as an error, the baseline still runs,
    # the exit is 1 and the last line says which run failed
    from mok_jax.bench import baselines

    real = baselines.build

    def build(name, mesh, **kw):
        if name != "xla-capacity":
            return real(name, mesh, **kw)

        def broken(x, idx, w, W):
            raise RuntimeError("a failure injected by the test")

        return broken

    monkeypatch.setattr(baselines, "build", build)
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--impl", "xla-capacity", "--baseline", "xla", "--tokens", "8", "--devices", "2",
                     "--json", str(out), "-q", *FAST]) == 1
    results = json.loads(out.read_text())["results"]
    assert [(r["impl"], r["status"]) for r in results] == [("xla", "ok"), ("xla-capacity", "error")]
    assert "injected by the test" in results[1]["error"] and results[1]["median_ms"] is None
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("mok-bench: failed: 1 of 2 runs (xla-capacity); first: ci T=8 fwd xla-capacity: "
                           "RuntimeError: a failure injected by the test")


# ------------------------------------------------------------------ dense, and the standard problems


def test_dense_row_has_the_layers_flops_no_communication_and_every_row_its_ratio(tmp_path, cpu_devices, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--impl", "xla-capacity,dense", "--baseline", "xla-capacity", "--devices", "2", "--tokens",
                     "16", "--pass", "fwd,fwd+bwd", "--peak-tflops", "805", "--nvlink-gbps", "394", "--json", str(out),
                     "-q", *FAST]) == 0
    rows = {(r["pass"], r["impl"]): r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == [(p, i) for p in ("fwd", "fwd+bwd") for i in ("xla-capacity", "dense")]
    for p in ("fwd", "fwd+bwd"):
        layer, dense = rows[p, "xla-capacity"], rows[p, "dense"]
        assert dense["status"] == "ok" and dense["flops_per_gpu"] == layer["flops_per_gpu"]
        assert dense["compute_floor_ms"] == layer["compute_floor_ms"]  # the same FLOPs at the same peak
        assert dense["comm_floor_ms"] is None and dense["comm_fraction"] is None  # it moves no rows
        assert layer["comm_floor_ms"] > 0
        assert dense["x_dense"] == 1.0 and layer["x_dense"] == pytest.approx(layer["median_ms"] / dense["median_ms"])
    table = capsys.readouterr().out
    assert "x dense" in table.splitlines()[1] and "x dense: this median / dense's" in table
    assert cli.main(["--from-json", str(out), "--markdown"]) == 0
    md = capsys.readouterr().out
    assert "| vs baseline | x dense | note |" in md and "| `dense` |" in md


def test_a_gpu_run_takes_each_models_standard_problem(tmp_path, cpu_devices, monkeypatch):
    """On a GPU (the CPU devices passed off as one) a model runs its standard problem: here a stand-in for ci, 16
    tokens with E/4 experts on one GPU; --tokens overrides the tokens, the experts stay."""
    from mok_jax.bench import problems

    monkeypatch.setattr(runner, "_on_gpu", lambda devices: True)
    monkeypatch.setitem(problems.STANDARD_PROBLEMS, "ci", problems.StandardProblem(tokens_per_gpu=16,
                                                                                   one_gpu_experts="E/4"))
    out = tmp_path / "r.json"
    for argv, tokens in (([], [16]), (["--tokens", "8"], [8])):
        assert cli.main(["ci", "--impl", "xla", "--devices", "1", "--json", str(out), "-q", *argv, *FAST]) == 0
        rep = json.loads(out.read_text())
        assert rep["config"]["problems"] == {"ci": {"tokens": tokens, "ep_mode": "E/4", "experts_per_gpu": 4}}
        assert [(r["tokens_per_gpu"], r["experts_per_gpu"], r["status"]) for r in rep["results"]] == [
            (tokens[0], 4, "ok")]


# ------------------------------------------------------------------ exit codes: refused before anything runs (rc 2)


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mok-bench: error: "), lines
    return lines[0]


def test_tokamax_not_installed_is_dropped_with_the_reason_or_refused_by_name(tmp_path, cpu_devices, monkeypatch,
                                                                              capsys):
    monkeypatch.setitem(sys.modules, "tokamax", None)  # what an import finds where tokamax is not installed
    monkeypatch.setitem(cli.CPU_DEFAULTS, "impls", ("xla", "tokamax"))
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--devices", "1", "--tokens", "8", "--json", str(out), "-q", *FAST]) == 0
    rep = json.loads(out.read_text())
    assert [r["impl"] for r in rep["results"]] == ["xla"]
    assert rep["unavailable_impls"]["tokamax"].startswith("ImportError: tokamax is not installed")
    assert "mok-bench: not run (unavailable here): tokamax" in capsys.readouterr().err
    assert cli.main(["ci", "--impl", "tokamax", "--devices", "1", "--tokens", "8", *FAST]) == 2
    assert _one_error_line(capsys.readouterr().err).startswith(
        "mok-bench: error: implementation 'tokamax' is not available here: ImportError: tokamax is not installed")


@pytest.mark.skipif(importlib.util.find_spec("tokamax") is None, reason="tokamax is not installed: not a pass")
def test_tokamax_on_cpu_is_refused_by_name_with_its_kernels_reason(capsys, cpu_devices):
    """Its Mosaic GPU kernel cannot run on CPU: asked for by name, one line and rc 2, before any run."""
    assert cli.main(["ci", "--impl", "tokamax", "--devices", "1", "--tokens", "8", *FAST]) == 2
    assert _one_error_line(capsys.readouterr().err).startswith(
        "mok-bench: error: implementation 'tokamax' is not available here: ")


def test_a_model_toml_that_cannot_be_read_is_a_usage_error(tmp_path, cpu_devices, capsys):
    """A missing TOML file, a malformed one and one with missing fields: one line naming the model, rc 2."""
    missing = tmp_path / "nope.toml"
    assert cli.main([str(missing), *FAST]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"model {str(missing)!r}: " in line and "no file" in line
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \"bad\"\nnum_experts = = 8\n")
    assert cli.main([str(bad), *FAST]) == 2
    assert f"model {str(bad)!r}: " in _one_error_line(capsys.readouterr().err)
    half = tmp_path / "half.toml"
    half.write_text("name = \"half\"\nnum_experts = 8\n")
    assert cli.main([str(half), *FAST]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"model {str(half)!r}: " in line and "missing" in line and "top_k" in line


def test_ragged_on_several_cpu_devices_is_refused_before_running(tmp_path, cpu_devices, capsys):
    """XLA:CPU has no ragged-all-to-all: --impl ragged at EP > 1 on CPU is rc 2 before any run (no JSON written);
    at --devices 1 it needs no collective and runs."""
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--impl", "ragged", "--devices", "2", "--tokens", "8", "--json", str(out), *FAST]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("mok-bench: error: implementation 'ragged' is not available here: XLA:CPU has no "
                           "ragged-all-to-all") and "--devices 1" in line
    assert not out.exists()
    assert cli.main(["ci", "--impl", "ragged", "--devices", "1", "--tokens", "8", "--json", str(out), "-q",
                     *FAST]) == 0
    assert [(r["impl"], r["status"]) for r in json.loads(out.read_text())["results"]] == [("ragged", "ok")]


def test_a_bad_plot_extension_is_refused_before_running(tmp_path, cpu_devices, capsys):
    with pytest.raises(cli.UsageError, match=r"--plot: 'p\.txt' must end in \.png, \.pdf, \.svg"):
        cli.parse_args(["--plot", "p.txt"])
    assert cli.parse_args(["--plot", "sweep.PDF"]).plot == "sweep.PDF"
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--plot", str(tmp_path / "p.txt"), "--json", str(out), *FAST]) == 2
    assert "--plot: " in _one_error_line(capsys.readouterr().err)
    assert not out.exists()  # nothing ran


def test_a_problem_larger_than_the_device_memory_is_refused_up_front(cpu_devices, monkeypatch, capsys):
    """The lower bound of what any implementation holds (accounting.min_bytes_per_gpu) against one device's
    memory, before anything is allocated: here a device of 1 MB against ci's 2 MB fwd+bwd at 4096 tokens."""
    monkeypatch.setattr(runner, "_device_memory", lambda devices: (1_000_000, "a 1 MB device of the test"))
    assert cli.main(["ci", "--tokens", "4096", "--devices", "2", "--pass", "fwd,fwd+bwd", *FAST]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("mok-bench: error: --tokens 4096: ci fwd+bwd needs at least 2.0 MB per device (its "
                           "inputs, outputs and weights and their gradients), more than the 1.0 MB of a device here "
                           "(a 1 MB device of the test)"), line


# `python -m mok_jax.bench` with an 8 GiB address space: a guard, so that were the check gone the run would fail to
# allocate instead of filling the machine's memory
_LIMITED_BENCH = ("import resource, runpy; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30)); "
                  "runpy.run_module('mok_jax.bench', run_name='__main__')")


def test_tokens_100_million_is_refused_with_the_bytes_against_the_memory():
    done = subprocess.run([sys.executable, "-c", _LIMITED_BENCH, "ci", "--tokens", "100000000"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    line = _one_error_line(done.stderr)
    # 8 host devices, 10^8 tokens each: x and y 2 * 10^8 * 64 * 2 bytes, ids and weights 10^8 * 4 * 8 bytes
    assert re.match(r"mok-bench: error: --tokens 100000000: ci fwd needs at least 28\.8 GB per device \(its "
                    r"inputs, outputs and weights\), more than the \d+\.\d GB of a device here \(the host's "
                    r"\d+\.\d GB shared by 8 host devices\)$", line), line


def test_time_budget_skips(tmp_path, cpu_devices):
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--impl", "xla", "--tokens", "8,16", "--time-budget", "1e-9", "--json", str(out),
                     *FAST]) == 1  # nothing ran
    results = json.loads(out.read_text())["results"]
    assert [r["status"] for r in results] == ["skipped", "skipped"]
    assert "time budget" in results[0]["error"]


def test_python_dash_m():
    done = subprocess.run([sys.executable, "-m", "mok_jax.bench", "--list-models"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "qwen3.5-397b-a17b" in done.stdout


# ------------------------------------------------------------------ --experts-per-gpu, mok knobs, --tune


def test_parse_experts_per_gpu():
    assert cli.parse_args(["--experts-per-gpu", "E/32"]).experts_per_gpu == "E/32"
    assert cli.parse_args(["--experts-per-gpu", "e/32"]).experts_per_gpu == "E/32"  # normalised
    assert cli.parse_args(["--experts-per-gpu", "12"]).experts_per_gpu == "12"
    assert cli.parse_args([]).experts_per_gpu is None  # absent: the split of --ep-mode
    for bad in ("0", "E/0", "E/", "x", "32/E", "-3", "2.5", "E/-2"):
        with pytest.raises(cli.UsageError, match="--experts-per-gpu"):
            cli.parse_args(["--experts-per-gpu", bad])


def test_parse_kernel_knobs():
    o = cli.parse_args(["--granularity", "512,1024,512", "--comm-items", "16", "--ring-slots", "3", "--dispatch",
                        "push", "--combine", "pull"])
    assert o.granularity == (512, 1024) and o.comm_items == (16,) and o.ring_slots == (3,)
    assert (o.dispatch, o.combine) == ("push", "pull")
    o = cli.parse_args(["--comm-items", "16,24,16", "--ring-slots", "2,3"])  # lists to sweep, as --granularity
    assert o.comm_items == (16, 24) and o.ring_slots == (2, 3)
    o = cli.parse_args([])
    assert (o.granularity, o.comm_items, o.ring_slots, o.dispatch, o.combine, o.tune) == (None,) * 5 + (False,)
    for argv, option in ((["--granularity", "500"], "--granularity"), (["--granularity", "512,x"], "--granularity"),
                         (["--granularity", "65536"], "--granularity"), (["--comm-items", "0"], "--comm-items"),
                         (["--comm-items", "129"], "--comm-items"), (["--ring-slots", "0"], "--ring-slots"),
                         (["--ring-slots", "9"], "--ring-slots"), (["--comm-items", "16,0"], "--comm-items"),
                         (["--comm-items", "16,"], "--comm-items"), (["--ring-slots", "2,9"], "--ring-slots")):
        with pytest.raises(cli.UsageError, match=option):
            cli.parse_args(argv)
    with pytest.raises(SystemExit):
        cli.parse_args(["--dispatch", "both"])  # argparse's own choices


def test_the_flag_before_issue_35_is_refused_naming_the_new_one():
    """--comm-sms became --comm-items with KernelConfig's comm_items_fwd / comm_items_bwd: the old flag is a usage
    error that names the new one (main says so and exits 2), not argparse's "unrecognized arguments"."""
    with pytest.raises(cli.UsageError, match=r"^--comm-sms is now --comm-items .*not SMs set aside"):
        cli.parse_args(["--comm-sms", "16"])
    assert cli.parse_args(["--comm-items", "16"]).comm_items == (16,)


@pytest.mark.parametrize("old,new", [("--comm-sms", "--comm-items"), ("--only-comm-sms", "--only-comm-items")])
def test_the_breakdown_flags_before_issue_35_are_refused_naming_the_new_ones(old, new, capsys):
    from mok_jax.bench import breakdown

    with pytest.raises(SystemExit) as e:
        breakdown.main([old, "8"] if old == "--comm-sms" else [old])
    assert e.value.code == 2 and f"{old} is now {new}: " in capsys.readouterr().err


def test_results_written_before_issue_35_read_with_the_new_knob_names(capsys):
    """A committed result whose kernel knobs are comm_sms_fwd / comm_sms_bwd (the tuner's grid of the eighteenth
    session, where comm_sms_fwd varies) prints through --from-json with the new names."""
    from mok_jax.bench import report as rep

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "forward",
                        "tune_qwen3_30b.json")
    assert '"comm_sms_fwd"' in open(path).read()
    results, _ = rep.load_results([path])
    kernels = [r["kernel"] for r in results if r.get("kernel")]
    assert kernels and all("comm_items_fwd" in k and "comm_sms_fwd" not in k for k in kernels)
    assert {k["comm_items_fwd"] for k in kernels} == {8, 16, 24}
    assert "items=8" in rep.format_table(results)
    assert cli.main(["--from-json", path]) == 0
    assert "items=24" in capsys.readouterr().out


def test_parse_tune_conflicts():
    assert cli.parse_args(["--tune"]).tune is True
    assert cli.parse_args(["--tune", "--impl", "mok"]).impls == ("mok",)
    for argv, msg in ((["--granularity", "512"], "drop --granularity"), (["--comm-items", "8", "--ring-slots", "2"],
                                                                          "drop --comm-items, --ring-slots"),
                      (["--impl", "xla"], "mok only"), (["--pass", "fwd,fwd+bwd"], "forward only"),
                      (["--dtype", "fp8"], "drop --dtype fp8")):
        with pytest.raises(cli.UsageError, match=msg):
            cli.parse_args(["--tune", *argv])


def test_kernel_settings():
    assert cli.kernel_settings(cli.parse_args([]), 2048) == [None]  # every knob left to mok_jax.tuning
    want = [{"comm_items_fwd": 8, "comm_items_bwd": 8}]
    assert cli.kernel_settings(cli.parse_args(["--comm-items", "8"]), 2048) == want
    got = cli.kernel_settings(cli.parse_args(["--granularity", "512,2048", "--ring-slots", "3"]), 2048)
    assert got == [{"ring_slots": 3, "granularity": 512}, {"ring_slots": 3, "granularity": 2048}]
    got = cli.kernel_settings(cli.parse_args(["--granularity", "512,2048", "--comm-items", "16,24", "--ring-slots",
                                              "2,3", "--dispatch", "push"]), 2048)
    want = [{"dispatch": "push", "granularity": g, "comm_items_fwd": c, "comm_items_bwd": c, "ring_slots": r}
            for g in (512, 2048) for c in (16, 24) for r in (2, 3)]
    assert got == want  # the cross product, granularity slowest
    tune = cli.kernel_settings(cli.parse_args(["--tune"]), 1024)
    assert len(tune) == 2 * 4 * 2 and {s["granularity"] for s in tune} == {512, 1024}


def test_main_rejects_bad_experts_per_gpu(capsys, cpu_devices):
    assert cli.main(["ci", "--experts-per-gpu", "E/3", "--devices", "2"]) == 2  # 16 experts
    assert "--experts-per-gpu E/3: ci has E = 16 experts, which is not divisible by 3" in capsys.readouterr().err
    assert cli.main(["ci", "--experts-per-gpu", "1", "--devices", "2"]) == 2  # 2 experts in all, k = 4
    err = capsys.readouterr().err
    assert "--experts-per-gpu 1" in err and "fewer than top_k=4" in err
    assert cli.main(["ci", "--experts-per-gpu", "17"]) == 2
    assert "more than ci's 16 experts" in capsys.readouterr().err


def test_tune_needs_a_gpu(capsys, cpu_devices):
    assert cli.main(["--tune", "ci", "--tokens", "8"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == ["mok-bench: error: --tune needs a GPU (it times the mok megakernel); this machine has only cpu "
                     "devices"]


def test_experts_per_gpu_run_json(tmp_path, cpu_devices):
    # ci (E 16, k 4, H 64, I 32, Is 48) on 2 devices with E/4 = 4 experts each: 8 in all, not full mode's 16
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--impl", "xla", "--experts-per-gpu", "E/4", "--devices", "2", "--tokens", "16",
                     "--peak-tflops", "805", "--nvlink-gbps", "394", "--json", str(out), "-q", *FAST]) == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["experts_per_gpu"] == "E/4"
    (r,) = rep["results"]
    assert r["status"] == "ok", r["error"]
    assert (r["ep_mode"], r["experts_per_gpu"], r["total_experts"], r["num_gpus"]) == ("E/4", 4, 8, 2)
    # useful: 2*16*4*3*64*32 + 2*16*3*64*48 = 786432 + 294912; dropless xla runs E_total*T = 8*16 = 128 rows:
    # 2*128*3*64*32 = 1572864 routed, plus the same shared
    assert r["flops_per_gpu"] == 786432 + 294912
    assert r["executed_flops_per_gpu"] == 1572864 + 294912
    assert r["compute_floor_ms"] == pytest.approx((786432 + 294912) / 805e12 * 1e3)  # rooflines given: used on CPU
    assert r["compute_fraction"] == pytest.approx(r["tflops"] / 805.0)
    assert r["comm_fraction"] == pytest.approx(r["comm_floor_ms"] / r["median_ms"]) and r["comm_floor_ms"] > 0
    assert r["kernel"] is None and r["workspace_bytes_per_rank"] is None  # not a mok row


def _fake_mok_build(built):
    """baselines.build with 'mok' replaced by xla's forward under a custom_vjp whose backward raises
    NotImplementedError at trace time (a pass an implementation lacks); records the kernel each mok build gets."""
    import jax

    from mok_jax.bench import baselines

    real = baselines.build

    def build(name, mesh, *, axis="ep", capacity_factor=1.25, kernel=None):
        if name != "mok":
            return real(name, mesh, axis=axis, capacity_factor=capacity_factor, kernel=kernel)
        built.append(kernel)
        inner = real("xla", mesh)

        @jax.custom_vjp
        def f(x, idx, w, W):
            return inner(x, idx, w, W)[0]

        def f_bwd(res, dy):
            raise NotImplementedError("differentiating the fake mok: no backward")

        f.defvjp(lambda x, idx, w, W: (f(x, idx, w, W), None), f_bwd)
        return jax.jit(lambda x, idx, w, W: (f(x, idx, w, W), {}))

    return build


def test_mok_rows_kernel_memory_and_unsupported_backward(tmp_path, cpu_devices, monkeypatch, capsys):
    from mok_jax.bench import accounting as acc, baselines
    from mok_jax.config import KernelConfig, load_model

    built = []
    monkeypatch.setattr(baselines, "build", _fake_mok_build(built))
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--impl", "xla,mok", "--pass", "fwd,fwd+bwd", "--tokens", "16", "--devices", "2",
                     "--granularity", "512,1024", "--ring-slots", "3", "--json", str(out), *FAST]) == 0
    captured = capsys.readouterr()
    rep = json.loads(out.read_text())
    rows = [(r["pass"], r["impl"], r["kernel"] and r["kernel"]["granularity"], r["status"]) for r in rep["results"]]
    assert rows == [("fwd", "xla", None, "ok"), ("fwd", "mok", 512, "ok"), ("fwd", "mok", 1024, "ok"),
                    ("fwd+bwd", "xla", None, "ok"), ("fwd+bwd", "mok", 512, "unsupported"),
                    ("fwd+bwd", "mok", 1024, "unsupported")]
    # on CPU tuning has no device table: the knobs not given are the heuristic's (32 comm items)
    want = [KernelConfig(granularity=g, comm_items_fwd=32, comm_items_bwd=32, ring_slots=3) for g in (512, 1024)]
    assert built[-2:] == want  # the builder got each explicit KernelConfig (the first build: the availability check)
    shape = acc.bench_shape(load_model("ci"), 2, "full")
    for r in rep["results"]:
        assert tuple(r) == RESULT_KEYS
        if r["impl"] != "mok":
            assert r["kernel"] is None and r["kernel_source"] is None
            continue
        assert r["kernel_source"] == "explicit" and r["kernel"]["ring_slots"] == 3
        if r["pass"] == "fwd":
            k = KernelConfig(**r["kernel"])
            assert {f: r[f] for f in ("workspace_bytes_per_rank", "scratch_bytes_per_rank",
                                      "backward_scratch_bytes_per_rank", "residual_bytes_per_rank",
                                      "fp8_weight_bytes_per_rank")} == acc.mok_memory_per_rank(shape, 16, k)
            # the default keep ("balanced"): bf16 g, u of T k + 128 L rows at ci's I = 64, 16 tokens per rank
            ci = load_model("ci")
            rows = 16 * ci.top_k + 128 * shape.experts_per_gpu
            assert r["residual_bytes_per_rank"] == rows * 2 * ci.intermediate_size * 2
        else:
            assert "no backward" in r["error"] and r["median_ms"] is None
            assert r["workspace_bytes_per_rank"] is None  # the backward's memory is not known
    assert "unsupported" in captured.err
    # the table names each mok row's granularity; the memory lines are for GPU runs only
    assert "kernel" in captured.out and "g=512" in captured.out and "g=1024" in captured.out
    assert "mok memory per rank" not in captured.out


def test_unavailable_default_mok_is_reported_once_and_skipped(tmp_path, cpu_devices, monkeypatch, capsys):
    monkeypatch.setitem(cli.CPU_DEFAULTS, "impls", ("mok", "xla"))
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--tokens", "8,16", "--devices", "2", "--json", str(out), "-q", *FAST]) == 0
    rep = json.loads(out.read_text())
    assert [r["impl"] for r in rep["results"]] == ["xla", "xla"]
    assert "needs a CUDA GPU" in rep["unavailable_impls"]["mok"]
    assert capsys.readouterr().err.count("not run (unavailable here): mok") == 1


def test_table_and_memory_lines():
    from mok_jax.bench import report

    base = dict.fromkeys(RESULT_KEYS)
    base.update(model="kimi-k2", ep_mode="E/32", tokens_per_gpu=2048, impl="mok", status="skipped", error="budget",
                comm_floor_ms=0.3, workspace_bytes_per_rank=117_707_776, backward_scratch_bytes_per_rank=991_623_840,
                residual_bytes_per_rank=0)
    base["pass"] = "fwd"
    kernel = dict(granularity=512, comm_items_fwd=16, comm_items_bwd=16, dispatch="pull", combine="push", ring_slots=2)
    rows = [{**base, "kernel": kernel, "scratch_bytes_per_rank": 100_000_000},
            {**base, "kernel": {**kernel, "granularity": 2048}, "scratch_bytes_per_rank": 369_236_992},
            {**base, "tokens_per_gpu": 4096, "kernel": kernel, "scratch_bytes_per_rank": 5_000}]
    lines = report.format_memory(rows).splitlines()
    assert len(lines) == 2  # one per (model, tokens)
    assert "kimi-k2 E/32 T=2048" in lines[0] and "workspace 117.7 MB" in lines[0]
    assert "scratch 100.0 MB..369.2 MB over 2 kernel settings" in lines[0] and "residuals 0 B" in lines[0]
    assert "backward scratch 991.6 MB (per call)" in lines[0]  # the same for both settings: one figure
    assert "T=4096" in lines[1] and "scratch 5.0 kB" in lines[1]
    # mok-ring's settings can differ in whether the backward takes the kept g, u as its own scratch
    ring = [{**rows[0], "impl": "mok-ring"}, {**rows[1], "impl": "mok-ring", "backward_scratch_bytes_per_rank": 5_000}]
    assert "backward scratch 5.0 kB..991.6 MB over 2 kernel settings (per call)" in report.format_memory(ring)
    assert report.format_memory([{**rows[0], "impl": "xla", "kernel": None}]) == ""
    for impl, kept in (("mok-ring", "the forward's bf16 g, u of the ring's tokens"), ("mok-keep", "the forward's bf16"),
                       ("mok", "the forward's bf16 g, u of the rows a balanced routing fills")):
        line = report.format_memory([{**rows[0], "impl": impl, "residual_bytes_per_rank": 805_306_368}])
        assert line.startswith(f"{impl} memory per rank") and f"residuals 805.3 MB ({kept}" in line, line
    table = report.format_table(rows)
    assert table.splitlines()[0].split()[5] == "kernel" and "g=2048" in table
    assert "kernel" not in report.format_table([{**rows[0], "impl": "xla", "kernel": None}]).splitlines()[0]
    assert "`mok` (g=512)" in report.format_markdown(rows)


def test_tune_path_with_a_stand_in_gpu(tmp_path, cpu_devices, monkeypatch, capsys):
    """--tune end to end on CPU: the fake mok of the test above, the CPU devices passed off as a GPU, and the
    table written under tmp_path (as <root>/cpu/kernel.toml: the device kind is 'cpu')."""
    from mok_jax import tuning
    from mok_jax.bench import baselines, tune

    monkeypatch.setattr(baselines, "build", _fake_mok_build([]))
    monkeypatch.setattr(runner, "_on_gpu", lambda devices: True)
    monkeypatch.setattr(tune, "tuned_root", lambda: tmp_path)
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--tune", "--tokens", "16,32", "--devices", "2", "--ep-mode", "full", "--json", str(out),
                     "-q", *FAST]) == 0
    rep = json.loads(out.read_text())
    rows = rep["results"]
    assert len(rows) == 2 * 8 and {r["impl"] for r in rows} == {"mok"}  # 16 and 32 tokens: granularity 512 only
    assert all(r["status"] == "ok" and r["kernel_source"] == "explicit" for r in rows)
    path = tmp_path / "cpu" / "kernel.toml"
    assert rep["tuned"]["path"] == str(path) and rep["tuned"]["incomplete"] == []
    entries = tune.read_entries(path)
    assert [e["tokens"] for e in entries] == [16, 32]
    for e in entries:
        fastest = min((r for r in rows if r["tokens_per_gpu"] == e["tokens"]), key=lambda r: r["median_ms"])
        assert {k: e[k] for k in tune.KNOBS} == fastest["kernel"] and e["model"] == "ci"
        assert (e["hidden"], e["experts_per_rank"], e["ep"]) == (64, 8, 2)
    assert path.read_text().startswith("# written by mok-bench --tune on ")
    captured = capsys.readouterr()
    assert "tuned table written to" in captured.err
    assert captured.out.count("mok memory per rank, ci full T=") == 2  # one line per (model, tokens) "on GPU"
    tuning.load_table.cache_clear()


# ------------------------------------------------------------------ --dtype fp8: mok-fp8 beside the bf16 mok


def test_parse_dtype_fp8():
    o = cli.parse_args(["--dtype", "fp8", "--peak-tflops-fp8", "1400"])
    assert o.dtype == "fp8" and o.peak_tflops_fp8 == 1400
    o = cli.parse_args(["--dtype", "fp8", "--impl", "mok-fp8,xla", "--baseline", "mok-fp8"])
    assert o.impls == ("mok-fp8", "xla") and o.baseline == "mok-fp8"
    for argv in (["--impl", "xla,mok-fp8"], ["--baseline", "mok-fp8"]):  # the FP8 layer without --dtype fp8
        with pytest.raises(cli.UsageError, match="mok-fp8 is the FP8 layer: give --dtype fp8"):
            cli.parse_args(argv)
    with pytest.raises(cli.UsageError, match="--peak-tflops-fp8 must be > 0"):
        cli.parse_args(["--dtype", "fp8", "--peak-tflops-fp8", "0"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--dtype", "fp16"])  # argparse's own choices


def test_implementations_with_dtype_fp8():
    """--dtype fp8 puts mok-fp8 right after mok, adding mok when --impl lacks it; what it adds is not asked for by
    name (so an FP8 layer that cannot run is dropped with the reason, not an error)."""
    def impls(*argv, defaults=cli.GPU_DEFAULTS):
        return cli.implementations(cli.parse_args(list(argv)), defaults)

    assert impls() == (["mok", "dense", "xla", "xla-capacity", "tokamax"], set())
    assert impls("--dtype", "fp8") == (["mok", "mok-fp8", "dense", "xla", "xla-capacity", "tokamax"], set())
    assert impls("--dtype", "fp8", defaults=cli.CPU_DEFAULTS) == (
        ["reference", "dense", "xla", "xla-capacity", "mok", "mok-fp8"], set())
    assert impls("--dtype", "fp8", "--impl", "xla") == (["xla", "mok", "mok-fp8"], {"xla"})
    assert impls("--dtype", "fp8", "--impl", "mok-fp8,mok-keep,mok") == (
        ["mok-keep", "mok", "mok-fp8"], {"mok-fp8", "mok-keep", "mok"})
    assert impls("--impl", "xla,mok") == (["xla", "mok"], {"xla", "mok"})  # bf16: as given
    assert impls("--tune") == (["mok"], {"mok"})


def test_dtype_fp8_without_the_kernels_runs_the_others_and_says_why(tmp_path, cpu_devices, capsys):
    """On a machine where mok cannot run, `mok-bench --dtype fp8` runs the bf16 defaults, records why mok and
    mok-fp8 did not run and says so on stderr; mok-fp8 asked for by name is an error of one line."""
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--dtype", "fp8", "--tokens", "8", "--devices", "2", "--json", str(out), "-q", *FAST]) == 0
    rep = json.loads(out.read_text())
    assert [r["impl"] for r in rep["results"]] == ["xla", "dense", "reference", "xla-capacity"]
    assert rep["config"]["dtype"] == "fp8" and {r["dtype"] for r in rep["results"]} == {"bf16"}
    assert set(rep["unavailable_impls"]) == {"mok", "mok-fp8"}
    for why in rep["unavailable_impls"].values():
        assert why.startswith("NativeLibraryUnavailable: "), why
    err = capsys.readouterr().err
    assert "mok-bench: not run (unavailable here): mok, mok-fp8" in err
    assert "mok-bench: --dtype fp8: mok-fp8 (the FP8 layer) cannot run here: NativeLibraryUnavailable: " in err
    assert cli.main(["ci", "--dtype", "fp8", "--impl", "mok-fp8", "--tokens", "8", "--devices", "2", *FAST]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("mok-bench: error: implementation 'mok-fp8' is not available here: "
                                "NativeLibraryUnavailable: ")


def _fake_fp8_build(calls):
    """baselines.build with mok and mok-fp8 replaced by xla's layer; each trace records (name, fp8_weights given)."""
    import jax

    from mok_jax.bench import baselines

    real = baselines.build

    def build(name, mesh, *, axis="ep", capacity_factor=1.25, kernel=None):
        if name not in ("mok", "mok-fp8"):
            return real(name, mesh, axis=axis, capacity_factor=capacity_factor, kernel=kernel)
        inner = real("xla", mesh)

        def fn(x, idx, w, W, fp8_weights=None):
            calls.append((name, fp8_weights is not None))
            return inner(x, idx, w, W)

        return jax.jit(fn)

    return build


def test_dtype_fp8_rows_ratio_floors_and_weights(tmp_path, cpu_devices, monkeypatch, capsys):
    """--dtype fp8 end to end on CPU with stand-ins for both mok layers: mok-fp8 runs right after mok, its forward
    gets weights quantised once outside the timed calls (its fwd+bwd none), its row carries the ratio to mok, its
    compute floor the routed forward at the FP8 peak, its comm floor E4M3 dispatch rows."""
    from mok_jax.bench import accounting as acc, baselines, report
    from mok_jax.config import load_model

    calls, quantized = [], []
    monkeypatch.setattr(baselines, "build", _fake_fp8_build(calls))
    monkeypatch.setattr(baselines, "quantize_weights", lambda W, mesh: quantized.append(W) or (W.gate_up,))
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--dtype", "fp8", "--impl", "xla", "--pass", "fwd,fwd+bwd", "--tokens", "16", "--devices",
                     "2", "--peak-tflops", "805", "--peak-tflops-fp8", "1477", "--nvlink-gbps", "394", "--json",
                     str(out), *FAST]) == 0
    rep = json.loads(out.read_text())
    assert rep["roofline"] == {"peak_tflops": 805, "peak_tflops_fp8": 1477, "nvlink_gbps": 394}
    rows = {(r["pass"], r["impl"]): r for r in rep["results"]}
    assert list(rows) == [(p, i) for p in ("fwd", "fwd+bwd") for i in ("xla", "mok", "mok-fp8")]
    assert len(quantized) == 1  # once for the model, outside every timed call
    assert set(calls) == {("mok", False), ("mok-fp8", False), ("mok-fp8", True)}  # E4M3 weights: mok-fp8 fwd only
    shape = acc.bench_shape(load_model("ci"), 2, "full")
    for p in ("fwd", "fwd+bwd"):
        bf16, fp8 = rows[p, "mok"], rows[p, "mok-fp8"]
        assert (bf16["status"], fp8["status"], bf16["dtype"], fp8["dtype"]) == ("ok", "ok", "bf16", "fp8")
        assert fp8["bf16_median_ms"] == bf16["median_ms"]
        assert fp8["speedup_vs_bf16"] == pytest.approx(bf16["median_ms"] / fp8["median_ms"])
        assert bf16["speedup_vs_bf16"] is None and rows[p, "xla"]["speedup_vs_bf16"] is None
        assert fp8["compute_floor_ms"] == pytest.approx(acc.compute_floor_ms(
            shape, 16, p, peak_tflops=805, precision="fp8", fp8_peak_tflops=1477))
        assert bf16["compute_floor_ms"] == pytest.approx(acc.flops_per_gpu(shape, 16, p) / 805e12 * 1e3)
        for r in (bf16, fp8):
            assert r["compute_fraction"] == pytest.approx(r["compute_floor_ms"] / r["median_ms"])
        # ci: H = 64, so an E4M3 row is 64 values + one f32 scale = 68 bytes against bf16's 128; k = 4
        assert fp8["dispatch_bytes_per_gpu"] == 16 * 4 * 68 and bf16["dispatch_bytes_per_gpu"] == 16 * 4 * 128
        assert fp8["comm_floor_ms"] / bf16["comm_floor_ms"] == pytest.approx(
            acc.link_bytes_per_row(64, p, "fp8") / acc.link_bytes_per_row(64, p))
    assert rows["fwd", "mok-fp8"]["fp8_weight_bytes_per_rank"] == acc.fp8_weight_bytes_per_rank(shape)
    assert rows["fwd", "mok"]["fp8_weight_bytes_per_rank"] is None
    captured = capsys.readouterr()
    assert "vs bf16" in captured.out.splitlines()[1]  # the table's header, under the CPU notice
    fp8_fwd = rows["fwd", "mok-fp8"]
    line = next(ln for ln in captured.out.splitlines() if " mok-fp8 " in ln and " fwd " in ln)
    assert report.fmt(fp8_fwd["speedup_vs_bf16"], ".2f") + "x" in line
    assert f", {fp8_fwd['speedup_vs_bf16']:.2f}x mok;" in captured.err  # the per-run line


def test_fill_fp8_ratios_pairs_the_same_kernel_and_the_tables_show_them():
    from mok_jax.bench import report

    base = dict.fromkeys(RESULT_KEYS)
    base.update(model="kimi-k2", ep_mode="E/32", tokens_per_gpu=2048, status="ok", baseline="mok", dtype="bf16",
                min_ms=0.5, max_ms=5.0)
    base["pass"] = "fwd"
    kernel = lambda g: dict(granularity=g, comm_items_fwd=16, comm_items_bwd=16, dispatch="pull", combine="push",
                            ring_slots=2)
    rows = [{**base, "impl": "mok", "kernel": kernel(512), "median_ms": 4.0},
            {**base, "impl": "mok", "kernel": kernel(1024), "median_ms": 3.0},
            {**base, "impl": "mok-fp8", "dtype": "fp8", "kernel": kernel(512), "median_ms": 2.0},
            {**base, "impl": "mok-fp8", "dtype": "fp8", "kernel": kernel(1024), "median_ms": 2.5},
            {**base, "impl": "mok-fp8", "dtype": "fp8", "kernel": kernel(2048), "median_ms": 1.0}]  # no bf16 twin
    report.fill_fp8_ratios(rows, fp8_impl="mok-fp8", reference="mok")
    assert [(r["bf16_median_ms"], r["speedup_vs_bf16"]) for r in rows] == [
        (None, None), (None, None), (4.0, 2.0), (3.0, 1.2), (None, None)]
    table = report.format_table(rows)
    assert "vs bf16" in table.splitlines()[0] and "vs bf16: the bf16 mok's median" in table
    assert "fp8 rows: the forward's routed GEMMs at the FP8 peak" not in table  # no roofline in these rows
    md = report.format_markdown(rows, peak_tflops=805)
    assert "| vs bf16 mok |" in md.splitlines()[0] and "| 2.00x |" in md
    bf16_only = [r for r in rows if r["impl"] == "mok"]
    assert "vs bf16" not in report.format_table(bf16_only) and "vs bf16" not in report.format_markdown(bf16_only)
    old = {k: v for k, v in bf16_only[0].items() if k not in ("bf16_median_ms", "speedup_vs_bf16")}
    assert "mok" in report.format_table([old])  # a report written before these keys still prints


def test_untuned_xla_is_warned_about(monkeypatch, capsys):
    """XLA_FLAGS that turn off XLA's GEMM autotuning (as gpu_tests.sh does) make the dense row and the XLA baselines
    untuned: mok-bench and the backward and training-step benches say so before they time, and say nothing for other
    flags."""
    from mok_jax.bench import backward, timing, train_step

    assert timing.untuned_xla_warning(None) is None
    assert timing.untuned_xla_warning("--xla_force_host_platform_device_count=8") is None
    assert timing.untuned_xla_warning("--xla_gpu_autotune_level=4") is None
    warning = timing.untuned_xla_warning("--xla_force_host_platform_device_count=8 --xla_gpu_autotune_level=0")
    assert warning is not None and "--xla_gpu_autotune_level=0" in warning and "dense" in warning
    assert warning.startswith("mok-bench: warning:")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    monkeypatch.setattr(cli, "run", lambda opts, argv: {"results": [{"status": "ok"}]})
    assert cli.main(["ci"]) == 0
    assert warning in capsys.readouterr().err
    # stopped at their "no kernels" exit (2), which comes after the warning, on any machine
    monkeypatch.setattr(timing, "kernels_unavailable", lambda: "stopped by the test")
    assert backward.main(["--model", "ci"]) == 2
    assert "mok_jax.bench.backward: warning: XLA_FLAGS" in capsys.readouterr().err
    assert train_step.main(["--model", "ci"]) == 2
    assert f"{train_step.PROG}: warning: XLA_FLAGS" in capsys.readouterr().err
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert backward.main(["--model", "ci"]) == 2
    assert "warning" not in capsys.readouterr().err
