"""A mok-bench result record: everything known before a run times anything (the problem's accounting, its
floors at the given rooflines), then the timing figures. Every record has exactly report.RESULT_KEYS."""

from __future__ import annotations

from typing import Any

from mok_jax.bench import accounting as acc
from mok_jax.bench.options import DENSE, FP8_IMPL, BenchOptions

__all__ = ["compute_floor", "error_text", "fill_timing", "new_record", "precision_of", "reference_gb"]


def precision_of(impl: str) -> str:
    """What the routed experts' forward of ``impl`` runs in (the record's dtype)."""
    return "fp8" if impl == FP8_IMPL else "bf16"


def compute_floor(shape: acc.BenchShape, tokens: int, pass_: str, impl: str, peaks: dict) -> float | None:
    """The compute floor of ``impl`` at ``peaks`` ({"bf16", "fp8"} TFLOP/s, None where not known: CPU)."""
    precision = precision_of(impl)
    if peaks["bf16"] is None or peaks[precision] is None:
        return None
    return acc.compute_floor_ms(shape, tokens, pass_, peak_tflops=peaks["bf16"], precision=precision,
                                fp8_peak_tflops=peaks["fp8"])


def new_record(shape: acc.BenchShape, tokens: int, pass_: str, impl: str, opts: BenchOptions,
               traffic: acc.Traffic, peaks: dict, nvlink_gbps: float | None) -> dict:
    """A result record with everything known before timing (the accounting). A roofline of None (CPU) leaves its
    floor None."""
    from mok_jax.bench.report import RESULT_KEYS

    r: dict[str, Any] = dict.fromkeys(RESULT_KEYS)
    d = shape.as_dict()
    r.update({k: d[k] for k in ("model", "ep_mode", "num_gpus", "experts_per_gpu", "total_experts", "top_k",
                                "hidden_size", "intermediate_size", "shared_size")})
    precision = precision_of(impl)
    r.update(tokens_per_gpu=tokens, dtype=precision, routing=opts.routing, seed=opts.seed, impl=impl,
             status="pending", zipf_s=opts.zipf_s if opts.routing == "zipf" else None)
    r["pass"] = pass_
    row_bytes = acc.row_bytes(shape.hidden_size, precision)  # a dispatched row
    flops = acc.flops_per_gpu(shape, tokens, pass_)
    r["flops_per_gpu"] = flops
    r["compute_floor_ms"] = compute_floor(shape, tokens, pass_, impl, peaks)
    rows = acc.executed_rows_per_gpu(impl, shape, tokens, opts.capacity_factor)
    if rows is not None:
        r["executed_flops_per_gpu"] = acc.executed_flops_per_gpu(shape, tokens, rows, pass_)
        r["padding_overhead"] = r["executed_flops_per_gpu"] / flops
    r["load_imbalance"] = traffic.load_imbalance
    r["dispatch_bytes_per_gpu"] = acc.dispatch_bytes_per_gpu(shape, tokens, precision)
    r["remote_dispatch_bytes_per_gpu_uniform"] = r["dispatch_bytes_per_gpu"] * acc.uniform_remote_fraction(
        shape.num_gpus)
    r["remote_dispatch_bytes_per_gpu"] = float(traffic.sent_slots.mean()) * row_bytes
    r["unique_remote_dispatch_bytes_per_gpu"] = float(traffic.sent_unique.mean()) * row_bytes
    link_bytes = acc.link_bytes_per_row(shape.hidden_size, pass_, precision)  # over the pass's transfers
    moves_rows = bool(nvlink_gbps) and impl != DENSE  # dense moves no rows: no communication floor
    to_ms = lambda rows_: rows_ * link_bytes / (nvlink_gbps * 1e9) * 1e3 if moves_rows else None
    r["comm_floor_ms"] = to_ms(traffic.link_rows)
    r["comm_floor_unique_ms"] = to_ms(traffic.link_rows_unique)
    if impl == "xla-capacity":
        r["capacity"] = acc.capacity(tokens, shape.top_k, shape.total_experts, opts.capacity_factor)
    return r


def fill_timing(r: dict, timing) -> None:
    """The timing figures; the fractions are floor / median (for a bf16 row the compute one is TFLOP/s / peak;
    mok-fp8's floor mixes the two peaks)."""
    r.update(status="ok", median_ms=timing.median_ms, min_ms=timing.min_ms, max_ms=timing.max_ms,
             samples=timing.samples, calls_per_sample=timing.calls_per_sample)
    r["tflops"] = r["flops_per_gpu"] / (timing.median_ms * 1e-3) / 1e12
    over_median = lambda floor_ms: None if floor_ms is None else floor_ms / timing.median_ms
    r["compute_fraction"] = over_median(r["compute_floor_ms"])
    r["comm_fraction"] = over_median(r["comm_floor_ms"])
    r["comm_fraction_unique"] = over_median(r["comm_floor_unique_ms"])


def error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


def reference_gb(shape: acc.BenchShape, tokens: int, pass_: str) -> float:
    """The dense reference's fp32 activations per GPU: every local expert on every received row."""
    rows = shape.total_experts * tokens
    per_row = 2 * shape.intermediate_size * 4 + shape.hidden_size * 4
    return rows * per_row * (1 if pass_ == "fwd" else 2) / 1e9
