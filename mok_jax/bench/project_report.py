"""``mok-bench --project``'s check, assumptions and output: the model of mok_jax.bench.project against every real
multi-GPU measurement there is (EP 2 only: ``validate()`` says how far off it is), the assumptions it rests on, the
tables and the JSON report.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib
import statistics
from typing import Any

from mok_jax.bench.project import (BREAKDOWN_JSON, COMM_ITEMS, COMM_JSONS, EP1_LAYER_JSONS, EP2_LAYER_JSONS, EP_SIZES,
                                   FWD_BWD_JSON, FWD_JSON, GRANULARITIES, H200_NVL8, ITEMS_JSON, MACHINES, MODELS, NVL72,
                                   PAPER_EP64, SCHEMA, SM_LOAD_GBPS, SM_PEER_GBPS, SM_STORE_GBPS, SWEEP_JSON, TOKENS,
                                   Rates, _load, _result, _xla_ms, load_one_gpu, load_rates, project, remote_rows)

__all__ = ["assumptions", "format_table", "format_validation", "main", "report", "validate"]


# ----------------------------------------------------------------------------------------------- validation (EP 2)

def _op_rows(rec: dict, T: int, k: int, L: int, ep: int) -> tuple[float, float, float]:
    """(local rows stored, local rows loaded, rows over the link) per GPU of one standalone op of comm_ep2.md, as
    its floors table counts them: U rows a token's remote owner needs, X = T k expanded slot rows an owner holds,
    own = its own tokens with a local slot, P padding rows of the zeroed expert-major output."""
    rows = remote_rows(ep, L, k)
    U, X = T * rows["per-owner"], T * k
    own = T * (1 - math.comb(ep * L - L, k) / math.comb(ep * L, k))
    P = ep * T * L - X if rec.get("zero_padding") else 0.0
    op, mode, token_major = rec["op"], rec["mode"], rec.get("note") == "token_major"
    if op == "dispatch" and token_major:
        return (U + own + U, U + own, U) if mode == "pull" else (own + U, own + 2 * U, U)
    if op == "dispatch":
        return (U + X + P, U + own, U) if mode == "pull" else (X + P, own + 2 * U, U)
    if op == "combine":
        return (own + T, X + own + U, U) if mode == "push" else (own + U + T, X + own, U)
    return 0.0, 0.0, U  # xla_all_to_all: the rows themselves


def _comm_predictions(rec: dict, rates: Rates, H: int, k: int, L: int, ep: int) -> dict[str, float]:
    row = 2 * H
    st, ld, remote = _op_rows(rec, rec["tokens"], k, L, ep)
    link_us = remote * row / rates.link_gbps / 1e3
    out = {"link_us": link_us, "model_bytes": remote * row}
    if rec["op"] != "xla_all_to_all":
        n = rec["num_sms"]
        out["roofline_us"] = max(st * row / (n * SM_STORE_GBPS), ld * row / (n * SM_LOAD_GBPS),
                                 remote * row / min(n * SM_PEER_GBPS, rates.link_gbps)) / 1e3
    else:
        out["fit_us"] = rates.xla_latency_us + remote * row / rates.xla_gbps / 1e3
    return out


def _family(rec: dict) -> str:
    if rec["op"] == "xla_all_to_all":
        return "xla all_to_all"
    variant = "token-major" if rec.get("note") == "token_major" else (
        "expert-major, zeroed padding" if rec.get("zero_padding") else "expert-major, no padding")
    return f"{rec['op']} {rec['mode']}" + ("" if rec["op"] == "combine" else f" ({variant})")


def _summary(ratios: list[float]) -> dict[str, float]:
    return {"n": len(ratios), "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def validate_comm_ops(root: pathlib.Path | None = None, rates: Rates | None = None) -> dict[str, Any]:
    """Every standalone dispatch / combine / XLA all_to_all record on two H200s, predicted: the link model (remote
    bytes over the link rate, what the projection's "low" uses), and a roofline with the per-SM ceilings of run 4's
    microbenchmark; measured / predicted per record and per family."""
    rates = rates or load_rates(root)
    records, families = [], {}
    for run, name in COMM_JSONS.items():
        d = _load(name, root)
        meta = d["meta"]
        ep = int(meta.get("num_devices", 2))
        H, k, E = meta["hidden"], meta["top_k"], meta["experts"]
        L = E // ep
        for rec in d["records"]:
            p = _comm_predictions(rec, rates, H, k, L, ep)
            row = {"run": run, "family": _family(rec), "tokens": rec["tokens"], "num_sms": rec.get("num_sms"),
                   "measured_us": rec["time_us"], "measured_remote_bytes": rec["remote_bytes_per_gpu"], **p,
                   "x_link": rec["time_us"] / p["link_us"]}
            if "roofline_us" in p:
                row["x_roofline"] = rec["time_us"] / p["roofline_us"]
            if "fit_us" in p:
                row["x_fit"] = rec["time_us"] / p["fit_us"]
            records.append(row)
            families.setdefault((run, row["family"]), []).append(row)
    fam = []
    for (run, family), rows in families.items():
        entry = {"run": run, "family": family, "link": _summary([r["x_link"] for r in rows])}
        for key in ("x_roofline", "x_fit"):
            if key in rows[0]:
                entry[key[2:]] = _summary([r[key] for r in rows])
        fam.append(entry)
    return {"records": records, "families": fam}


def validate_layers(root: pathlib.Path | None = None, rates: Rates | None = None) -> list[dict]:
    """The two XLA baseline layers on two H200s (comm_ep2/baselines), predicted as this model predicts its a2a layer:
    the same implementation's one-GPU time (same problem: E/32 experts on one GPU; the same code's form of the same
    days) plus its all_to_alls (two forward, two more backward; the rows it really sends: capacity-padded for
    xla-capacity, T per expert for xla) at the fitted XLA rate, plus the shared expert's weight-gradient all-reduce
    in fwd+bwd."""
    from mok_jax.config import load_model

    rates = rates or load_rates(root)
    ep1 = {p: [_load(n, root) for n in names] for p, names in EP1_LAYER_JSONS.items()}
    out = []
    for name in EP2_LAYER_JSONS:
        for r in _load(name, root)["results"]:
            if r.get("status") != "ok" or r["impl"] not in ("xla", "xla-capacity"):
                continue
            base = next((x for rep in ep1[r["pass"]] if (x := _result(rep, r["model"], r["impl"], r["pass"],
                                                                       r["tokens_per_gpu"]))), None)
            if base is None:
                continue
            m, T, L, ep = load_model(r["model"]), r["tokens_per_gpu"], r["experts_per_gpu"], r["num_gpus"]
            slots = r["capacity"] if r["impl"] == "xla-capacity" else T  # rows per (source rank, expert)
            per_a2a = (ep - 1) * L * slots * 2 * m.hidden_size
            n = 2 if r["pass"] == "fwd" else 4
            comm = n * _xla_ms(per_a2a, rates, 1.0)
            if r["pass"] != "fwd":
                comm += _xla_ms(2 * (ep - 1) / ep * 3 * m.hidden_size * m.shared_size * 2, rates, 1.0)
            pred = base["median_ms"] + comm
            out.append({"file": name, "model": r["model"], "impl": r["impl"], "pass": r["pass"], "tokens": T,
                        "ep1_ms": base["median_ms"], "comm_ms": comm, "predicted_ms": pred,
                        "measured_ms": r["median_ms"], "x": r["median_ms"] / pred,
                        "x_comm": (r["median_ms"] - base["median_ms"]) / comm})
    return out


def validate(root: pathlib.Path | None = None) -> dict[str, Any]:
    rates = load_rates(root)
    layers = validate_layers(root, rates)
    return {"comm_ops": validate_comm_ops(root, rates), "layers": layers,
            "layers_summary": _summary([r["x"] for r in layers]) if layers else None}


# ----------------------------------------------------------------------------------------------- output

def assumptions(rates: Rates | None = None) -> list[dict[str, Any]]:
    """Every assumption of the model, with its number and where it comes from."""
    rates = rates or load_rates()
    return [
        {"name": "problem", "value": f"ep64-slice: E/64 experts per rank, {TOKENS} tokens per rank, uniform routing, "
         "bf16", "source": "mok_jax.bench.problems; the paper's EP-64 setting"},
        {"name": "compute per rank", "value": "the one-H200 time of the same per-rank FLOPs (E/32 experts: twice "
         "the rows per expert at EP > 1, so a conservative figure), independent of the EP size",
         "source": f"{FWD_JSON}, {FWD_BWD_JSON}"},
        {"name": "memory-bound share", "value": "forward: mok - grouped FFN - shared FFN; backward: gather + slot sum "
         "of the items' ms per SM", "source": f"{BREAKDOWN_JSON}, {ITEMS_JSON}"},
        {"name": "link rate (low)", "value": f"{rates.link_gbps:.1f} GB/s per direction", "source":
         rates.sources["link_gbps"]},
        {"name": "row-mover rates (high)", "value": f"pull {rates.pull_gbps:.1f}, push {rates.push_gbps:.1f} GB/s "
         "per direction, on every machine", "source": f"{rates.sources['pull_gbps']}; {rates.sources['push_gbps']}"},
        {"name": "granularity (built)", "value": f"the best of {', '.join(map(str, GRANULARITIES))}; the routed "
         "compute's cost of smaller microbatches by rows per expert and microbatch", "source": SWEEP_JSON},
        {"name": "XLA collectives", "value": f"{rates.xla_latency_us:.1f} us + bytes at {rates.xla_gbps:.1f} GB/s",
         "source": rates.sources["xla"]},
        {"name": "local copies (POST, SHARE)", "value": f"{COMM_ITEMS} SMs x {SM_STORE_GBPS} GB/s",
         "source": "comm_ep2.md, run 4's per-SM microbenchmark"},
        {"name": "knobs at EP > 1", "value": "the H200 tuned entry of the one-GPU problem (24 comm items; "
         "granularity 2048, glm-5 1024)", "source": "configs/tuned/nvidia-h200/kernel.toml"},
        {"name": "per-owner rows", "value": "(ep-1)(1 - C(ep L - L, k)/C(ep L, k)) per token", "source":
         "k distinct experts, uniform"},
        {"name": "NVL72 compute ratio", "value": f"{NVL72.compute_ratio:g} (GEMMs), HBM {NVL72.hbm_ratio:.2f}",
         "source": NVL72.sources[0]},
        {"name": "NVL72 link ratio", "value": f"{NVL72.link_ratio:g} (link and XLA rates; high: 1)",
         "source": "NVLink 5 vs NVLink 4 per-GPU bandwidth"},
        {"name": "H200 NVL8 past EP 8", "value": "not projected", "source": "the kernels need load/store access to "
         "every peer: one NVLink domain (docs/design.md)"},
    ]


def _f(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows: list[dict], *, markdown: bool = False) -> str:
    """The projection table: per (machine, EP), the forward's remote MB per rank (routing, dispatch, combine) and
    per peer (dispatch + combine), the built forward's microbatch G, mok fwd and fwd+bwd (low / built / high), the
    a2a layer and its ratio to mok's built figure (the backward's: fwd+bwd less fwd), and mok_jax.memory's GB."""
    head = ["machine", "EP", "fwd MB", "MB/peer", "G", "fwd low", "fwd built", "fwd high", "f+b low", "f+b built",
            "f+b high", "a2a fwd", "a2a f+b", "a2a/mok fwd", "a2a/mok bwd", "GB/rank"]
    body = []
    for r in rows:
        b = r["bytes"]
        fwd_mb = (b["route_fwd"] + b["dispatch"] + b["combine"]) / 1e6
        per_peer = (b["dispatch"] + b["combine"]) / max(r["ep"] - 1, 1) / 1e6
        cells = [MACHINES[r["machine"]].label, str(r["ep"]), f"{fwd_mb:.0f}", f"{per_peer:.1f}",
                 str(r.get("built_granularity") or "-")]
        for p in ("fwd", "fwd_bwd"):
            cells += [_f(r[p] and r[p][k]) for k in ("low", "built", "high")]
        a = r["a2a"] or {}
        x = r.get("a2a_over_mok") or {}
        cells += [_f(a.get("fwd")), _f(a.get("fwd_bwd")), _f(x.get("fwd"), ".2f") + ("x" if x else ""),
                  _f(x.get("bwd"), ".2f") + ("x" if x else ""), f"{r['memory_gb']:.1f}" + (
                      "*" if r["backward_refused_today"] else "")]
        body.append(cells)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "| --- |" + " --: |" * (len(head) - 1)]
        lines += ["| " + " | ".join(c) + " |" for c in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in body)) if body else len(h) for i, h in enumerate(head)]

    def fmt_row(cs):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cs, widths)))

    return "\n".join([fmt_row(head), *(fmt_row(c) for c in body)])


