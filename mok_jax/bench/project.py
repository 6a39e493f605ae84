"""A projection of the layer's per-rank time at EP 8 to 72 (issue 36, part 4): ``mok-bench --project``.

Nothing here runs on a GPU or measures anything. Every figure is built from measurements committed under
benchmarks/results/ (one H200; the standalone dispatch/combine and the XLA baselines on two H200s) and from the
assumptions named in ``assumptions()``; docs/projection.md gives the formulas and the sources.

Per rank, for a model's ep64-slice problem (L = E/64 routed experts per rank, T = 2048 tokens per rank, uniform
routing) at EP size ``ep`` on a ``Machine``:

- **compute**: the measured one-GPU time of the same per-rank work (mok fwd and fwd+bwd, E/32 experts, 2048
  tokens: ``OneGpu``), split into GEMM time and memory-bound time by the committed per-item figures (the forward's
  breakdown, the backward's ms per SM per kind of item); a machine scales the first by its compute ratio and the
  second by its HBM ratio.
- **communication**: bytes per rank and direction under uniform routing (``traffic``): the routing exchange, the
  dispatch rows (one per token and remote owner rank, as the kernel pulls them), the combine rows (``combine_rows``:
  "per-owner", one per token and remote owner, or "per-slot", one per token and remote slot), the backward's x and
  dy rows (one per remote slot row), its dx rows, the routing all-gather and the shared expert's weight-gradient
  all-reduce; divided by a rate per direction.
- **overlap**: three figures per pass. ``low``: perfect overlap at the link rate, max(compute, comm). ``built``:
  the item order the kernels have today (the forward's microbatch pipeline at the best granularity, its cost per
  microbatch size from the measured granularity sweep; the backward exposes its gathers and sends) at the link
  rate. ``high``: nothing overlapped, every transfer at the rate the project's own row movers reached on two H200s
  (pulls at the token-major dispatch's, pushes at the combine's).

Beside it: an all-to-all + grouped-GEMM layer (``a2a_layer``: two XLA all_to_alls per direction at the measured
XLA rate, nothing overlapped, its GEMMs at the measured dense rate), and the paper's EP-64 figures (``PAPER_EP64``).
``validate()`` predicts every real multi-GPU measurement there is (EP 2 only) and says how far off it is.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import pathlib
import statistics
from typing import Any

import numpy as np

__all__ = ["COMBINE_ROWS", "EP_SIZES", "H200_NVL8", "MACHINES", "MODELS", "NVL72", "PAPER_EP64", "SCHEMA", "TOKENS",
           "Machine", "OneGpu", "Rates", "a2a_layer", "assumptions", "format_table", "format_validation",
           "granularity_cost", "load_one_gpu", "load_rates", "main", "project", "remote_rows", "report", "traffic",
           "validate"]

SCHEMA = "mok-bench-projection/1"
RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MODELS = ("kimi-k2", "glm-5", "qwen3.5-397b-a17b", "deepseek-v4-pro")  # every measured input exists for these
EP_SIZES = (8, 16, 32, 64, 72)
COMBINE_ROWS = ("per-owner", "per-slot")
TOKENS = 2048  # tokens per rank of every one-GPU measurement used (the paper's 2,048 tokens per GPU)
SLICE_EP = 64  # the ep64-slice: L = E/64 experts per rank at every EP size
ROUTE_BYTES = 8  # a slot's routing as the ranks exchange it: int32 id + f32 weight
DW_BYTES = 4  # the backward's f32 d topk_weight per slot row
GROUP_ALIGN = 128  # EXPERTS_BACKWARD_GROUP_ALIGN: the backward layout's M = ep T k + 128 L rows

# The files the measured inputs come from (under RESULTS).
FWD_JSON = "training_h200/headline_fwd.json"  # mok and dense fwd, one H200, E/32, T 2048 (eighteenth session)
FWD_BWD_JSON = "training_h200/headline_fwd_bwd.json"  # the same, fwd+bwd
BREAKDOWN_JSON = "moe_forward_h200/breakdown.json"  # the forward's parts: grouped FFN, shared FFN, row moves twice
ITEMS_JSON = "moe_backward_h200/where_session18.json"  # the backward's ms per SM per kind of item (kept g, u)
COMM_JSONS = {"run 3": "comm_h200x2.json", "run 2": "comm_h200x2_run2.json",
              "run 4 (bulk movers, reverted)": "comm_h200x2_run4_bulk.json"}
EP2_LAYER_JSONS = ("baselines_h200x2/headline.json", "baselines_h200x2/sweep.json")
EP1_LAYER_JSONS = {"fwd": ("moe_forward_h200/headline.json", "moe_forward_h200/sweep.json"),
                   "fwd+bwd": ("moe_backward_h200/train.json",)}

# Measured on the 2-GPU H200 machine (HARDWARE.md; comm_h200x2.md): copy-engine peer copies, and the per-SM ceilings
# of run 4's microbenchmark ("registers" rows), used only by the EP-2 validation's roofline of the standalone ops.
P2P_ONE_WAY_GBPS = 394.0  # GPU0 -> GPU1, one direction
P2P_BOTH_TOTAL_GBPS = 563.0  # both directions at once, total: 281.5 per direction
SM_STORE_GBPS = 62.6  # 16-byte stores to local HBM per SM (24 SMs)
SM_LOAD_GBPS = 62.3  # 16-byte register loads from local HBM per SM (24 SMs)
SM_PEER_GBPS = 26.2  # register loads from the peer per SM (8 SMs; the link caps the total)
# the project's own row movers at 24 SMs and 4096 tokens (run 3): a pull of one row per (token, owner), and the
# combine's push of one pre-summed row per (token, owner), each with its staging, schedule and launch
PULL_RECORD = {"op": "dispatch", "mode": "pull", "note": "token_major", "tokens": 4096, "num_sms": 24}
PUSH_RECORD = {"op": "combine", "mode": "push", "tokens": 4096, "num_sms": 24}
COMM_SMS = 24  # comm_sms_fwd and comm_sms_bwd of every tuned H200 entry; the mover rates above are at 24 SMs
SWEEP_JSON = "moe_forward_h200/sweep.json"  # mok fwd of kimi-k2 at 16384 tokens, granularity 512..8192, one H200
GRANULARITIES = (2048, 1024, 512)  # what the tuner may pick at T = 2048 (multiples of 64, >= 512)

# The Mixture-of-Kittens paper's EP-64 layer figures, as the project's summary of it gives them (the shared seed,
# section 4.1, Figure 7): speedups over the fastest publicly available baseline, "reaching" these, at EP 64 and 2,048
# tokens per GPU before dispatch, on the paper's Blackwell NVL72 machines. No absolute times are in the summary.
PAPER_EP64 = {"source": "Mixture-of-Kittens summary (shared seed), section 4.1, Figure 7",
              "setting": "EP 64, 2048 tokens per GPU, over the fastest public baseline, up to",
              "bf16_fwd": 1.92, "bf16_bwd": 1.58, "mxfp8_fwd": 2.37, "mxfp8_bwd": 1.78}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Machine:
    """A machine profile: its NVLink domain and its rates relative to the measured H200 ones.

    compute_ratio: GEMM time on an H200 over GEMM time here; hbm_ratio: the same for memory-bound work;
    link_ratio: the link's and XLA's collective rates here over the H200's measured ones (the "high" bound keeps the
    H200's measured mover and XLA rates on every machine)."""

    name: str
    label: str
    domain: int
    compute_ratio: float
    hbm_ratio: float
    link_ratio: float
    sources: tuple[str, ...] = ()


