"""mok-bench's command line, JSON report, table, plot and profile, on CPU (tiny runs: 1 call per sample)."""

import json
import subprocess
import sys

import pytest

from mok_jax.bench import cli
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
    with pytest.raises(NotImplementedError, match="fp8 is not implemented yet"):
        cli.parse_args(["--dtype", "fp8"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--routing", "sorted"])  # argparse's own choices


def test_main_rejects_bad_options(capsys):
    assert cli.main(["--dtype", "fp8"]) == 2
    assert "not implemented yet" in capsys.readouterr().err
    assert cli.main(["--tokens", "0"]) == 2
    assert cli.main(["ci", "--ep-mode", "ep64-slice"]) == 2  # 16 experts: not a multiple of 64
    assert "not a multiple of 64" in capsys.readouterr().err


def test_mok_not_available_yet(capsys, cpu_devices):
    assert cli.main(["ci", "--impl", "mok,xla", "--tokens", "8", *FAST]) == 2
    assert "'mok' is not available yet" in capsys.readouterr().err


def test_list_models(capsys):
    assert cli.main(["--list-models"]) == 0
    out = capsys.readouterr().out
    assert "kimi-k2" in out and "deepseek-v4-pro" in out and "(in 'bench')" in out


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The CPU default (ci model, all 8 host devices, reference + xla + xla-capacity), both passes, with every
    output asked for."""
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
    assert rep["roofline"] == {"peak_tflops": 805.0, "nvlink_gbps": 394.0}
    cfg = rep["config"]
    assert cfg["models"] == ["ci"] and cfg["tokens"] == [32] and cfg["ep_mode"] == "full" and cfg["baseline"] == "xla"
    assert rep["command"][0] == "mok-bench"
    results = rep["results"]
    assert [(r["pass"], r["impl"]) for r in results] == [  # pass-major, the baseline first
        (p, i) for p in ("fwd", "fwd+bwd") for i in ("xla", "reference", "xla-capacity")]
    for r in results:
        assert tuple(r) == RESULT_KEYS  # every record has exactly the documented keys, in order
        assert r["status"] == "ok", r["error"]
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["samples"] == 2
        assert r["tflops"] == pytest.approx(r["flops_per_gpu"] / r["median_ms"] / 1e9)
        assert r["compute_fraction"] == pytest.approx(r["tflops"] / 805.0)
        assert r["comm_fraction"] == pytest.approx(r["comm_floor_ms"] / r["median_ms"])
        # ci: H 64, I 32, Is 48, k 4, T 32: fwd = 2*32*4*3*64*32 + 2*32*3*64*48 = 1572864 + 589824
        assert r["flops_per_gpu"] == (1572864 + 589824) * (1 if r["pass"] == "fwd" else 3)
        assert r["dispatch_bytes_per_gpu"] == 32 * 4 * 64 * 2
        assert r["remote_dispatch_bytes_per_gpu_uniform"] == 32 * 4 * 64 * 2 * 7 / 8
    base = {r["pass"]: r["median_ms"] for r in results if r["impl"] == "xla"}
    for r in results:
        assert r["speedup_vs_baseline"] == pytest.approx(base[r["pass"]] / r["median_ms"])
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
    assert out.count("CPU NUMBERS") == 2  # above and below the table
    assert cli.main(["--from-json", str(paths["json"]), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| ci | full | 32 | fwd+bwd | `xla-capacity` |" in out and "CPU NUMBERS" in out


def test_ragged_fails_gracefully_on_cpu(tmp_path, cpu_devices):
    # XLA:CPU has no ragged-all-to-all: the run is recorded as an error, the baseline still runs
    out = tmp_path / "r.json"
    assert cli.main(["ci", "--impl", "ragged", "--baseline", "xla", "--tokens", "8", "--devices", "2", "--json",
                     str(out), "-q", *FAST]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["impl"], r["status"]) for r in results] == [("xla", "ok"), ("ragged", "error")]
    assert "ragged" in results[1]["error"].lower() and results[1]["median_ms"] is None


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