def format_validation(v: dict) -> str:
    lines = ["EP 2 check: measured / predicted (1.00 = exact; > 1: the model is optimistic)",
             "  standalone ops on two H200s (comm_ep2/comm*.json): link model | per-SM roofline (median, range)"]
    for f in v["comm_ops"]["families"]:
        s = f["link"]
        other = f.get("roofline") or f.get("fit")
        label = "roofline" if "roofline" in f else "XLA fit (in-sample)"
        lines.append(f"    {f['run']:<30} {f['family']:<44} n={s['n']:<3} link {s['median']:.2f} "
                     f"({s['min']:.2f}-{s['max']:.2f}) | {label} {other['median']:.2f} "
                     f"({other['min']:.2f}-{other['max']:.2f})")
    lines.append("  XLA baseline layers on two H200s (comm_ep2/baselines): one-GPU time + all_to_alls at the XLA fit")
    for r in v["layers"]:
        lines.append(f"    {r['model']:<18} {r['impl']:<13} {r['pass']:<8} T={r['tokens']:<6} EP-1 {r['ep1_ms']:7.2f}"
                     f" + comm {r['comm_ms']:5.2f} = {r['predicted_ms']:7.2f} ms, measured {r['measured_ms']:7.2f}"
                     f" ({r['x']:.2f}; measured - EP-1 over comm {r['x_comm']:.2f})")
    if v["layers_summary"]:
        s = v["layers_summary"]
        c = _summary([r["x_comm"] for r in v["layers"]])
        lines.append(f"    layers: median {s['median']:.2f}, range {s['min']:.2f}-{s['max']:.2f} over {s['n']}; "
                     f"their comm alone: median {c['median']:.2f}, range {c['min']:.2f}-{c['max']:.2f}")
    return "\n".join(lines)