H200_NVL8 = Machine(name="h200-nvl8", label="H200 NVL8", domain=8, compute_ratio=1.0, hbm_ratio=1.0, link_ratio=1.0,
                    sources=("measured on one and two H200s (benchmarks/results/)",))
NVL72 = Machine(
    name="nvl72", label="GB200/GB300-class NVL72", domain=72,
    compute_ratio=2.5,  # dense BF16 2.5 PFLOP/s per NVL72 GPU (rack: 180 dense / 72; a 1 kW B200: 2.25) vs 0.989
    hbm_ratio=8.0 / 4.8,  # HBM3e 8 TB/s per GPU (576 TB/s per rack / 72) vs the H200's 4.8 TB/s
    link_ratio=2.0,  # NVLink 5: 1.8 TB/s per GPU (900 GB/s per direction), twice NVLink 4's 900 GB/s (450)
    sources=("NVIDIA GB200 NVL72 and GB300 NVL72 specifications (per rack: 72 GPUs, 130 TB/s NVLink, 576 TB/s HBM, "
             "360 PFLOP/s BF16 with sparsity); NVIDIA H200 SXM specification (989 TFLOP/s dense BF16, 4.8 TB/s, "
             "NVLink 900 GB/s)",))
MACHINES = {m.name: m for m in (H200_NVL8, NVL72)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rates:
    """The H200 rates the model divides bytes by, GB/s per GPU per direction (both directions busy at once)."""

    link_gbps: float  # copy-engine peer copy in both directions, per direction
    pull_gbps: float  # the project's own SM-driven row movers at 24 SMs, EP 2: token-major pull dispatch
    push_gbps: float  # and combine push
    xla_latency_us: float  # XLA all_to_all on two H200s: t = latency + bytes / xla_gbps (least squares)
    xla_gbps: float
    sources: dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneGpu:
    """The measured one-H200 times of a model's per-rank work (E/32 experts = 2 L, T tokens), ms, and the shares
    of memory-bound work that the per-item figures give."""

    model: str
    tokens: int
    experts: int
    fwd_ms: float
    fwd_bwd_ms: float
    dense_fwd_ms: float
    dense_fwd_bwd_ms: float
    fwd_mem_share: float  # (mok - grouped FFN alone - shared FFN alone) / mok: dispatch, combine, schedule
    shared_share: float  # shared FFN alone / mok: the compute the first dispatch window can hide
    dispatch_share: float  # (mok with dispatch rows twice - mok) / mok: the EP-1 dispatch window's copy
    bwd_mem_share: float  # (gather + slot sum) / every kind, ms per SM of the backward kernel (kept g, u)
    sources: dict

    @property
    def bwd_ms(self) -> float:
        return self.fwd_bwd_ms - self.fwd_ms


def _load(name: str, root: pathlib.Path | None = None) -> dict:
    """A committed result file, parsed once per process (read only: callers do not modify it)."""
    return _read(str((root or RESULTS) / name))


@functools.lru_cache(maxsize=32)
def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"mok-bench --project reads the committed results; cannot read {path}: {e.strerror}"
                         f" (run it from a checkout of the repository)") from None


