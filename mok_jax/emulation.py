"""Any EP size on one GPU: the megakernel's expert-parallel protocol with every rank on the same device.

docs/design.md, "EP on one GPU (emulation)": the kernels take their EP rank and peer table as parameters,
so ``ep`` ranks run against ``ep`` workspaces on one device, in one launch whose CTAs split into the
ranks. Everything of the real protocol runs (routing exchange, schedule, pull/push dispatch through the
peers' row buffers, the receive ring, push/pull combine, the epoch stamps, timeouts); only NVLink is
replaced by the device's own memory, so this checks correctness at any EP size, not NVLink speed.

    y, status = emulated_moe(x, topk_idx, topk_weight, weights, ep=4)   # x: [4 * T, H], weights: all E experts
    dx, d_topk_weight, d_weights = emulated_moe_backward(x, topk_idx, topk_weight, weights, dy, ep=4)

Rank r holds tokens [r*T, (r+1)*T) and experts [r*E/ep, (r+1)*E/ep), as under ``expert_parallel_moe``.

EP sizes: the forward and the fused backward take up to MAX_EMULATED_RANKS (64) ranks in one launch, at most one per
persistent CTA (the device's SMs, or num_sms); up to 8 with every rank's kernel parameters in the parameter space,
above that with them in device memory (the forward: each rank's scratch, ffi/include/mok/moe/forward_params.cuh,
ManyParams; the backward: each rank's row of its counters scratch, ffi/include/mok/backward/params.cuh,
ManyLaunchParams). The backward's collectives path (fused=False) takes up to 64 too.

The backward at EP size > 1 is one fused kernel per rank (mok_jax.ops.experts_backward_ep: the token rows and the
slots' dx rows cross NVLink inside it); its emulation runs every rank in one launch on an emulated workspace, as
the forward's does. With the op's reference injected (the CPU tests) it runs the layer's collectives path instead,
each collective replaced by what it computes.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mok_jax import ops
from mok_jax._native import require_native
from mok_jax.backward_types import EXPERTS_BACKWARD_MAX_EMULATED_RANKS
from mok_jax.config import KernelConfig
from mok_jax.fp8 import Fp8ExpertWeights, quantize_expert_weights
from mok_jax.ops.moe_forward import TIMING_MODES
from mok_jax.validation import check_fp8_expert_weights, check_moe_args
from mok_jax.weights import MoEWeights
from mok_jax.workspace import Workspace, emulated_workspace

__all__ = ["MAX_EMULATED_RANKS", "emulated_moe", "emulated_moe_backward"]


# Ranks one emulated launch of the forward carries (kMaxEmulatedRanks, ffi/include/mok/moe/forward.cuh): up to 8 with
# every rank's kernel parameters in the parameter space, as at EP 1, above that with them in each rank's scratch.
MAX_EMULATED_RANKS = 64


def _check_ep(ep, max_ranks: int, why: str) -> None:
    """``ep`` an int in [1, max_ranks] (``why``: the limit's reason, for the error)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or not 1 <= ep <= max_ranks:
        raise ValueError(f"ep must be an int in [1, {max_ranks}] ({why}), got {ep!r}")


def _check_ep_fits(ep: int, device, num_sms: int | None) -> None:
    """Every emulated rank needs a persistent CTA of its own (CTA b serves rank b % ep): ``ep`` at most the launch's
    CTAs, the SMs of ``device`` (when known: a GPU device's core_count) or ``num_sms`` where that caps them."""
    sms = getattr(device, "core_count", None) if device is not None else None
    ctas = [n for n in (sms, num_sms) if isinstance(n, int) and n > 0]
    if ctas and ep > min(ctas):
        where = f"num_sms={num_sms}" if num_sms and (sms is None or num_sms < sms) else f"the {sms} SMs of {device}"
        raise ValueError(f"ep={ep} exceeds the {min(ctas)} persistent CTAs of one emulated launch ({where}): every "
                         f"emulated rank needs a CTA of its own, so ep must be at most that")


def _default_gpu(device):
    """``device``, else the first GPU (None when there is none: require_native then says why)."""
    return device if device is not None else next((d for d in jax.devices() if d.platform == "gpu"), None)


def _check_emulated_args(x, topk_idx, topk_weight, weights: MoEWeights, ep: int, max_ranks: int = MAX_EMULATED_RANKS,
                         why: str = "the ranks one emulated launch of the forward carries"):
    """The global arrays of an emulated call (as jax arrays), checked: ep in [1, max_ranks] (``why``), the layer's
    arguments, and experts and tokens divisible by ep."""
    _check_ep(ep, max_ranks, why)
    x, topk_idx, topk_weight = jnp.asarray(x), jnp.asarray(topk_idx), jnp.asarray(topk_weight)
    check_moe_args(x, topk_idx, topk_weight, weights, num_ep_ranks=1)
    if weights.num_local_experts % ep:
        raise ValueError(f"the number of experts ({weights.num_local_experts}) must be divisible by ep={ep}")
    if x.shape[0] % ep:
        raise ValueError(f"x must hold ep * T tokens: {x.shape[0]} is not divisible by ep={ep}")
    return x, topk_idx, topk_weight


def _per_rank(a: jax.Array, ep: int) -> jax.Array:
    """A global array [ep * n, ...] as [ep, n, ...]: rank r's rows in row r."""
    return a.reshape(ep, a.shape[0] // ep, *a.shape[1:])


def _emulated_workspace(workspace, device, ep: int, x, topk_idx, num_experts: int, timeout_s: float) -> Workspace:
    """The call's emulated workspace: ``workspace``, else the cached one of ``device`` (default: the first GPU)
    for this shape."""
    device = _default_gpu(device)
    ws = workspace or emulated_workspace(device, ep, max_tokens=x.shape[0] // ep, hidden_size=x.shape[1],
                                         top_k=topk_idx.shape[1], num_experts=num_experts, timeout_s=timeout_s)
    if not ws.emulated or ws.config.ep != ep:
        raise ValueError(f"workspace must be an emulated workspace of {ep} ranks, got {ws}")
    return ws


def emulated_moe(x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, weights: MoEWeights, *, ep: int,
                 kernel: KernelConfig | None = None, workspace: Workspace | None = None, device: jax.Device | None = None,
                 identity_experts: bool = False, skip_rank: int = -1, timeout_s: float = 10.0,
                 num_sms: int = 0, timing_mode: int = 0, keep: bool = False, precision: str = "bf16",
                 fp8_weights: Fp8ExpertWeights | None = None) -> tuple:
    """The layer forward at EP size ``ep``, every rank on one GPU (``device``, default the first GPU).

    x: bf16[ep * T, H]; topk_idx: int32[ep * T, k] (global ids, -1 = masked); topk_weight: f32[ep * T, k];
    weights: the global MoEWeights (gate_up [E, H, 2I] with E divisible by ep). Returns (y: bf16[ep * T, H],
    status: int32[ep, 4]) where rank r's tokens are rows [r*T, (r+1)*T). ``workspace``: an emulated one
    (default: cached per device, ep and shape); identity_experts, skip_rank: the kernel's test modes;
    timing_mode: its bench-only timing mode (ops.moe_forward; with its "item times" bit the call returns (y,
    status, item times)). keep: also return each rank's kept g, u
    (MoEConfig(keep="everything")): (y, status, [mok_jax.layer.KeptGateUp of rank r for r in range(ep)]), for
    ``emulated_moe_backward(..., kept=...)``. precision "fp8" (MoEConfig.precision): the routed experts in E4M3 from
    ``fp8_weights`` (all E experts, mok_jax.fp8.quantize_expert_weights), else from the weights quantised here.
    Jit-compatible when ``workspace`` is given or the shapes are static (the workspace is set up at trace time).
    """
    x, topk_idx, topk_weight = _check_emulated_args(x, topk_idx, topk_weight, weights, ep)
    num_experts = weights.num_local_experts
    if not -1 <= skip_rank < ep:
        raise ValueError(f"skip_rank must be -1 (none) or in [0, {ep}), got {skip_rank}")
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"precision must be 'bf16' or 'fp8', got {precision!r}")
    if fp8_weights is not None and precision != "fp8":
        raise ValueError("fp8_weights is given but precision is 'bf16'")
    _check_ep_fits(ep, _default_gpu(device), num_sms)
    require_native("mok_jax.emulation.emulated_moe")
    tokens, H = x.shape[0] // ep, x.shape[1]
    ws = _emulated_workspace(workspace, device, ep, x, topk_idx, num_experts, timeout_s)
    per_rank = functools.partial(_per_rank, ep=ep)
    fp8 = {}
    if precision == "fp8":
        if fp8_weights is None:
            fp8_weights = quantize_expert_weights(weights.gate_up, weights.down)
        check_fp8_expert_weights(fp8_weights, num_experts, H, name="fp8_weights", source="E and H from weights")
        fp8 = dict(fp8_weights=Fp8ExpertWeights(*map(per_rank, fp8_weights)))
    try:
        item_times = bool(operator.index(timing_mode) & TIMING_MODES["item times"])
    except TypeError:  # ops.moe_forward names the bad value
        item_times = False
    if item_times and keep:
        raise ValueError("emulated_moe: keep and the \"item times\" timing mode cannot be asked together")
    layouts, kept = None, {}
    if keep:
        from mok_jax.layer import op_layout

        layouts = [op_layout(topk_idx, num_experts // ep, r) for r in range(ep)]
        kept = dict(keep_pos=jnp.stack([lay.pos.reshape(-1) for lay in layouts]), keep_rows=layouts[0].num_rows,
                    keep_shared=weights.has_shared)
    y, status, *gu = ops.moe_forward(
        ws, per_rank(x).astype(jnp.bfloat16), per_rank(topk_idx), per_rank(topk_weight.astype(jnp.float32)),
        per_rank(weights.gate_up.astype(jnp.bfloat16)), per_rank(weights.down.astype(jnp.bfloat16)),
        None if weights.shared_gate_up is None else weights.shared_gate_up.astype(jnp.bfloat16),
        None if weights.shared_down is None else weights.shared_down.astype(jnp.bfloat16),
        kernel=kernel, identity_experts=identity_experts, skip_rank=skip_rank, num_sms=num_sms,
        timing_mode=timing_mode, **kept, **fp8)
    if item_times:
        return y.reshape(ep * tokens, H), status, gu[-1]
    if not keep:
        return y.reshape(ep * tokens, H), status
    from mok_jax.layer import KeptGateUp

    return y.reshape(ep * tokens, H), status, [
        KeptGateUp(gu[0][r], layouts[r], shared_gu=gu[1][r] if weights.has_shared else None) for r in range(ep)]


def emulated_moe_backward(x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, weights: MoEWeights,
                          dy: jax.Array, *, ep: int, experts_fn=None, kept=None, kernel: KernelConfig | None = None,
                          workspace: Workspace | None = None, device: jax.Device | None = None,
                          skip_rank: int = -1, timeout_s: float = 10.0, num_sms: int | None = None,
                          return_status: bool = False, fused: bool | None = None):
    """The gradients of implementation='mok' at EP size ``ep``, every rank on one device: (dx, d topk_weight,
    d weights) of the global arrays (shapes as ``emulated_moe``'s, dy: [ep * T, H]).

    ``fused`` (default: the layer's setting, mok_jax.layer.FUSED_EP_BACKWARD; never with ``experts_fn``): the routed
    backward of every rank runs in one launch of the fused expert-parallel op (mok_jax.ops.experts_backward_ep) on
    an emulated workspace (``workspace``, default cached per device, ep and shape), its communication included, as
    each rank runs it under shard_map (mok_jax.layer._routed_backward_fused); ``kernel``'s comm_items_bwd, num_sms and
    the test mode skip_rank go to it.

    Otherwise rank r's routed backward is mok_jax.layer.routed_backward_rank with ``experts_fn``
    (mok_jax.ops.experts_backward when None; the tests pass its reference) over every rank's tokens (the
    all-gather's result: the global arrays) and its own experts, and the reduce-scatter becomes the sum of the
    ranks' parts (each slot has one owner: the sum adds zeros), as the layer's collectives path does.
    return_status also returns the op's status (int32[ep]).

    Either way the slot-order sum runs per rank on its tokens, the shared expert's backward likewise (in XLA), and
    the shared weights' psum is the sum over the ranks in rank order. ``kept``: the ranks' kept g, u from
    ``emulated_moe(..., keep=True)`` (MoEConfig(keep="everything")), or None.
    """
    from mok_jax import layer
    from mok_jax.layer import drop_invalid_tokens, finish_backward, op_layout, routed_backward_rank, slot_sum

    if fused and experts_fn is not None:
        raise ValueError("fused=True runs the fused op; experts_fn replaces the op of the collectives path")
    if fused is None:
        fused = experts_fn is None and layer.FUSED_EP_BACKWARD
    why = ("the ranks one emulated launch of the fused backward, mok_jax.ops.experts_backward_ep, carries" if fused
           else "as the forward's emulation")
    x, topk_idx, topk_weight = _check_emulated_args(
        x, topk_idx, topk_weight, weights, ep, EXPERTS_BACKWARD_MAX_EMULATED_RANKS if fused else MAX_EMULATED_RANKS,
        why)
    dy = jnp.asarray(dy)
    num_experts = weights.num_local_experts
    if dy.shape != x.shape:
        raise ValueError(f"dy must have x's shape {x.shape}, got {dy.shape}")
    if not fused and (skip_rank != -1 or workspace is not None or kernel is not None or num_sms is not None):
        raise ValueError("workspace, kernel, num_sms and skip_rank are arguments of the fused op: pass fused=True")
    if experts_fn is None:
        require_native("mok_jax.emulation.emulated_moe_backward")
        experts_fn = ops.experts_backward
    weights = jax.tree.map(lambda w: w.astype(x.dtype), weights)
    tokens, local = x.shape[0] // ep, num_experts // ep
    dy = drop_invalid_tokens(dy, topk_idx, num_experts, x.dtype)
    w32 = topk_weight.astype(jnp.float32)
    if kept is not None and len(kept) != ep:
        raise ValueError(f"kept must hold the kept g, u of each of the {ep} ranks, got {len(kept)}")
    if fused:
        ws = _emulated_workspace(workspace, device, ep, x, topk_idx, num_experts, timeout_s)
        layouts = [op_layout(topk_idx, local, r) for r in range(ep)] if kept is None else [c.layout for c in kept]
        gu = {}
        if kept is not None:
            args = [c.op_args() for c in kept]
            gu = {name: jnp.stack([a[name] for a in args]) for name in args[0]}
        per_rank = functools.partial(_per_rank, ep=ep)
        cfg = kernel if kernel is not None else KernelConfig()
        out = ops.experts_backward_ep(
            ws, per_rank(x), per_rank(dy), per_rank(topk_idx), jnp.broadcast_to(w32, (ep, *w32.shape)),
            jnp.stack([lay.src_slot for lay in layouts]), jnp.stack([lay.group_sizes for lay in layouts]),
            per_rank(weights.gate_up), per_rank(weights.down), num_sms=num_sms, comm_items=cfg.comm_items_bwd,
            skip_rank=skip_rank, **gu)
        dx_routed, dw = out.dx.reshape(x.shape), out.dw.reshape(topk_idx.shape)
        failed = jnp.any(out.status != 0)
        parts = [_Part(out.d_gate_up[r], out.d_down[r]) for r in range(ep)]
    else:
        parts = [routed_backward_rank(x, dy, topk_idx, w32, weights.gate_up[r * local:(r + 1) * local],
                                       weights.down[r * local:(r + 1) * local], r, experts_fn,
                                       None if kept is None else kept[r])
                 for r in range(ep)]
        dx_slots, dw = parts[0].dx_slots, parts[0].dw
        for p in parts[1:]:
            dx_slots, dw = dx_slots + p.dx_slots, dw + p.dw
        failed = functools.reduce(jnp.logical_or, [p.status != 0 for p in parts])
        dx_routed = slot_sum(dx_slots)
    rows = lambda a, r: a[r * tokens:(r + 1) * tokens]  # noqa: E731
    per_rank = [finish_backward(rows(x, r), rows(dy, r), rows(topk_weight, r), weights, rows(dx_routed, r),
                                         rows(dw, r), failed, parts[r].d_gate_up, parts[r].d_down,
                                         shared_gu=None if kept is None else kept[r].shared_gu)
                for r in range(ep)]
    dx = jnp.concatenate([g[0] for g in per_rank])
    d_topk_weight = jnp.concatenate([g[1] for g in per_rank])
    shared = [g[2] for g in per_rank]
    total = lambda name: None if getattr(shared[0], name) is None else functools.reduce(  # noqa: E731
        jnp.add, [getattr(d, name) for d in shared])
    d_weights = MoEWeights(jnp.concatenate([d.gate_up for d in shared]), jnp.concatenate([d.down for d in shared]),
                           total("shared_gate_up"), total("shared_down"))
    if return_status:
        return dx, d_topk_weight, d_weights, (out.status if fused else jnp.stack([p.status for p in parts]))
    return dx, d_topk_weight, d_weights


class _Part(NamedTuple):  # a rank's weight gradients from the fused op
    d_gate_up: jax.Array
    d_down: jax.Array