def report(models=MODELS, *, eps=EP_SIZES, machines=(H200_NVL8, NVL72), combine_rows: str = "per-slot",
           root: pathlib.Path | None = None) -> dict[str, Any]:
    """Every projection row, the assumptions, the validation and the paper's figures, as the JSON holds them."""
    rates = load_rates(root)
    rows = []
    for model in models:
        one = load_one_gpu(model, root)
        rows += [project(model, ep, m, combine_rows=combine_rows, rates=rates, one=one) for m in machines
                 for ep in eps]
    return {"schema": SCHEMA, "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "combine_rows": combine_rows, "tokens": TOKENS, "eps": list(eps),
        "rates": dataclasses.asdict(rates), "machines": {m.name: dataclasses.asdict(m) for m in machines},
        "assumptions": assumptions(rates), "rows": rows, "validation": validate(root), "paper": PAPER_EP64}


def main(opts) -> int:
    """``mok-bench --project``: print the tables of ``opts.models`` (default MODELS), the paper's figures and the
    EP-2 check; write the JSON with ``opts.json``. ValueError (exit 2) for a model without measurements."""
    names = []
    for n in opts.models or MODELS:
        names += list(MODELS) if n == "bench" else [n]
    for n in names:
        if n not in MODELS:
            raise ValueError(f"--project: no committed one-GPU measurements of {n!r}; the projection covers "
                             f"{', '.join(MODELS)}")
    rep = report(tuple(dict.fromkeys(names)), combine_rows=opts.combine_rows)
    print(f"mok-bench --project: per-rank ms of one layer call, ep64-slice, {TOKENS} tokens per rank, uniform "
          f"routing, bf16, combine rows {opts.combine_rows} (a projection from H200 measurements, not a measurement;"
          f" docs/projection.md)")
    print("low: perfect overlap at the link rate; built: the kernels' item order at the link rate (best "
          "granularity); high: nothing overlapped, at the rates the project's row movers measured on two H200s. "
          "* = today's backward op refuses this size (32-bit offsets); '-' past the machine's NVLink domain.")
    for model in dict.fromkeys(names):
        print(f"\n{model}")
        print(format_table([r for r in rep["rows"] if r["model"] == model], markdown=opts.markdown))
    ep64 = {(r["model"], r["machine"]): r for r in rep["rows"] if r["ep"] == 64}
    print(f"\npaper ({PAPER_EP64['setting']}): bf16 fwd {PAPER_EP64['bf16_fwd']}x, bwd "
          f"{PAPER_EP64['bf16_bwd']}x; mxfp8 fwd {PAPER_EP64['mxfp8_fwd']}x, bwd {PAPER_EP64['mxfp8_bwd']}x")
    for (model, machine), r in ep64.items():
        if r.get("a2a_over_mok"):
            x = r["a2a_over_mok"]
            print(f"this model at EP 64, {MACHINES[machine].label}, {model}: a2a layer / mok built: fwd "
                  f"{x['fwd']:.2f}x, bwd {x['bwd']:.2f}x")
    print()
    print(format_validation(rep["validation"]))
    if opts.json:
        path = pathlib.Path(opts.json)
        path.write_text(json.dumps(rep, indent=1) + "\n")
        print(f"\nmok-bench: JSON written to {path}")
    return 0
