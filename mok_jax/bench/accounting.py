"""FLOP and byte accounting of one MoE layer call, per GPU, and the rooflines it implies.

The problem a run measures (``BenchShape``): ``num_gpus`` EP ranks, each with ``experts_per_gpu``
routed experts and ``tokens`` tokens; every token picks ``top_k`` of the ``total_experts`` experts.

- ``full``: the model's E experts split over the GPUs present (E/num_gpus per GPU).
- ``ep64-slice``: E/64 experts per GPU, as at expert-parallel degree 64 on an NVL72 rack, so the
  per-GPU work matches the paper's headline setting on however many GPUs are here
  (total experts = num_gpus * E/64).
- ``--experts-per-gpu`` (N, or ``E/d``: the model's E experts divided by d) overrides either split: each
  GPU holds that many experts (total num_gpus * that). The one-GPU table (benchmarks/results/forward.md) is E/32 on one GPU: the
  whole 2-GPU ep64-slice problem (2 * E/64 experts), with the same per-GPU FLOPs. ``ep_mode`` then names
  the split: ``E/32``, or ``12/gpu`` for a plain count.

Useful FLOPs per GPU, forward (SwiGLU: gate, up and down projections are 3 GEMMs of H x I):
    routed 2*T*k*3*H*I  +  shared 2*T*3*H*Is
and backward about twice that (dgrad + wgrad per GEMM), so fwd+bwd = 3 x forward. The compute floor runs
them at the dense GEMM peak (``compute_floor_ms``); for the FP8 layer (MoEConfig(precision="fp8")) only the
forward's routed GEMMs run in E4M3, so only they are counted at the FP8 peak, the shared expert and the whole
backward (bf16, recomputing) at the bf16 peak.

Bytes: dispatch sends T*k rows of H elements per GPU (one per (token, slot)), a fraction (ep-1)/ep of
them to other GPUs under uniform routing; combine returns as many. A token whose k experts live on
fewer than k other ranks need cross NVLink only once per destination rank ("unique remote rows").
Backward moves the same again (the output gradient out to the experts, the input gradient back).
A row is 2H bytes in bf16; the FP8 layer dispatches E4M3 rows with one f32 scale per 1 x 128 tile,
H + 4*H/128 bytes (``row_bytes``), and combines, and runs its backward, in bf16.
The communication floor is the busiest GPU's max(bytes sent, bytes received) over the link
bandwidth, per transfer: with ep GPUs on NVLink each GPU sends and receives at that rate at once.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from mok_jax.config import ModelShape

__all__ = [
    "EP_MODES", "FP8_BLOCK", "PASSES", "PRECISIONS", "BenchShape", "Traffic", "bench_shape", "capacity",
    "compute_floor_ms", "dispatch_bytes_per_gpu", "executed_rows_per_gpu", "experts_per_gpu_count",
    "flops_per_gpu", "forward_flops_per_gpu", "fp8_weight_bytes_per_rank", "link_bytes_per_row",
    "min_bytes_per_gpu", "mok_memory_per_rank", "parse_experts_per_gpu", "pass_multiplier", "routing_traffic",
    "row_bytes", "transfers_per_pass", "uniform_remote_fraction",
]

EP_MODES = ("full", "ep64-slice")
PASSES = ("fwd", "fwd+bwd")
SLICE_EP = 64  # the expert-parallel degree ep64-slice imitates
PRECISIONS = ("bf16", "fp8")  # of the routed experts' forward (MoEConfig.precision)
FP8_BLOCK = 128  # E4M3 scale blocks: 1 x 128 for a row, 128 x 128 for a weight matrix (mok_jax.fp8.BLOCK)
KEPT_GU_BYTES = 2  # bytes of a kept g or u value (mok_jax.validation.KEPT_GU_DTYPE, bf16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchShape:
    """The per-GPU problem: the model's dimensions and how its experts sit on the GPUs."""

    model: str
    ep_mode: str
    num_gpus: int
    experts_per_gpu: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    shared_size: int  # fused shared-expert intermediate size Is (0: no shared expert)

    @property
    def total_experts(self) -> int:
        return self.num_gpus * self.experts_per_gpu

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_experts": self.total_experts}


