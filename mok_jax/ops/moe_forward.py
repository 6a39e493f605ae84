"""FFI wrapper for mok_moe_forward (ffi/src/ffi_moe.cu): the MoE forward megakernel.

One call runs the whole layer forward of every EP rank it carries (leading dimension R): R = 1 inside
``shard_map`` (the calling rank against its workspace), or R = ep on one GPU against an emulated workspace
(mok_jax.emulation). The kernel's per-call scratch (the receive ring, activations, the schedule) is an
extra output that XLA allocates and frees; nothing a later call needs stays in the workspace.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._native import require_native
from mok_jax import tuning
from mok_jax.config import KernelConfig
from mok_jax.fp8 import Fp8ExpertWeights
from mok_jax.validation import KEPT_GU_DTYPE, check_fp8_expert_weights, check_workspace_call

__all__ = ["ITEM_FIELDS", "ITEM_TIME_FIELDS", "ITEM_TIME_KINDS", "TIMING_MODES", "first_ring_token", "item_list",
           "item_times_offset", "moe_forward", "resolve_kernel", "scratch_bytes"]

# Ranks one emulated call carries: kMaxEmulatedRanks in ffi/include/mok/moe/forward.cuh (above kMaxVirtualRanks, 8,
# each rank's kernel parameters travel in its row of the scratch: forward_params.cuh, ManyParams).
_MAX_EMULATED_RANKS = 64


def _lib():
    """The native library with its ctypes declarations (no GPU needed: scratch sizes are host arithmetic)."""
    from mok_jax import _native
    from mok_jax.workspace.native import _declare

    lib = _native.library()
    if lib is None:
        require_native("mok_jax.ops.moe_forward")
    _declare(lib)
    return lib


def scratch_bytes(*, tokens: int, hidden: int, inter: int, shared_inter: int, top_k: int, local_experts: int,
                  ep: int, kernel: KernelConfig, identity_experts: bool = False, fp8: bool = False) -> int:
    """Bytes of one rank's per-call scratch (the ring of ``kernel.ring_slots`` microbatch slots dominates; ``fp8``:
    the FP8 routed experts' ring, with E4M3 activations and their scales). Raises ValueError, saying why, for a call
    the kernel does not support."""
    lib = _lib()
    args = [int(tokens), int(hidden), int(inter), int(shared_inter), int(top_k), int(local_experts), int(ep),
            kernel.granularity, kernel.comm_items_fwd, kernel.ring_slots, int(bool(fp8))]
    n = int(lib.mok_moe_scratch_bytes(*args, int(bool(identity_experts))))
    if n < 0:
        buf = ctypes.create_string_buffer(256)
        lib.mok_moe_unsupported(*args, buf, len(buf))
        raise ValueError(f"implementation='mok' does not support this call: {buf.value.decode()}")
    return n


def item_times_offset(*, tokens: int, hidden: int, inter: int, shared_inter: int, top_k: int, local_experts: int,
                      ep: int, kernel: KernelConfig, identity_experts: bool = False) -> int:
    """Where in one rank's scratch (bf16 form) the lab form's item times lie: the native layout's byte offset
    (mok_moe_item_times_offset; the arguments of scratch_bytes)."""
    args = [int(tokens), int(hidden), int(inter), int(shared_inter), int(top_k), int(local_experts), int(ep),
            kernel.granularity, kernel.comm_items_fwd, kernel.ring_slots, 0, int(bool(identity_experts))]
    at = int(_lib().mok_moe_item_times_offset(*args))
    if at < 0:
        raise ValueError("implementation='mok' does not support this call (scratch_bytes says why)")
    return at


# The words of one item of item_list (mok/moe/forward.cuh, kForwardItemWords): its kind (an index of
# ITEM_TIME_KINDS), microbatch, index and count within its communication phase, and a tile's expert, rows [row0,
# row_end) of the ring slot (of the T tokens for the shared expert's), column block and m-block counter.
ITEM_FIELDS = ("kind", "mb", "idx", "count", "group", "row0", "row_end", "n_block", "mblock")


def item_list(rows, *, tokens: int, hidden: int, inter: int, shared_inter: int, top_k: int, local_experts: int,
              ep: int, kernel: KernelConfig, ctas: int, timing_mode: int = 0) -> np.ndarray:
    """The forward kernel's work items of one rank in ticket order, as its CTAs decode them, computed on the host by
    the native library with the kernel's own plan, segment writer and decoder (mok_moe_item_list; no GPU):
    int32[n, len(ITEM_FIELDS)]. For tests and reading of the order. ``rows``: int32[microbatches, local_experts],
    the rows each microbatch brings each local expert (KernelConfig.microbatches); ``ctas``: the rank's CTAs;
    ``timing_mode``: the lab's bits that change the order. Raises ValueError for a call the kernel does not
    support, RuntimeError when the dynamic part's segments would overflow the table the plan sizes for them."""
    _, microbatches, _ = kernel.microbatches(int(tokens))
    counts = np.ascontiguousarray(rows, np.int32)
    if counts.shape != (microbatches, int(local_experts)):
        raise ValueError(f"rows must be [microbatches, local_experts] = [{microbatches}, {local_experts}], got "
                         f"{counts.shape}")
    if (counts < 0).any():
        raise ValueError("rows must be counts, >= 0")
    _one_shared_down_order(int(timing_mode), "item_list")
    args = [int(tokens), int(hidden), int(inter), int(shared_inter), int(top_k), int(local_experts), int(ep),
            kernel.granularity, kernel.comm_items_fwd, kernel.ring_slots, int(timing_mode), int(ctas)]
    lib = _lib()
    n = int(lib.mok_moe_item_list(*args, counts.ctypes.data, None, 0))
    if n == -1:
        raise ValueError("implementation='mok' does not support this call (scratch_bytes says why), or ctas < 1")
    if n == -2:
        raise RuntimeError("the forward's segment table would overflow its bound (Plan::max_segments)")
    out = np.zeros((n, len(ITEM_FIELDS)), np.int32)
    lib.mok_moe_item_list(*args, counts.ctypes.data, out.ctypes.data, n)
    return out


