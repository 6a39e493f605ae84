"""mok-bench --project (mok_jax.bench.project): the link model's bytes, its limits, the EP-2 check and the command
line. CPU only: the projection reads the committed results and runs nothing."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mok_jax.bench import accounting as acc
from mok_jax.bench import cli
from mok_jax.bench import project as P
from mok_jax.bench import project_report as PR
from mok_jax.bench.routing import make_routing

EPS = (1, 2, 4, 8, 16, 32, 64, 72)
WIRE = ("route_fwd", "dispatch", "combine", "post_fwd", "route_bwd", "share_bwd", "gather_bwd", "send_bwd",
        "shared_dw")
# Sampled distinct owners against the hypergeometric expectation: 2048 x 8 tokens of a uniform routing (the mean
# of 16384 per-token counts of spread ~1.1, so one standard error is about 0.01 rows)
SAMPLED_OWNERS_TOL = 0.03


@pytest.mark.parametrize("model", P.MODELS)
@pytest.mark.parametrize("rows", P.COMBINE_ROWS)
def test_comm_bytes_grow_with_ep(model, rows):
    per_ep = [P.traffic(model, ep, combine_rows=rows)["bytes"] for ep in EPS]
    for name in WIRE:
        seq = [b[name] for b in per_ep]
        assert all(a <= b for a, b in zip(seq, seq[1:])), (name, seq)
    assert per_ep[-1]["dispatch"] > per_ep[2]["dispatch"] > 0  # EP 72 moves more than EP 4


@pytest.mark.parametrize("L,k", [(6, 8), (4, 8), (8, 10), (6, 6), (1, 1), (2, 8)])
def test_per_slot_rows_at_least_per_owner(L, k):
    for ep in EPS:
        if k > ep * L:
            continue
        r = P.remote_rows(ep, L, k)
        assert r["per-slot"] >= r["per-owner"] - 1e-12
        assert 0 <= r["per-owner"] <= min(ep - 1, k)
        # the brief's with-replacement form is a lower bound of the distinct-expert count and close to it
        assert (ep - 1) * (1 - (1 - 1 / ep) ** k) <= r["per-owner"] + 1e-12
    for model in P.MODELS:
        for ep in EPS:
            b = {rows: P.traffic(model, ep, combine_rows=rows)["bytes"]["combine"] for rows in P.COMBINE_ROWS}
            assert b["per-slot"] >= b["per-owner"]


def test_per_owner_rows_match_a_sampled_uniform_routing():
    ep, L, k, T = 8, 6, 8, 2048
    idx, _ = make_routing("uniform", num_ranks=ep, tokens_per_rank=T, num_experts=ep * L, top_k=k, seed=3)
    t = acc.routing_traffic(idx, ep, L)
    r = P.remote_rows(ep, L, k)
    assert abs(t.sent_unique.mean() / T - r["per-owner"]) < SAMPLED_OWNERS_TOL
    assert abs(t.sent_slots.mean() / T - r["per-slot"]) < SAMPLED_OWNERS_TOL


@pytest.mark.parametrize("model", P.MODELS)
def test_ep1_has_no_communication(model):
    b = P.traffic(model, 1)["bytes"]
    assert all(b[name] == 0 for name in WIRE), b
    one = P.load_one_gpu(model)
    r = P.project(model, 1, P.H200_NVL8)
    for p, measured in (("fwd", one.fwd_ms), ("fwd_bwd", one.fwd_bwd_ms)):
        assert r[p]["low"] == pytest.approx(measured) and r[p]["high"] == pytest.approx(measured)
        assert r[p]["built"] == pytest.approx(measured)
    assert P.a2a_layer(model, 1, P.H200_NVL8)["a2a_ms"] == 0


def test_bounds_are_ordered_and_times_grow_with_ep():
    for model in P.MODELS:
        for machine in (P.H200_NVL8, P.NVL72):
            last = None
            for ep in EPS:
                r = P.project(model, ep, machine)
                if ep > machine.domain:
                    assert r["fwd"] is None and r["a2a"] is None and "NVLink domain" in r["note"]
                    continue
                for p in ("fwd", "fwd_bwd"):
                    assert r[p]["low"] <= r[p]["built"] + 1e-9 <= r[p]["high"] + 2e-9, (model, ep, p, r[p])
                if last is not None:
                    assert r["fwd_bwd"]["built"] >= last - 1e-9
                last = r["fwd_bwd"]["built"]


def test_per_slot_combine_costs_at_least_per_owner():
    for ep in (8, 64):
        a, b = (P.project("kimi-k2", ep, P.NVL72, combine_rows=rows) for rows in ("per-owner", "per-slot"))
        for p in ("fwd", "fwd_bwd"):
            assert all(b[p][k] >= a[p][k] - 1e-12 for k in ("low", "built", "high"))


def test_machine_ratios_scale_compute():
    base = P.project("kimi-k2", 8, P.H200_NVL8)
    same = P.project("kimi-k2", 8, dataclasses.replace(P.NVL72, compute_ratio=1.0, hbm_ratio=1.0, link_ratio=1.0))
    assert same["fwd_bwd"] == pytest.approx(base["fwd_bwd"])  # an NVL72 with the H200's rates is the H200
    fast = P.project("kimi-k2", 8, P.NVL72)
    assert fast["compute"]["fwd"] < base["compute"]["fwd"] / 2


def test_ep2_check_predicts_every_measurement():
    v = PR.validate()
    recs = v["comm_ops"]["records"]
    assert len(recs) == sum(len(json.load(open(P.RESULTS / f))["records"]) for f in P.COMM_JSONS.values())
    for r in recs:  # the model's remote bytes are the measured op's (every token needs the other rank at EP 2)
        assert r["model_bytes"] == pytest.approx(r["measured_remote_bytes"])
        assert r["x_link"] > 1  # the link model is a lower bound of every standalone op
    layers = v["layers"]
    assert {(r["model"], r["impl"], r["pass"]) for r in layers} >= {(m, i, p) for m in P.MODELS
                                                                     for i in ("xla", "xla-capacity")
                                                                     for p in ("fwd", "fwd+bwd")}
    s = v["layers_summary"]
    assert 0.85 < s["min"] and s["max"] < 1.15, s  # docs/projection.md: within 7% / 11% of the EP-2 layers


def test_cli_prints_the_tables_and_writes_json(capsys, tmp_path):
    out = tmp_path / "proj.json"
    assert cli.main(["--project", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for model in P.MODELS:
        assert f"\n{model}\n" in text
    assert "GB200/GB300-class NVL72" in text and "H200 NVL8" in text and "EP 2 check" in text
    assert "bf16 fwd 1.92x" in text  # the paper's figures beside the model's
    rep = json.loads(out.read_text())
    assert rep["schema"] == P.SCHEMA and rep["combine_rows"] == "per-slot"
    assert len(rep["rows"]) == len(P.MODELS) * len(P.EP_SIZES) * 2
    nvl72 = [r for r in rep["rows"] if r["machine"] == "nvl72"]
    assert all(r["fwd"] and np.isfinite(r["fwd_bwd"]["built"]) for r in nvl72)
    assert {a["name"] for a in rep["assumptions"]} >= {"link rate (low)", "NVL72 compute ratio"}


def test_cli_one_model_per_owner_markdown(capsys):
    assert cli.main(["--project", "--model", "kimi-k2", "--combine-rows", "per-owner", "--markdown"]) == 0
    text = capsys.readouterr().out
    assert "combine rows per-owner" in text and "| machine | EP |" in text and "\nglm-5\n" not in text


def test_cli_bad_usage_exits_2(capsys):
    assert cli.main(["--project", "--model", "ci"]) == 2  # no committed measurements of it
    assert "no committed one-GPU measurements of 'ci'" in capsys.readouterr().err
    assert cli.main(["--project", "--tune"]) == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["--project", "--combine-rows", "per-token"])  # argparse's own choices
    assert e.value.code == 2


def test_module_entry_without_a_gpu():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "mok_jax.bench", "--project", "--model", "kimi-k2"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "kimi-k2" in done.stdout and "fwd built" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "mok_jax.bench", "--project", "--combine-rows", "x"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "--combine-rows" in bad.stderr