def parse_experts_per_gpu(text: str | int) -> str:
    """The --experts-per-gpu value, normalised: 'N' (a positive count) or 'E/d' (d a positive int).
    Raises ValueError naming the option for anything else."""
    t = str(text).strip().replace(" ", "")
    if t.isdigit() and int(t) > 0:
        return str(int(t))
    if t[:2] in ("E/", "e/") and t[2:].isdigit() and int(t[2:]) > 0:
        return f"E/{int(t[2:])}"
    raise ValueError(f"--experts-per-gpu: cannot read {text!r}; give a positive count N or E/<d> (the model's "
                     f"experts divided by d, e.g. E/32)")


def experts_per_gpu_count(model: ModelShape, spec: str | int) -> int:
    """The routed experts per GPU that --experts-per-gpu ``spec`` ('N' or 'E/d') gives ``model``."""
    spec = parse_experts_per_gpu(spec)
    E = model.num_experts
    if spec.startswith("E/"):
        d = int(spec[2:])
        if E % d:
            raise ValueError(f"--experts-per-gpu {spec}: {model.name} has E = {E} experts, which is not divisible "
                             f"by {d}")
        return E // d
    n = int(spec)
    if n > E:
        raise ValueError(f"--experts-per-gpu {spec}: more than {model.name}'s {E} experts on one GPU")
    return n


def bench_shape(model: ModelShape, num_gpus: int, ep_mode: str, *,
                experts_per_gpu: str | int | None = None) -> BenchShape:
    """The BenchShape of ``model`` on ``num_gpus`` GPUs in ``ep_mode`` (one of EP_MODES), or with
    ``experts_per_gpu`` ('N' or 'E/d', as --experts-per-gpu) experts on each GPU, overriding ep_mode's split."""
    if ep_mode not in EP_MODES:
        raise ValueError(f"ep mode must be one of {', '.join(EP_MODES)}, got {ep_mode!r}")
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    E = model.num_experts
    if experts_per_gpu is not None:
        spec = parse_experts_per_gpu(experts_per_gpu)
        per_gpu = experts_per_gpu_count(model, spec)
        ep_mode = spec if spec.startswith("E/") else f"{spec}/gpu"
        if model.top_k > per_gpu * num_gpus:
            raise ValueError(f"--experts-per-gpu {spec}: {model.name} on {num_gpus} GPU(s) would have "
                             f"{per_gpu * num_gpus} experts in all, fewer than top_k={model.top_k} (a token picks k "
                             f"distinct experts)")
    elif ep_mode == "full":
        if E % num_gpus:
            raise ValueError(f"ep mode 'full' splits {model.name}'s {E} experts over the GPUs, but {E} is not "
                             f"divisible by {num_gpus} GPUs")
        per_gpu = E // num_gpus
    else:
        if E % SLICE_EP:
            raise ValueError(f"ep mode 'ep64-slice' gives each GPU E/64 experts, but {model.name} has {E} experts "
                             f"(not a multiple of 64); use --ep-mode full")
        per_gpu = E // SLICE_EP
    if model.top_k > per_gpu * num_gpus:
        raise ValueError(f"{model.name} in {ep_mode} on {num_gpus} GPU(s) has {per_gpu * num_gpus} experts in all, "
                         f"fewer than top_k={model.top_k} (a token picks k distinct experts); use more GPUs")
    return BenchShape(model=model.name, ep_mode=ep_mode, num_gpus=num_gpus, experts_per_gpu=per_gpu,
                      top_k=model.top_k, hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
                      shared_size=model.shared_size)


def pass_multiplier(pass_: str) -> int:
    """FLOPs of the pass in units of the forward's: backward is about 2x forward."""
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {', '.join(PASSES)}, got {pass_!r}")
    return 1 if pass_ == "fwd" else 3


def transfers_per_pass(pass_: str) -> int:
    """Row transfers of the pass: dispatch + combine forward; the same again backward."""
    return 2 if pass_multiplier(pass_) == 1 else 4


def forward_flops_per_gpu(shape: BenchShape, tokens: int) -> tuple[float, float]:
    """(routed, shared) useful FLOPs of one forward per GPU: 2*T*k*3*H*I and 2*T*3*H*Is."""
    H, I, Is, k = shape.hidden_size, shape.intermediate_size, shape.shared_size, shape.top_k
    return float(2 * tokens * k * 3 * H * I), float(2 * tokens * 3 * H * Is)


