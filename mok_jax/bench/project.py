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
mok_jax.bench.project_report checks the model against every real multi-GPU measurement there is (EP 2 only),
names the assumptions, prints the tables and is ``mok-bench --project``'s entry.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Any

import numpy as np

__all__ = ["COMBINE_ROWS", "EP_SIZES", "H200_NVL8", "MACHINES", "MODELS", "NVL72", "PAPER_EP64", "SCHEMA", "TOKENS",
           "Machine", "OneGpu", "Rates", "a2a_layer", "granularity_cost", "load_one_gpu", "load_rates", "project",
           "remote_rows", "traffic"]

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
FWD_JSON = "forward/headline.json"  # mok and dense fwd, one H200, E/32, T 2048 (eighteenth session)
FWD_BWD_JSON = "training/headline.json"  # the same, fwd+bwd
BREAKDOWN_JSON = "forward/breakdown.json"  # the forward's parts: grouped FFN, shared FFN, row moves twice
ITEMS_JSON = "training/where.json"  # the backward's ms per SM per kind of item (kept g, u)
COMM_JSONS = {"run 3": "comm_ep2/comm.json", "run 2": "comm_ep2/comm_run2.json",
              "run 4 (bulk movers, reverted)": "comm_ep2/comm_run4_bulk.json"}
EP2_LAYER_JSONS = ("comm_ep2/baselines/headline.json", "comm_ep2/baselines/sweep.json")
EP1_LAYER_JSONS = {"fwd": ("forward/headline_f32_baselines.json", "forward/sweep.json"),
                   "fwd+bwd": ("training/fwd_bwd_f32_baselines.json",)}

# Measured on the 2-GPU H200 machine (HARDWARE.md; comm_ep2.md): copy-engine peer copies, and the per-SM ceilings
# of run 4's microbenchmark ("registers" rows), used only by the EP-2 validation's roofline of the standalone ops.
P2P_ONE_WAY_GBPS = 394.0  # GPU0 -> GPU1, one direction
P2P_BOTH_TOTAL_GBPS = 563.0  # both directions at once, total: 281.5 per direction
SM_STORE_GBPS = 62.6  # 16-byte stores to local HBM per SM (24 SMs)
SM_LOAD_GBPS = 62.3  # 16-byte register loads from local HBM per SM (24 SMs)
SM_PEER_GBPS = 26.2  # register loads from the peer per SM (8 SMs; the link caps the total)
# the project's own row movers at 24 SMs and 4096 tokens (run 3): a pull of one row per (token, owner), and the
# combine's push of one pre-summed row per (token, owner), each with its local copy, schedule and launch
PULL_RECORD = {"op": "dispatch", "mode": "pull", "note": "token_major", "tokens": 4096, "num_sms": 24}
PUSH_RECORD = {"op": "combine", "mode": "push", "tokens": 4096, "num_sms": 24}
COMM_ITEMS = 24  # comm_items_fwd and comm_items_bwd of every tuned H200 entry; the mover rates above are at 24 SMs
SWEEP_JSON = "forward/sweep.json"  # mok fwd of kimi-k2 at 16384 tokens, granularity 512..8192, one H200
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
    """The H200 rates: the peer copies of HARDWARE.md, the mover and XLA rates from comm_ep2/comm.json (run 3)."""
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
    per token and remote owner, or per remote slot), ``post_fwd`` (POST's local copy of rows peers pull). Backward:
    ``route_bwd`` (the routing all-gather, in XLA), ``share_bwd`` (SHARE's local copy of x, dy), ``gather_bwd`` (x
    and dy read by the owner, once per remote slot row), ``send_bwd`` (each remote slot's dx row and dw),
    ``shared_dw`` (the ring all-reduce of the shared expert's bf16 weight gradients over the EP group, in XLA)."""
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
        "post_fwd": T * rows["any-remote"] * row if ep > 1 else 0.0,
        "route_bwd": (ep - 1) * T * k * ROUTE_BYTES,
        "share_bwd": 2 * T * row if ep > 1 else 0.0,
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
    r_copy = COMM_ITEMS * SM_STORE_GBPS * machine.hbm_ratio  # the local copies (POST, SHARE), one CTA per comm item
    xla = lambda n, ratio=machine.link_ratio: _xla_ms(n, rates, ratio)  # noqa: E731

    # forward
    wire_f = b["route_fwd"] + b["dispatch"] + b["combine"]
    copy_f = _ms(b["post_fwd"], r_copy)
    built = {G: _pipeline(c, b, r_link, G, ref_rows=kernel.granularity * m.top_k / (2 * L),
                          rows=G * m.top_k / L) + _ms(b["route_fwd"], r_link) + copy_f for G in GRANULARITIES}
    best = min(built, key=built.get)
    out["built_granularity"] = out["microbatch_tokens"] = best
    _per_peer(out)
    fwd = {"low": max(c["fwd"], _ms(wire_f, r_link)), "built": built[best],
           "high": c["fwd"] + _ms(b["route_fwd"] + b["dispatch"], rates.pull_gbps) + _ms(b["combine"],
                                                                                          rates.push_gbps)}
    # backward: the list puts every GATHER before the GEMMs and every SEND before the weight-gradient tiles
    wire_b = b["gather_bwd"] + b["send_bwd"]
    copy_b = _ms(b["share_bwd"], r_copy)
    xla_b = xla(b["route_bwd"]) + xla(b["shared_dw"])
    bwd = {"low": max(c["bwd"], _ms(wire_b + b["route_bwd"] + b["shared_dw"], r_link)),
           "built": c["bwd"] + xla_b + copy_b + _ms(wire_b, r_link),
           "high": c["bwd"] + xla(b["route_bwd"], 1.0) + xla(b["shared_dw"], 1.0) + _ms(b["gather_bwd"],
                                                                                         rates.pull_gbps)
           + _ms(b["send_bwd"], rates.push_gbps)}
    out["fwd"] = fwd
    out["fwd_bwd"] = {k: fwd[k] + bwd[k] for k in fwd}
    out["compute"] = c
    out["comm_ms"] = {"fwd_wire_at_link": _ms(wire_f, r_link), "bwd_wire_at_link": _ms(wire_b, r_link),
                      "bwd_xla": xla_b, "local_copies": copy_f + copy_b}
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