def resolve_kernel(ws, kernel: KernelConfig | None, *, tokens: int, hidden: int, inter: int, top_k: int,
                   local_experts: int) -> KernelConfig:
    """The knobs a call of ``moe_forward`` on workspace ``ws`` with this per-rank problem runs with: ``kernel``, else
    the tuned table of the workspace's device, else the heuristic (mok_jax.tuning)."""
    key = tuning.ProblemKey(hidden=hidden, intermediate=inter, top_k=top_k, experts_per_rank=local_experts,
                            ep=ws.config.ep, tokens=tokens)
    return tuning.resolve(kernel, key, ws.device_kind)


def first_ring_token(kernel: KernelConfig, tokens: int) -> int:
    """The first of a rank's ``tokens`` whose microbatch is still in the receive ring when the forward ends
    (KernelConfig.first_ring_token)."""
    return kernel.first_ring_token(tokens)


def _require_push_combine(kernel: KernelConfig | None, where: str) -> None:
    """The megakernel's combine pushes one row per slot into the origin (y's terms are the same at every EP size,
    docs/kernel.md), so it has no pull form; KernelConfig.combine="pull" is the standalone combine op's alone."""
    if kernel is not None and kernel.combine != "push":
        raise ValueError(f"{where}: KernelConfig.combine={kernel.combine!r} is not a form of the layer: its forward "
                         f"pushes each slot's row to the token's rank, so that y has the same bits at every EP size "
                         f"(\"pull\" is the standalone mok_jax.ops.combine's); use combine=\"push\"")


# Timing variants (mok/moe/forward.cuh, TimingMode): a phase's row moves left out of the call, or done twice.
TIMING_MODES = {"no dispatch rows": 1, "no send rows": 2, "no reduce rows": 4, "dispatch rows twice": 8,
                "reduce rows twice": 16, "item times": 32, "shared down early": 64,
                "shared down late": 128}


def _one_shared_down_order(timing_mode: int, where: str) -> None:
    both = TIMING_MODES["shared down early"] | TIMING_MODES["shared down late"]
    if timing_mode & both == both:
        raise ValueError(f"{where}: timing_mode {timing_mode} asks for both orders of the shared expert's down tiles "
                         f"(\"shared down early\" 64 and \"shared down late\" 128); give one")


# The "item times" bit changes no work: each rank's consumers time their items into words of the sync region
# (ffi/include/mok/moe/plan.cuh, kItemTimeWords), and the call also returns them: uint32[R, 12, 5, 2], the u64 fields
# of ITEM_TIME_FIELDS per ITEM_TIME_KINDS as (low, high) words, in globaltimer ns.
ITEM_TIME_KINDS = ("post", "count", "scan", "place", "dispatch", "shared gate/up", "shared down", "gate/up", "down",
                   "send", "reduce", "consumers")