def _result(report: dict, model: str, impl: str, pass_: str, tokens: int | None = None) -> dict | None:
    for r in report["results"]:
        if (r["model"], r["impl"], r["pass"]) == (model, impl, pass_) and r.get("status") == "ok" and (
                tokens is None or r["tokens_per_gpu"] == tokens):
            return r
    return None


def load_one_gpu(model: str, root: pathlib.Path | None = None) -> OneGpu:
    """The committed one-H200 measurements of ``model`` (one of MODELS). ValueError for another model."""
    if model not in MODELS:
        raise ValueError(f"--project: no committed one-GPU measurements of {model!r}; the projection covers "
                         f"{', '.join(MODELS)}")
    fwd, fb = _load(FWD_JSON, root), _load(FWD_BWD_JSON, root)
    rows = {}
    for label, rep, impl, pass_ in (("fwd", fwd, "mok", "fwd"), ("fwd+bwd", fb, "mok", "fwd+bwd"),
                                    ("dense fwd", fwd, "dense", "fwd"), ("dense fwd+bwd", fb, "dense", "fwd+bwd")):
        r = _result(rep, model, impl, pass_, TOKENS)
        if r is None:
            raise ValueError(f"--project: {model} {impl} {pass_} at {TOKENS} tokens is missing from the results")
        rows[label] = r
    _, L = _shape(model)
    if rows["fwd"]["experts_per_gpu"] != 2 * L:  # the one-GPU problem is two ranks' experts: E/32
        raise ValueError(f"--project: {FWD_JSON} has {model} at {rows['fwd']['experts_per_gpu']} experts, not E/32")
    case = next(c for c in _load(BREAKDOWN_JSON, root)["cases"] if c["model"] == model)
    b = {k: v["ms"] for k, v in case["rows"].items()}
    items = next(c for c in _load(ITEMS_JSON, root)["cases"] if c["model"] == model)["items kept"]
    busy = {k: v["busy_ms"] for k, v in items.items()}
    return OneGpu(
        model=model, tokens=TOKENS, experts=rows["fwd"]["experts_per_gpu"], fwd_ms=rows["fwd"]["median_ms"],
        fwd_bwd_ms=rows["fwd+bwd"]["median_ms"], dense_fwd_ms=rows["dense fwd"]["median_ms"],
        dense_fwd_bwd_ms=rows["dense fwd+bwd"]["median_ms"],
        fwd_mem_share=max(0.0, b["mok"] - b["grouped FFN"] - b["shared FFN"]) / b["mok"],
        shared_share=b["shared FFN"] / b["mok"],
        dispatch_share=max(0.0, b["dispatch rows twice"] - b["mok"]) / b["mok"],
        bwd_mem_share=(busy["gather"] + busy["slot sum"]) / sum(busy.values()),
        sources={"fwd, dense fwd": FWD_JSON, "fwd+bwd, dense fwd+bwd": FWD_BWD_JSON,
                 "fwd shares": BREAKDOWN_JSON, "bwd memory share": ITEMS_JSON + " (items kept)"})