def flops_per_gpu(shape: BenchShape, tokens: int, pass_: str = "fwd") -> float:
    """Useful FLOPs per GPU: 2*T*k*3*H*I (routed) + 2*T*3*H*Is (shared), x3 for fwd+bwd."""
    return sum(forward_flops_per_gpu(shape, tokens)) * pass_multiplier(pass_)


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def compute_floor_ms(shape: BenchShape, tokens: int, pass_: str, *, peak_tflops: float, precision: str = "bf16",
                     fp8_peak_tflops: float | None = None) -> float:
    """The pass's useful FLOPs per GPU at the dense GEMM peaks, in ms: all at ``peak_tflops`` (bf16), except with
    precision "fp8" the forward's routed GEMMs, at ``fp8_peak_tflops``: the FP8 layer runs only those in E4M3 (its
    shared expert, and its backward, which recomputes the experts from the bf16 weights, stay bf16). Quantising
    the weights and rows is not counted (no GEMM FLOPs)."""
    _check_precision(precision)
    if precision == "fp8" and not fp8_peak_tflops:
        raise ValueError("precision 'fp8' needs fp8_peak_tflops (the dense FP8 GEMM peak)")
    total = flops_per_gpu(shape, tokens, pass_)
    fp8 = forward_flops_per_gpu(shape, tokens)[0] if precision == "fp8" else 0.0
    fp8_ms = fp8 / (fp8_peak_tflops * 1e9) if fp8 else 0.0
    return fp8_ms + (total - fp8) / (peak_tflops * 1e9)  # FLOPs / (TFLOP/s * 1e12) s = FLOPs / (TFLOP/s * 1e9) ms


def executed_flops_per_gpu(shape: BenchShape, tokens: int, rows: int, pass_: str = "fwd") -> float:
    """FLOPs a padded implementation executes when its expert GEMMs run ``rows`` rows per GPU."""
    H, I, Is = shape.hidden_size, shape.intermediate_size, shape.shared_size
    return float((2 * rows * 3 * H * I + 2 * tokens * 3 * H * Is) * pass_multiplier(pass_))


def capacity(tokens: int, top_k: int, total_experts: int, capacity_factor: float) -> int:
    """Slots per (source rank, expert) of the capacity baseline: ceil(cf * T*k / E), at least 1."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity factor must be > 0, got {capacity_factor}")
    return max(1, math.ceil(capacity_factor * tokens * top_k / total_experts))


def executed_rows_per_gpu(impl: str, shape: BenchShape, tokens: int, capacity_factor: float) -> int | None:
    """Rows the expert GEMMs of a baseline process per GPU (None: not known in advance).

    ``xla``/``reference`` run every local expert over every (source rank, token) slot: E_total*T rows
    (the useful count is T*k); ``xla-capacity`` runs E_total * capacity rows.
    """
    if impl in ("xla", "reference"):
        return shape.total_experts * tokens
    if impl == "xla-capacity":
        return shape.total_experts * capacity(tokens, shape.top_k, shape.total_experts, capacity_factor)
    return None


def row_bytes(hidden: int, precision: str = "bf16") -> int:
    """Bytes of one dispatched token row: bf16 2H; fp8 H E4M3 values and one f32 scale per 1 x 128 tile."""
    _check_precision(precision)
    return 2 * hidden if precision == "bf16" else hidden + 4 * -(-hidden // FP8_BLOCK)


def dispatch_bytes_per_gpu(shape: BenchShape, tokens: int, precision: str = "bf16") -> int:
    """Bytes of the rows one GPU dispatches, local and remote: T*k*row_bytes(H)."""
    return tokens * shape.top_k * row_bytes(shape.hidden_size, precision)


def link_bytes_per_row(hidden: int, pass_: str, precision: str = "bf16") -> int:
    """Bytes a (token, slot) row costs over the pass's transfers (transfers_per_pass): the forward's dispatch in
    ``precision`` (row_bytes), its combine and the backward's two transfers in bf16."""
    return row_bytes(hidden, precision) + (transfers_per_pass(pass_) - 1) * row_bytes(hidden)