ITEM_TIME_FIELDS = ("busy ns", "waited ns", "items", "first start (complement)", "last end")
_ITEM_TIME_BYTES = 8 * len(ITEM_TIME_KINDS) * len(ITEM_TIME_FIELDS)


def moe_forward(ws, x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, gate_up: jax.Array,
                down: jax.Array, shared_gate_up: jax.Array | None, shared_down: jax.Array | None, *,
                kernel: KernelConfig | None = None, identity_experts: bool = False, skip_rank: int = -1,
                num_sms: int = 0, timing_mode: int = 0, keep_pos: jax.Array | None = None,
                keep_rows: int = 0, keep_shared: bool = False,
                fp8_weights: Fp8ExpertWeights | None = None) -> tuple[jax.Array, ...]:
    """The MoE forward of R ranks: x: bf16[R, T, H]; topk_idx: int32[R, T, k] (global expert ids, -1 =
    masked slot); topk_weight: f32[R, T, k]; gate_up: bf16[R, L, H, 2I]; down: bf16[R, L, I, H] (rank r's
    experts); shared_gate_up: bf16[H, 2Is] and shared_down: bf16[Is, H], or None.

    Returns y: bf16[R, T, H] and status: int32[R, 4] ({error code, op, rank that saw it, peer or token};
    zeros when the call went well). identity_experts (a test mode) replaces every expert by the identity
    and drops the shared expert, so the data path can be checked bitwise; skip_rank (another) makes one
    emulated rank skip the call; num_sms caps the persistent CTAs (0: every SM); timing_mode (bench only) is
    a sum of TIMING_MODES's bits: those phases move no rows (wrong outputs) or move them twice, every stamp
    still runs, so that differences of timings say what a phase costs the call; with the "item times" bit (which
    changes no work) the call also returns, last, each rank's item times: uint32[R, 12, 5, 2], the u64 fields of
    ITEM_TIME_FIELDS per ITEM_TIME_KINDS as (low, high) words (mok_jax.bench.breakdown.item_times); the "shared
    down early" and "shared down late" bits (one at most) change only the order of the work (the same bits): the
    shared expert's down tiles before the first microbatch's gate/up tiles, or after them, at any EP size (without
    either, late at EP 1 and early above: ffi/include/mok/moe/plan.cuh). A call with
    skip_rank >= 0 or timing_mode != 0 runs the kernel's lab form, the only one compiled with their code (bf16
    only); every other call runs a production form without it. kernel None: the tuned table of the workspace's
    device, else the heuristic (mok_jax.tuning), for this call's per-rank problem.

    keep_pos (the backward's kept g, u, MoEConfig.keep): int32[R, ep * T * k], the row that each slot (s, t, j) of
    the EP group (source rank s, its token t, slot j; flat (s T + t) k + j) takes in a kept bf16[keep_rows, 2I]
    buffer of rank r's experts' g | u (its fp32 gate/up accumulators rounded to bf16, as the backward rounds its
    recompute), or any value outside [0, keep_rows) for none. Then the call also returns keep_gu: bf16[R,
    keep_rows, 2I] (rows no slot names are not written): (y, status, keep_gu). The other outputs do not change.
    keep_shared (with a shared expert): the call also returns, last, the shared expert's g | u of each rank's tokens,
    bf16[R, T, 2Is], its fp32 gate/up accumulators rounded to bf16 as keep_gu's: (y, status[, keep_gu], shared_gu).

    fp8_weights (MoEConfig(precision="fp8")): rank r's routed experts in E4M3 (mok_jax.fp8.Fp8ExpertWeights with a
    leading rank axis: gate_up f8[R, L, 2I, H], gate_up_scale f32[R, L, 2I/128, H/128], down f8[R, L, H, I],
    down_scale f32[R, L, H/128, I/128], from quantize_expert_weights). The routed experts then run in FP8 from them
    (each token row quantised in 1 x 128 tiles once, by its source), and gate_up and down are only checked
    against them; H and I must be multiples of 128; not with keep_pos, identity_experts, skip_rank or timing_mode.
    """
    if kernel is not None and not isinstance(kernel, KernelConfig):
        raise TypeError(f"kernel must be a mok_jax.KernelConfig or None, got {type(kernel).__name__}")
    where = "mok_jax.ops.moe_forward"
    arrays = (("x", x, 3, jnp.bfloat16), ("topk_idx", topk_idx, 3, jnp.int32), ("topk_weight", topk_weight, 3,
              jnp.float32), ("gate_up", gate_up, 4, jnp.bfloat16), ("down", down, 4, jnp.bfloat16))
    R, T, H = x.shape if x.ndim == 3 else (0, 0, 0)  # a bad rank is reported by the check
    check_workspace_call(ws, where, arrays, ranks=R, tokens=T, hidden=H, max_ranks=_MAX_EMULATED_RANKS)
    cfg = ws.config
    k = topk_idx.shape[2]
    if topk_idx.shape[:2] != (R, T) or topk_weight.shape != topk_idx.shape:
        raise ValueError(f"mok_jax.ops.moe_forward: topk_idx and topk_weight must be [{R}, {T}, k], got "
                         f"{topk_idx.shape} and {topk_weight.shape}")
    if not 1 <= k <= cfg.top_k:
        raise ValueError(f"mok_jax.ops.moe_forward: top_k ({k}) must be in [1, {cfg.top_k}] (the workspace's)")
    L, I2 = gate_up.shape[1], gate_up.shape[3]
    if gate_up.shape[0] != R or gate_up.shape[2] != H or I2 % 2:
        raise ValueError(f"mok_jax.ops.moe_forward: gate_up must be [{R}, L, {H}, 2I], got {gate_up.shape}")
    inter = I2 // 2
    if L * cfg.ep != cfg.num_experts:
        raise ValueError(f"mok_jax.ops.moe_forward: gate_up holds {L} experts per rank; the workspace has "
                         f"{cfg.num_experts // cfg.ep}")
    if down.shape != (R, L, inter, H):
        raise ValueError(f"mok_jax.ops.moe_forward: down must be {(R, L, inter, H)}, got {down.shape}")
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("mok_jax.ops.moe_forward: shared_gate_up and shared_down must both be given or both None")
    if shared_gate_up is None or identity_experts:
        shared_gate_up = jnp.zeros((H, 0), jnp.bfloat16)
        shared_down = jnp.zeros((0, H), jnp.bfloat16)
    if shared_gate_up.dtype != jnp.bfloat16 or shared_down.dtype != jnp.bfloat16:
        raise TypeError("mok_jax.ops.moe_forward: the shared expert's weights must be bfloat16")
    Is = shared_gate_up.shape[1] // 2
    if shared_gate_up.shape != (H, 2 * Is) or shared_down.shape != (Is, H):
        raise ValueError(f"mok_jax.ops.moe_forward: shared weights must be [{H}, 2Is] and [Is, {H}], got "
                         f"{shared_gate_up.shape} and {shared_down.shape}")
    if not isinstance(timing_mode, (int, np.integer)) or not 0 <= timing_mode <= sum(TIMING_MODES.values()):
        raise ValueError(f"mok_jax.ops.moe_forward: timing_mode must be a sum of {TIMING_MODES}, got {timing_mode!r}")
    _one_shared_down_order(timing_mode, "mok_jax.ops.moe_forward")
    if keep_pos is None:
        keep_pos, keep_rows = jnp.zeros((R, 0), jnp.int32), 0
    elif identity_experts:
        raise ValueError("mok_jax.ops.moe_forward: keep_pos with identity_experts: the test mode runs no gate/up "
                         "GEMM, so there is nothing to keep")
    else:
        if keep_pos.dtype != jnp.int32 or keep_pos.shape != (R, cfg.ep * T * k):
            raise ValueError(f"mok_jax.ops.moe_forward: keep_pos must be int32[{R}, {cfg.ep * T * k}] (ep * T * k), "
                             f"got {keep_pos.dtype}{list(keep_pos.shape)}")
        if isinstance(keep_rows, bool) or not isinstance(keep_rows, (int, np.integer)) or not 0 < keep_rows < 2**31:
            raise ValueError(f"mok_jax.ops.moe_forward: keep_rows must be an int in [1, 2^31) with keep_pos, got "
                             f"{keep_rows!r}")
    if not isinstance(keep_shared, (bool, np.bool_)):
        raise TypeError(f"mok_jax.ops.moe_forward: keep_shared must be a bool, got {type(keep_shared).__name__}")
    if keep_shared and Is == 0:
        raise ValueError("mok_jax.ops.moe_forward: keep_shared needs a shared expert (shared_gate_up and shared_down; "
                         "identity_experts drops it)")
    fp8 = fp8_weights is not None
    if fp8:
        if keep_rows or keep_shared or identity_experts:
            raise ValueError("mok_jax.ops.moe_forward: fp8_weights cannot be combined with keep_pos, keep_shared or "
                             "identity_experts "
                             "(the FP8 forward keeps nothing, and its test of the data path is the bitwise match with "
                             "the standalone FP8 FFN)")
        for name, lab in (("timing_mode", timing_mode != 0), ("skip_rank", skip_rank >= 0)):
            if lab:
                raise ValueError(f"mok_jax.ops.moe_forward: {name} with fp8_weights: that mode is compiled into the "
                                 f"kernel's bf16 lab form only (the FP8 kernel carries no code for it); use the bf16 "
                                 f"weights")
        if not isinstance(fp8_weights, Fp8ExpertWeights):
            raise TypeError(f"mok_jax.ops.moe_forward: fp8_weights must be a mok_jax.fp8.Fp8ExpertWeights, got "
                            f"{type(fp8_weights).__name__}")
        for name, a in fp8_weights._asdict().items():
            if getattr(a, "ndim", 0) != 4 or a.shape[:2] != (R, L):
                raise ValueError(f"mok_jax.ops.moe_forward: fp8_weights.{name} must be [{R}, {L}, ...] (ranks, experts "
                                 f"per rank), got {getattr(a, 'shape', None)}")
        flat = Fp8ExpertWeights(*(a.reshape(R * L, *a.shape[2:]) for a in fp8_weights))
        if check_fp8_expert_weights(flat, R * L, H, name="fp8_weights", source="ranks x experts per rank and H from "
                                    "gate_up") != inter:
            raise ValueError(f"mok_jax.ops.moe_forward: fp8_weights has another intermediate size than gate_up ({inter})")
    require_native("mok_jax.ops.moe_forward")
    kernel = resolve_kernel(ws, kernel, tokens=T, hidden=H, inter=inter, top_k=k, local_experts=L)
    _require_push_combine(kernel, where)  # a given kernel or the tuned table's
    nbytes = scratch_bytes(tokens=T, hidden=H, inter=inter, shared_inter=Is, top_k=k, local_experts=L, ep=cfg.ep,
                           kernel=kernel, identity_experts=identity_experts, fp8=fp8)
    out = (
        jax.ShapeDtypeStruct((R, T, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((R, 4), jnp.int32),
        jax.ShapeDtypeStruct((R, nbytes), jnp.uint8),
        jax.ShapeDtypeStruct((R, int(keep_rows), 2 * inter), KEPT_GU_DTYPE),  # kept g | u ([R, 0, 2I]: none)
        jax.ShapeDtypeStruct((R, T if keep_shared else 0, 2 * Is), KEPT_GU_DTYPE),  # the shared expert's
    )
    attrs = dict(ws_id=np.int64(ws.id), granularity=np.int32(kernel.granularity),
                 comm_items=np.int32(kernel.comm_items_fwd), ring_slots=np.int32(kernel.ring_slots),
                 dispatch_push=np.int32(kernel.dispatch == "push"),
                 num_sms=np.int32(num_sms), identity_experts=np.int32(bool(identity_experts)),
                 skip_rank=np.int32(skip_rank), timing_mode=np.int32(timing_mode))
    if fp8:  # the same handler body and attributes (ffi/src/ffi_moe.cu), the routed weights in E4M3
        y, status, _ = jax.ffi.ffi_call("mok_moe_forward_fp8", out[:3], has_side_effect=True,
                                        vmap_method="sequential")(
            x, topk_idx, topk_weight, *fp8_weights, shared_gate_up, shared_down, **attrs)
        return y, status
    y, status, scratch, keep_gu, shared_gu = jax.ffi.ffi_call(  # vmap: comm.py
        "mok_moe_forward", out, has_side_effect=True, vmap_method="sequential")(
        x, topk_idx, topk_weight, gate_up, down, shared_gate_up, shared_down, keep_pos, **attrs)
    times = ()
    if timing_mode & TIMING_MODES["item times"]:
        at = item_times_offset(tokens=T, hidden=H, inter=inter, shared_inter=Is, top_k=k, local_experts=L,
                               ep=cfg.ep, kernel=kernel, identity_experts=identity_experts)
        words = jax.lax.bitcast_convert_type(scratch[:, at:at + _ITEM_TIME_BYTES].reshape(R, -1, 4), jnp.uint32)
        times = (words.reshape(R, len(ITEM_TIME_KINDS), len(ITEM_TIME_FIELDS), 2),)
    return (y, status) + ((keep_gu,) if keep_rows else ()) + ((shared_gu,) if keep_shared else ()) + times