def _xla_fit(records: list[dict]) -> tuple[float, float]:
    """(latency us, GB/s) of t = latency + bytes / rate, least squares over XLA all_to_all records."""
    b = np.array([r["remote_bytes_per_gpu"] for r in records], float)
    t = np.array([r["time_us"] for r in records], float)
    (lat, slope), *_ = np.linalg.lstsq(np.stack([np.ones_like(b), b], 1), t, rcond=None)
    return float(lat), float(1e-3 / slope)  # bytes per us -> GB/s


def load_rates(root: pathlib.Path | None = None) -> Rates:
    """The H200 rates: the peer copies of HARDWARE.md, the mover and XLA rates from comm_h200x2.json (run 3)."""
    recs = _load(COMM_JSONS["run 3"], root)["records"]
    pick = lambda want: next(r for r in recs if all(r.get(k) == v for k, v in want.items()))  # noqa: E731
    lat, gbps = _xla_fit([r for r in recs if r["op"] == "xla_all_to_all"])
    return Rates(link_gbps=P2P_BOTH_TOTAL_GBPS / 2, pull_gbps=pick(PULL_RECORD)["gbps"],
                 push_gbps=pick(PUSH_RECORD)["gbps"], xla_latency_us=lat, xla_gbps=gbps,
                 sources={"link_gbps": "HARDWARE.md: peer copy both directions at once, 563 GB/s total",
                          "pull_gbps": f"{COMM_JSONS['run 3']}: token-major pull dispatch, 24 SMs, 4096 tokens",
                          "push_gbps": f"{COMM_JSONS['run 3']}: combine push, 24 SMs, 4096 tokens",
                          "xla": f"{COMM_JSONS['run 3']}: xla_all_to_all, 512..16384 rows, least squares"})