def uniform_remote_fraction(num_gpus: int) -> float:
    """Share of uniformly routed rows whose expert is on another GPU: (ep-1)/ep."""
    return (num_gpus - 1) / num_gpus


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Rows crossing GPU boundaries for one dispatch, from an actual routing (index: EP rank).

    sent_slots[r]: (token, slot) rows of rank r whose expert is on another rank.
    recv_slots[r]: such rows arriving at rank r.
    sent_unique[r] / recv_unique[r]: the same counting each (token, destination rank) once.
    owner_rows[r]: (token, slot) rows whose expert rank r owns (its routed expert work).
    """

    sent_slots: np.ndarray
    recv_slots: np.ndarray
    sent_unique: np.ndarray
    recv_unique: np.ndarray
    owner_rows: np.ndarray

    @property
    def link_rows(self) -> int:
        """Rows per transfer on the busiest GPU's link: max over ranks of max(sent, received)."""
        return int(max(self.sent_slots.max(), self.recv_slots.max()))

    @property
    def link_rows_unique(self) -> int:
        return int(max(self.sent_unique.max(), self.recv_unique.max()))

    @property
    def load_imbalance(self) -> float:
        """Busiest rank's routed rows over the mean (1.0: perfectly balanced)."""
        mean = self.owner_rows.mean()
        return float(self.owner_rows.max() / mean) if mean else 1.0


def routing_traffic(topk_idx: np.ndarray, num_gpus: int, experts_per_gpu: int) -> Traffic:
    """Traffic of ``topk_idx`` (int[num_gpus*T, k], rank r holds rows [r*T, (r+1)*T)), experts of rank r
    being [r*experts_per_gpu, (r+1)*experts_per_gpu)."""
    idx = np.asarray(topk_idx)
    n, _ = idx.shape
    if n % num_gpus:
        raise ValueError(f"{n} tokens do not split over {num_gpus} GPUs")
    tokens = n // num_gpus
    src = np.repeat(np.arange(num_gpus), tokens)[:, None]  # [N, 1]
    dest = idx // experts_per_gpu  # [N, k]
    remote = dest != src
    hit = np.zeros((n, num_gpus), bool)
    np.put_along_axis(hit, dest, True, axis=1)  # token t needs rank d
    hit[np.arange(n), src[:, 0]] = False  # its own rank costs no link traffic
    sent_slots = remote.reshape(num_gpus, tokens, -1).sum(axis=(1, 2))
    recv_slots = np.bincount(dest[remote], minlength=num_gpus)
    sent_unique = hit.reshape(num_gpus, tokens, num_gpus).sum(axis=(1, 2))
    recv_unique = hit.sum(axis=0)
    owner_rows = np.bincount(dest.ravel(), minlength=num_gpus)
    return Traffic(sent_slots, recv_slots, sent_unique, recv_unique, owner_rows)


def min_bytes_per_gpu(shape: BenchShape, tokens: int, pass_: str) -> int:
    """A lower bound of the device memory any implementation needs per GPU for the pass, in bytes: the arrays
    every one holds whatever its working set: x and y (or, for fwd+bwd, x, dy and dx) in bf16, the routing
    (int32 ids and f32 weights, and for fwd+bwd the weights' gradient) and the rank's weights in bf16 (and their
    gradients for fwd+bwd). mok-bench refuses a problem above the device's memory with it, before running."""
    H, I, Is, k = shape.hidden_size, shape.intermediate_size, shape.shared_size, shape.top_k
    backward = pass_multiplier(pass_) > 1
    rows = tokens * H * 2 * (3 if backward else 2)  # x, y | x, dy, dx
    routing = tokens * k * (4 + 4 + (4 if backward else 0))
    weights = (shape.experts_per_gpu * 3 * H * I + 3 * H * Is) * 2 * (2 if backward else 1)
    return rows + routing + weights