def granularity_cost(rows_per_expert: float, reference_rows: float, root: pathlib.Path | None = None) -> float:
    """The forward's time at ``rows_per_expert`` rows per expert and microbatch over its time at
    ``reference_rows``, from the measured granularity sweep (kimi-k2, 16384 tokens, 12 experts: G k / 12 rows),
    interpolated in log rows and clamped to the sweep's ends; never below 1 (no credit for bigger groups)."""
    recs = [r for r in _load(SWEEP_JSON, root)["results"] if r["impl"] == "mok" and r.get("status") == "ok"
            and r["kernel"]["granularity"] < r["tokens_per_gpu"]]  # one microbatch measures exposure, not size
    pts = sorted((r["kernel"]["granularity"] * r["top_k"] / r["experts_per_gpu"], r["median_ms"]) for r in recs)
    x, y = np.log([p[0] for p in pts]), [p[1] for p in pts]
    at = lambda rows: float(np.interp(math.log(rows), x, y))  # noqa: E731
    return max(1.0, at(rows_per_expert) / at(reference_rows))


def remote_rows(ep: int, local_experts: int, top_k: int) -> dict[str, float]:
    """Expected rows per token that cross to other ranks under uniform routing (k distinct experts of ep L):
    per-slot k (ep-1)/ep; per-owner (ep-1) (1 - C(ep L - L, k) / C(ep L, k)), the remote ranks owning at least
    one of the token's experts (the same with replacement, (ep-1) (1 - (1-1/ep)^k), is within 7% at ep >= 8).
    At ep 1 nothing crosses (the limit: every expert is local, as in the measured one-GPU problem)."""
    if ep < 1 or local_experts < 1 or top_k < 1:
        raise ValueError(f"remote_rows: need ep, L, k >= 1, got ep={ep}, L={local_experts}, k={top_k}")
    if ep == 1:
        return {"per-slot": 0.0, "per-owner": 0.0, "any-remote": 0.0}
    if top_k > ep * local_experts:
        raise ValueError(f"remote_rows: a token picks k distinct experts of ep L: k = {top_k} > {ep * local_experts}")
    E = ep * local_experts
    miss = math.comb(E - local_experts, top_k) / math.comb(E, top_k)  # a given rank owns none of them
    return {"per-slot": top_k * (ep - 1) / ep, "per-owner": (ep - 1) * (1.0 - miss),
            "any-remote": 1.0 - math.comb(local_experts, top_k) / math.comb(E, top_k)}


def _shape(model: str):
    from mok_jax.config import load_model

    m = load_model(model)
    if m.num_experts % SLICE_EP:
        raise ValueError(f"--project: {model} has {m.num_experts} experts, not a multiple of {SLICE_EP}")
    return m, m.num_experts // SLICE_EP


def traffic(model: str, ep: int, *, combine_rows: str = "per-slot", tokens: int = TOKENS) -> dict[str, Any]:
    """Bytes per rank per direction of one layer call at EP ``ep`` (ep64-slice, uniform routing, bf16 rows), by
    transfer, and the rows per token behind them. Forward: ``route_fwd`` (every rank's ids and weights to every
    peer), ``dispatch`` (a row per token and remote owner: the kernel pulls a row once per owner), ``combine`` (a row
    per token and remote owner, or per remote slot), ``stage_fwd`` (the local copy of rows peers pull). Backward:
    ``route_bwd`` (the routing all-gather, in XLA), ``stage_bwd`` (x, dy staged), ``gather_bwd`` (x and dy read by
    the owner, once per remote slot row), ``send_bwd`` (each remote slot's dx row and dw), ``shared_dw`` (the ring
    all-reduce of the shared expert's bf16 weight gradients over the EP group, in XLA)."""
    if combine_rows not in COMBINE_ROWS:
        raise ValueError(f"combine_rows must be one of {', '.join(COMBINE_ROWS)}, got {combine_rows!r}")
    m, L = _shape(model)
    T, H, k, Is = tokens, m.hidden_size, m.top_k, m.shared_size
    rows = remote_rows(ep, L, k)
    row = 2 * H
    b = {
        "route_fwd": (ep - 1) * T * k * ROUTE_BYTES,
        "dispatch": T * rows["per-owner"] * row,
        "combine": T * rows[combine_rows] * row,
        "stage_fwd": T * rows["any-remote"] * row if ep > 1 else 0.0,
        "route_bwd": (ep - 1) * T * k * ROUTE_BYTES,
        "stage_bwd": 2 * T * row if ep > 1 else 0.0,
        "gather_bwd": 2 * T * rows["per-slot"] * row,
        "send_bwd": T * rows["per-slot"] * (row + DW_BYTES),
        "shared_dw": 2 * (ep - 1) / ep * 3 * H * Is * 2,
    }
    return {"bytes": b, "rows_per_token": rows, "local_experts": L, "total_experts": ep * L,
            "combine_rows": combine_rows}


def _knobs(model: str):
    """The knobs of the H200's tuned entry for the one-GPU problem (E/32 experts, EP 1): assumed at every EP size."""
    from mok_jax import tuning

    m, L = _shape(model)
    key = tuning.ProblemKey(hidden=m.hidden_size, intermediate=m.intermediate_size, top_k=m.top_k,
                            experts_per_rank=2 * L, ep=1, tokens=TOKENS)
    return tuning.resolve(None, key, "NVIDIA H200")


def _ms(nbytes: float, gbps: float) -> float:
    return nbytes / gbps / 1e6


def _xla_ms(nbytes: float, rates: Rates, link_ratio: float) -> float:
    return (rates.xla_latency_us * 1e-3 + _ms(nbytes, rates.xla_gbps * link_ratio)) if nbytes else 0.0


def _compute(one: OneGpu, machine: Machine) -> dict[str, float]:
    """The per-rank compute on ``machine``, ms: GEMM time over compute_ratio, memory-bound time over hbm_ratio."""
    def scale(total, mem_share):
        return total * (1 - mem_share) / machine.compute_ratio + total * mem_share / machine.hbm_ratio

    fwd = scale(one.fwd_ms, one.fwd_mem_share)
    return {"fwd": fwd, "bwd": scale(one.bwd_ms, one.bwd_mem_share),
            "shared_fwd": one.fwd_ms * one.shared_share / machine.compute_ratio,
            "dispatch_window": one.fwd_ms * one.dispatch_share / machine.hbm_ratio,
            "dense_fwd": one.dense_fwd_ms / machine.compute_ratio,
            "dense_fwd_bwd": one.dense_fwd_bwd_ms / machine.compute_ratio}


def a2a_layer(model: str, ep: int, machine: Machine, *, rates: Rates | None = None, one: OneGpu | None = None,
              tokens: int = TOKENS) -> dict[str, float]:
    """An all-to-all + grouped-GEMM layer per rank, ms: the dense GEMMs of the same FLOPs (measured), plus two XLA
    all_to_alls per direction of one row per remote (token, slot), none overlapped, plus the shared expert's
    weight-gradient all-reduce in fwd+bwd. Generous to it: no padding, no permutation copies, GEMMs at the dense
    rate, and XLA's EP-2 rate at every EP size."""
    rates, one = rates or load_rates(), one or load_one_gpu(model)
    t = traffic(model, ep, tokens=tokens)
    m, L = _shape(model)
    per_a2a = tokens * t["rows_per_token"]["per-slot"] * 2 * m.hidden_size
    a2a = _xla_ms(per_a2a, rates, machine.link_ratio)
    c = _compute(one, machine)
    fwd = c["dense_fwd"] + 2 * a2a
    return {"fwd": fwd, "fwd_bwd": c["dense_fwd_bwd"] + 4 * a2a + _xla_ms(t["bytes"]["shared_dw"], rates,
                                                                             machine.link_ratio),
            "a2a_ms": a2a, "a2a_bytes": per_a2a}