def fp8_weight_bytes_per_rank(shape: BenchShape) -> int:
    """Bytes of one rank's routed experts in E4M3 (mok_jax.fp8.quantize_expert_weights): 3*H*I values and one f32
    scale per 128 x 128 block of gate_up [2I, H] and down [H, I], per local expert."""
    h, i = -(-shape.hidden_size // FP8_BLOCK), -(-shape.intermediate_size // FP8_BLOCK)
    per_expert = 3 * shape.hidden_size * shape.intermediate_size + 4 * (2 * i * h + h * i)
    return shape.experts_per_gpu * per_expert


def mok_memory_per_rank(shape: BenchShape, tokens: int, kernel, keep: str | None = None,
                        precision: str = "bf16") -> dict[str, int | None]:
    """Device memory of one mok layer per rank, in bytes (None where the native library that sizes it is missing
    or the kernel does not support the call):

    workspace_bytes_per_rank: the symmetric workspace (mok_jax.workspace.CommConfig.workspace_bytes) of a layer
        sized for this call (max_tokens = tokens); it lives as long as the layer.
    scratch_bytes_per_rank: the per-call scratch XLA allocates for the kernel (mok_jax.ops.moe_forward.scratch_bytes:
        the ring of kernel.ring_slots microbatches dominates); freed when the call ends.
    backward_scratch_bytes_per_rank: the scratch of its backward's experts op per call (mok_jax.memory's "backward"
        terms: the op's row buffers over M = ep T k + 128 L rows, its g, u scratch none where XLA hands it the kept
        buffer); freed when the call ends. From the formulas (tests/test_memory_formula.py checks them against the
        op), so known without the native library.
    residual_bytes_per_rank: what the forward keeps for a backward pass beyond its inputs: 0 with
        MoEConfig(keep="nothing") (its custom_vjp saves only x, the routing and the weights, and its backward
        recomputes the experts from them); with keep="everything" ("mok-keep") the g, u in the backward's rows, bf16
        [ep T k + 128 L, 2I] (the dropless bound of that layout); with keep="balanced" (the default, "mok") the
        first T k + 128 L of them; with keep="ring" ("mok-ring") those of the ring's tokens only
        (mok_jax.layer.kept_rows).
    fp8_weight_bytes_per_rank: with precision "fp8" ("mok-fp8") the E4M3 routed weights its forward reads
        (fp8_weight_bytes_per_rank): a copy beside the bf16 ones, made by the caller once per optimizer step;
        None for bf16. The scratch is then the FP8 ring's (E4M3 rows and their scales).
    """
    from mok_jax import memory
    from mok_jax.config import MoEConfig
    from mok_jax.layer import kept_rows
    from mok_jax.ops.moe_forward import scratch_bytes
    from mok_jax.workspace import CommConfig

    _check_precision(precision)
    keep = MoEConfig(implementation="mok", keep=keep, precision=precision).keep  # None: the default

    rows = kept_rows(keep, kernel, tokens=tokens, top_k=shape.top_k, local_experts=shape.experts_per_gpu,
                     ep=shape.num_gpus)
    fp8 = precision == "fp8"
    terms = memory.layer_memory_per_rank(ep=shape.num_gpus, tokens=tokens, hidden=shape.hidden_size,
                                         inter=shape.intermediate_size, shared_inter=shape.shared_size,
                                         top_k=shape.top_k, local_experts=shape.experts_per_gpu, kernel=kernel,
                                         keep=keep)
    out: dict[str, int | None] = {"workspace_bytes_per_rank": None, "scratch_bytes_per_rank": None,
                                  "backward_scratch_bytes_per_rank": memory.group_totals(terms)["backward"],
                                  "residual_bytes_per_rank": rows * 2 * shape.intermediate_size * KEPT_GU_BYTES,
                                  "fp8_weight_bytes_per_rank": fp8_weight_bytes_per_rank(shape) if fp8 else None}
    try:
        out["workspace_bytes_per_rank"] = CommConfig(
            ep=shape.num_gpus, max_tokens=tokens, hidden_size=shape.hidden_size, top_k=shape.top_k,
            num_experts=shape.total_experts).workspace_bytes()
        out["scratch_bytes_per_rank"] = scratch_bytes(
            tokens=tokens, hidden=shape.hidden_size, inter=shape.intermediate_size, shared_inter=shape.shared_size,
            top_k=shape.top_k, local_experts=shape.experts_per_gpu, ep=shape.num_gpus, kernel=kernel, fp8=fp8)
    except (ValueError, RuntimeError):  # unsupported shape, or no native library: the run itself says why
        pass
    return out