def project(model: str, ep: int, machine: Machine, *, combine_rows: str = "per-slot", rates: Rates | None = None,
            one: OneGpu | None = None) -> dict[str, Any]:
    """The projected per-rank time of one layer call of ``model``'s ep64-slice problem at EP ``ep`` on ``machine``,
    ms, as {"fwd": {low, built, high}, "fwd_bwd": {...}} with the bytes, the compute and the a2a layer beside it.
    Past the machine's NVLink domain every time is None (the kernels need load/store access to every peer)."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep must be an int >= 1, got {ep!r}")
    rates, one = rates or load_rates(), one or load_one_gpu(model)
    m, L = _shape(model)
    t = traffic(model, ep, combine_rows=combine_rows)
    b = t["bytes"]
    kernel = _knobs(model)
    out = {"model": model, "ep": ep, "machine": machine.name, "combine_rows": combine_rows, "local_experts": L,
           "total_experts": ep * L, "tokens": TOKENS, "rows_per_token": t["rows_per_token"], "bytes": b,
           "tuned_granularity": kernel.granularity, "microbatch_tokens": min(kernel.granularity, TOKENS),
           "in_domain": ep <= machine.domain, "fwd": None, "fwd_bwd": None, "a2a": None}
    M = ep * TOKENS * m.top_k + GROUP_ALIGN * L
    out["backward_refused_today"] = M * max(m.hidden_size, 2 * m.intermediate_size) >= 2**31
    out["memory_gb"] = _memory_gb(m, ep, L, kernel)
    _per_peer(out)
    if not out["in_domain"]:
        out["note"] = f"EP {ep} is past the {machine.domain}-GPU NVLink domain of {machine.label}"
        return out
    c = _compute(one, machine)
    r_link = rates.link_gbps * machine.link_ratio
    r_stage = COMM_SMS * SM_STORE_GBPS * machine.hbm_ratio  # the local staging copies, by the comm SMs
    xla = lambda n, ratio=machine.link_ratio: _xla_ms(n, rates, ratio)  # noqa: E731

    # forward
    wire_f = b["route_fwd"] + b["dispatch"] + b["combine"]
    stage_f = _ms(b["stage_fwd"], r_stage)
    built = {G: _pipeline(c, b, r_link, G, ref_rows=kernel.granularity * m.top_k / (2 * L),
                          rows=G * m.top_k / L) + _ms(b["route_fwd"], r_link) + stage_f for G in GRANULARITIES}
    best = min(built, key=built.get)
    out["built_granularity"] = out["microbatch_tokens"] = best
    _per_peer(out)
    fwd = {"low": max(c["fwd"], _ms(wire_f, r_link)), "built": built[best],
           "high": c["fwd"] + _ms(b["route_fwd"] + b["dispatch"], rates.pull_gbps) + _ms(b["combine"],
                                                                                          rates.push_gbps)}
    # backward: the list puts every GATHER before the GEMMs and every SEND before the weight-gradient tiles
    wire_b = b["gather_bwd"] + b["send_bwd"]
    stage_b = _ms(b["stage_bwd"], r_stage)
    xla_b = xla(b["route_bwd"]) + xla(b["shared_dw"])
    bwd = {"low": max(c["bwd"], _ms(wire_b + b["route_bwd"] + b["shared_dw"], r_link)),
           "built": c["bwd"] + xla_b + stage_b + _ms(wire_b, r_link),
           "high": c["bwd"] + xla(b["route_bwd"], 1.0) + xla(b["shared_dw"], 1.0) + _ms(b["gather_bwd"],
                                                                                         rates.pull_gbps)
           + _ms(b["send_bwd"], rates.push_gbps)}
    out["fwd"] = fwd
    out["fwd_bwd"] = {k: fwd[k] + bwd[k] for k in fwd}
    out["compute"] = c
    out["comm_ms"] = {"fwd_wire_at_link": _ms(wire_f, r_link), "bwd_wire_at_link": _ms(wire_b, r_link),
                      "bwd_xla": xla_b, "stage": stage_f + stage_b}
    a2a = a2a_layer(model, ep, machine, rates=rates, one=one)
    out["a2a"] = a2a
    out["a2a_over_mok"] = {"fwd": a2a["fwd"] / fwd["built"],
                           "bwd": (a2a["fwd_bwd"] - a2a["fwd"]) / (out["fwd_bwd"]["built"] - fwd["built"])}
    return out


def _per_peer(out: dict) -> None:
    """Dispatch and combine bytes per peer per microbatch (of ``microbatch_tokens``), into ``out``."""
    micro = math.ceil(out["tokens"] / out["microbatch_tokens"])
    out["bytes_per_peer_per_microbatch"] = {k: out["bytes"][k] / max(out["ep"] - 1, 1) / micro
                                            for k in ("dispatch", "combine")}


def _pipeline(c: dict, b: dict, rate: float, G: int, *, ref_rows: float, rows: float) -> float:
    """The forward as its items run (kernel.md, "Work items and their order"), ms: Mb = T / G microbatches of d
    (dispatch), c (routed compute) and b (combine) each; the shared expert s hides the first dispatch beside the
    EP-1 dispatch window's own copy; then Mb - 1 steps of max(d + b, c); then the last combine, split over every CTA
    and exposed. A step's dispatch and combine share each direction of the link (every rank sends and receives
    both), so a step's transfers take d + b. The routed compute pays the granularity's cost (granularity_cost)."""
    micro = math.ceil(TOKENS / G)
    shared = c["shared_fwd"]
    routed = (c["fwd"] - shared) * granularity_cost(rows, ref_rows)
    d1, c1, r1 = _ms(b["dispatch"], rate) / micro, _ms(b["combine"], rate) / micro, routed / micro
    dloc = c["dispatch_window"] / micro
    window = max(d1, dloc, shared) - max(dloc, shared)  # what the first dispatch adds beside the shared expert
    steady = (micro - 1) * max(0.0, d1 + c1 - r1)
    return shared + routed + window + steady + c1


def _memory_gb(m, ep: int, L: int, kernel) -> float:
    """mok_jax.memory's per-rank total (workspace, scratch, layout, kept; default keep), GB."""
    from mok_jax import memory

    terms = memory.layer_memory_per_rank(ep=ep, tokens=TOKENS, hidden=m.hidden_size, inter=m.intermediate_size,
                                         shared_inter=m.shared_size, top_k=m.top_k, local_experts=L, kernel=kernel)
    return memory.group_totals(terms)["total"] / 1e9


# ----------------------------------------------------------------------------------------------- validation (EP 2)

def _op_rows(rec: dict, T: int, k: int, L: int, ep: int) -> tuple[float, float, float]:
    """(local rows stored, local rows loaded, rows over the link) per GPU of one standalone op of comm_h200x2.md, as
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
    """The two XLA baseline layers on two H200s (baselines_h200x2), predicted as this model predicts its a2a layer:
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
        {"name": "local staging copies", "value": f"{COMM_SMS} SMs x {SM_STORE_GBPS} GB/s",
         "source": "comm_h200x2.md, run 4's per-SM microbenchmark"},
        {"name": "knobs at EP > 1", "value": "the H200 tuned entry of the one-GPU problem (24 comm SMs; "
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
             "  standalone ops on two H200s (comm_h200x2*.json): link model | per-SM roofline (median, range)"]
    for f in v["comm_ops"]["families"]:
        s = f["link"]
        other = f.get("roofline") or f.get("fit")
        label = "roofline" if "roofline" in f else "XLA fit (in-sample)"
        lines.append(f"    {f['run']:<30} {f['family']:<44} n={s['n']:<3} link {s['median']:.2f} "
                     f"({s['min']:.2f}-{s['max']:.2f}) | {label} {other['median']:.2f} "
                     f"({other['min']:.2f}-{other['max']:.2f})")
    lines.append("  XLA baseline layers on two H200s (baselines_h200x2): one-GPU time + all_to_alls at the XLA fit")
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
