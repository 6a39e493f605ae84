"""The layer module: the functional MoE op ``mok_jax.moe`` under one ``jax.custom_vjp``.

    y_t = shared(x_t) + sum_j topk_weight[t, j] * expert_{topk_idx[t, j]}(x_t)

``implementation="xla"`` runs the pure-JAX reference (``mok_jax.reference``); its backward is the
reference's VJP. ``implementation="mok"`` runs the forward as one CUDA megakernel per rank and call
(``mok_jax.ops.moe_forward``), which also keeps the gate/up accumulators g | u of the slots MoEConfig.keep names
(bf16; by default those a balanced routing fills). Its backward works on a padded expert-major layout of the slots
(``mok_jax.expert_layout``; ``op_layout``, on the GPU a native op unless MOK_JAX_NATIVE_LAYOUT=0) in one native op
(``mok_jax.ops.experts_backward``), which gathers the slots' rows, recomputes the g | u that were not kept, gives
the routed experts' gradients and sums each token's slot rows of dx in f32 in slot order; the shared expert's
backward is bf16 matmuls (f32 accumulation) in XLA, its dx added in f32. At EP size > 1 the fused op
(``mok_jax.ops.experts_backward_ep``) moves the rows over NVLink inside its kernel (``_backward_mok``); its routed
gradients are the bits of EP size 1. mok never falls back to another implementation.

Dtypes (checked at trace time, errors name the argument, the expected and the given dtype):

* ``x``: bf16 or f32; it is the compute dtype (matmul inputs, the SwiGLU activation) and the output's.
  ``implementation="mok"`` takes bf16 only.
* expert weights (``MoEWeights``): x's dtype, or f32 when x is bf16: f32 master weights are cast to bf16
  inside ``moe`` (their gradients come back in f32). A weight narrower than x (bf16 with f32 x) is an error.
* ``topk_weight``: f32 (bf16 is accepted and widened exactly); the weighted sum over the top-k slots runs
  in f32 whatever x's dtype, so an f32 router output keeps its precision in the bf16 path.
* ``topk_idx``: int32 global expert ids.

Routing values. An expert id of -1 marks a masked slot: it is skipped and its weight ignored (even a NaN
or inf weight: neither the output nor any gradient sees it, and its own gradient is 0), on both implementations.
Any other id outside [0, E) is invalid:

* concrete (not traced) ids are checked before tracing: ValueError;
* under ``jit`` both implementations give NaN rows for the affected tokens (every other row is computed
  as usual, never silently dropped), and report the first bad id through ``jax.experimental.checkify``
  (a ``checkify.debug_check``: free unless the caller checkifies, e.g.
  ``err, y = checkify.checkify(jax.jit(f), errors=checkify.user_checks)(...); err.throw()``). The
  megakernel also records it for ``Workspace.check()`` (``InvalidRoutingError``).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.sharding import NamedSharding, PartitionSpec as P

from mok_jax import _native, reference
from mok_jax._native import require_native
from mok_jax.backward_types import EXPERTS_BACKWARD_GROUP_ALIGN
from mok_jax.config import MoEConfig
from mok_jax.expert_layout import PaddedLayout, rank_layout  # rank_layout: a public piece of the backward here too
from mok_jax.fp8 import BLOCK as FP8_BLOCK, Fp8ExpertWeights, quantize_expert_weights
from mok_jax.memory import kept_rows  # the rows of the kept g | u: one formula for the layer and its memory terms
from mok_jax.ops.moe_forward import first_ring_token, resolve_kernel
from mok_jax.ops.routing import MAX_LAYOUT_EXPERTS, expert_layout_call
from mok_jax.validation import check_fp8_weights, check_moe_args, check_routing_values
from mok_jax.weights import MoEWeights

if TYPE_CHECKING:
    from mok_jax.workspace import Workspace

__all__ = ["check_workspace", "kept_rows", "moe", "report_invalid_ids"]


class KeptGateUp(NamedTuple):
    """What implementation='mok' keeps with MoEConfig(keep="everything"), and "balanced" at EP 1: gu bf16[M, 2I],
    the forward's fp32 gate/up accumulators (g | u), rounded to bf16, of every slot of this rank's experts, in the
    rows of ``layout`` (the padded expert-major layout its backward runs on; rows no slot takes are not written: the
    backward op zeroes the padding rows it reads). With keep="ring" and tokens past the ring, gu is bf16[ep T' k,
    2I], those of the slots of the ring's T' tokens per rank; with "balanced" at EP > 1, bf16[T k + 128 L, 2I], the
    layout's first rows; then ``row`` int32[M] gives each layout row's row of gu (-1: none, the backward recomputes
    it); else row is None. ``shared_gu``: with a shared expert, its g | u of the rank's tokens, bf16[T, 2Is], rounded
    as gu (the shared expert's backward then recomputes none), else None."""

    gu: jax.Array
    layout: PaddedLayout
    row: jax.Array | None = None
    shared_gu: jax.Array | None = None

    def op_args(self) -> dict:
        """The experts' backward op's keywords for these kept rows."""
        return dict(gu=self.gu) if self.row is None else dict(gu_part=self.gu, gu_part_row=self.row)


class MoEResiduals(NamedTuple):
    """What the backward pass keeps from the forward pass: its inputs, and with a MoEConfig.keep other than
    "nothing" on the mok path the forward's g, u (``kept``); the backwards recompute the rest."""

    x: jax.Array
    topk_idx: jax.Array
    topk_weight: jax.Array
    weights: MoEWeights
    kept: KeptGateUp | None = None
    fp8_weights: Fp8ExpertWeights | None = None  # kept only for its zero cotangent: the backward is bf16


def _ep_size(config: MoEConfig) -> int:
    if config.ep_axis is None:
        return 1
    try:
        return jax.lax.axis_size(config.ep_axis)
    except NameError as e:
        raise ValueError(
            f"MoEConfig.ep_axis={config.ep_axis!r} is not a mesh axis bound here: call moe inside "
            f"jax.shard_map over a mesh with that axis (mok_jax.expert_parallel_moe does this), or set ep_axis=None"
        ) from e


def _invalid_ids(topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """bool[T, k]: ids that are neither an expert in [0, num_experts) nor -1 (a masked slot)."""
    return (topk_idx < -1) | (topk_idx >= num_experts)


def _forward_xla(x, topk_idx, topk_weight, weights, config: MoEConfig):
    if config.ep_axis is None:
        y = reference.moe(x, topk_idx, topk_weight, weights)
    else:
        y = reference.ep_moe(x, topk_idx, topk_weight, weights, axis_name=config.ep_axis)
    # The reference sends an invalid id's slot nowhere (ids are global; dispatch skips them); the layer
    # makes that visible as the megakernel does: NaN rows for the tokens concerned, and only for them.
    bad_token = jnp.any(_invalid_ids(topk_idx, weights.num_local_experts * _ep_size(config)), axis=1)
    return jnp.where(bad_token[:, None], jnp.nan, y)


def report_invalid_ids(topk_idx: jax.Array, num_experts: int) -> None:
    """A checkify-able report of the first invalid id of topk_idx int32[T, k] (row-major; ids are global, in [0,
    num_experts) or -1), a no-op unless the caller checkifies, and when there are no slots. ``moe`` makes it for the
    tokens of its call (inside a caller's shard_map: the rank's own, and checkify names the shard);
    ``expert_parallel_moe`` for the global ones, outside its shard_map, whose ranks then make none
    (MoEConfig.checkify_ids off). A caller's own shard_map over Explicit axes can do the same: docs/errors.md."""
    if not topk_idx.size:  # nothing to report (and argmax has no empty form)
        return
    bad = _invalid_ids(topk_idx, num_experts)
    first = jnp.argmax(bad.reshape(-1))
    k = topk_idx.shape[1]
    checkify.debug_check(
        ~jnp.any(bad), "mok_jax.moe: topk_idx[{}, {}] = {} is neither an expert id in [0, " + str(num_experts)
        + ") nor -1 (masked); that token's output row is NaN", first // k, first % k, topk_idx.reshape(-1)[first])


def _every_expert_here(weights: MoEWeights, x: jax.Array) -> MoEWeights:
    """moe without an EP axis runs every expert on every token of x: on a mesh of Explicit axes, a weight sharded
    over a mesh axis that x's tokens are sharded over is gathered over that axis (an expert and a token cannot both
    be split over one axis); a no-op for other shardings, and on Auto meshes, where XLA chooses."""
    lead = jax.typeof(x).sharding.spec[0]
    token_axes = set(lead if isinstance(lead, tuple) else () if lead is None else (lead,))
    if not token_axes:
        return weights

    def without_token_axes(entry):  # a PartitionSpec entry (None, an axis or axes) less the token axes
        names = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a and a not in token_axes)
        return names[0] if len(names) == 1 else names or None

    def gather(w):
        sharding = jax.typeof(w).sharding
        spec = P(*map(without_token_axes, sharding.spec))
        return w if spec == sharding.spec else jax.sharding.reshard(w, NamedSharding(sharding.mesh, spec))

    return jax.tree.map(gather, weights)


def check_workspace(workspace, where: str = "mok_jax.moe") -> None:
    """``workspace`` (the argument beside the config) is a mok_jax.workspace.Workspace or None: TypeError naming it
    otherwise."""
    if workspace is None:
        return
    from mok_jax.workspace import Workspace

    if not isinstance(workspace, Workspace):
        raise TypeError(f"{where}: workspace must be a mok_jax.workspace.Workspace (mok_jax.workspace.moe_workspace "
                        f"or local_workspace, set up outside jit) or None, got {type(workspace).__name__}")


def _workspace(config: MoEConfig, workspace, x, topk_idx, weights: MoEWeights):
    """The megakernel's workspace for this call: ``workspace`` (moe's argument), or (without an EP axis) a local
    one."""
    from mok_jax.workspace import local_workspace

    ep = _ep_size(config)
    tokens, k = topk_idx.shape
    num_experts = weights.num_local_experts * ep
    ws = workspace
    if ws is None:
        if config.ep_axis is not None:
            raise ValueError(
                f"implementation='mok' inside shard_map over {config.ep_axis!r} needs the layer's workspace: "
                f"call mok_jax.expert_parallel_moe, or pass moe(..., workspace=mok_jax.workspace.moe_workspace("
                f"mesh, {config.ep_axis!r}, ...)) created outside jit")
        ws = local_workspace(max_tokens=tokens, hidden_size=x.shape[1], top_k=k, num_experts=num_experts)
    if ws.config.ep != ep:
        raise ValueError(f"the workspace spans {ws.config.ep} EP ranks, the mesh axis {config.ep_axis!r} {ep}")
    return ws


def _forward_mok(x, topk_idx, topk_weight, weights: MoEWeights, config: MoEConfig,
                 keep: tuple[jax.Array, int] | None = None, fp8_weights: Fp8ExpertWeights | None = None,
                 workspace=None):
    """moe() checked the arguments (bf16 x; every weight in x's dtype) and that the kernels are here. With
    ``keep`` = (keep_pos int32[ep T k], rows) (``_keep_plan``) it returns (y, the kept g | u: bf16[rows, 2I], the
    shared expert's: bf16[T, 2Is], or None without one). With
    config.precision "fp8" the routed experts run in E4M3: ``fp8_weights``, else the weights quantised here.
    ``workspace``: moe's (``_workspace``)."""
    from mok_jax import ops

    ws = _workspace(config, workspace, x, topk_idx, weights)
    kept = {} if keep is None else dict(keep_pos=keep[0].reshape(1, -1), keep_rows=keep[1],
                                        keep_shared=weights.has_shared)
    if config.precision == "fp8":
        w8 = fp8_weights if fp8_weights is not None else quantize_expert_weights(weights.gate_up, weights.down)
        kept["fp8_weights"] = jax.tree.map(lambda a: a[None], w8)
    y, _, *gu = ops.moe_forward(ws, x[None], topk_idx[None], topk_weight[None], weights.gate_up[None],
                                weights.down[None], weights.shared_gate_up, weights.shared_down, kernel=config.kernel,
                                **kept)
    if keep is None:
        return y[0]
    return y[0], gu[0][0], gu[1][0] if weights.has_shared else None


def _forward(x, topk_idx, topk_weight, weights, fp8_weights, config: MoEConfig, workspace):
    if config.implementation == "mok":
        return _forward_mok(x, topk_idx, topk_weight, weights, config, fp8_weights=fp8_weights, workspace=workspace)
    return _forward_xla(x, topk_idx, topk_weight, weights, config)


# config and workspace are static (nondiff) arguments, both hashable: the config by value, the workspace by its id
# (Workspace.__hash__), so that the forward and the backward see the same workspace
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _moe(x, topk_idx, topk_weight, weights, fp8_weights, config, workspace):
    return _forward(x, topk_idx, topk_weight, weights, fp8_weights, config, workspace)


# op_layout, routed_backward_rank, slot_sum, drop_invalid_tokens, finish_backward and FUSED_EP_BACKWARD: the
# pieces of the backward that mok_jax.emulation runs rank by rank, shared so that the emulation is the layer's
# backward and not a copy of it.
def _keep_plan(config: MoEConfig, x, topk_idx, weights: MoEWeights, layout: PaddedLayout, workspace=None):
    """What the forward keeps for ``config.keep`` (anything but "nothing") in this rank's backward ``layout``:
    (keep_pos int32[ep T k], the kept buffer's rows, row), where keep_pos gives each slot of the EP group (flat (s T +
    t) k + j) its row in the kept buffer (outside it: not kept) and row is KeptGateUp.row.

    "everything", and "ring" when every token fits in the ring, and "balanced" at EP 1: the layout's own rows
    (keep_pos = pos, M rows, row None). "balanced" at EP > 1: the layout's first T k + 128 L rows, in place (keep_pos
    = pos, row the identity below them, -1 past them). "ring" otherwise: the slots of tokens t >= the first ring
    token (of each source rank), numbered in layout order, ep (T - t0) k rows."""
    tokens, k = topk_idx.shape
    ep = _ep_size(config)
    m = layout.num_rows
    if config.keep == "balanced":
        rows = kept_rows("balanced", None, tokens=tokens, top_k=k, local_experts=weights.num_local_experts, ep=ep)
        if rows < m:
            r = jnp.arange(m, dtype=jnp.int32)
            return layout.pos.reshape(-1), rows, jnp.where(r < rows, r, -1)
    if config.keep == "ring":
        kernel = config.kernel  # else the knobs the forward call resolves (its workspace's tuned table)
        if kernel is None:
            kernel = resolve_kernel(_workspace(config, workspace, x, topk_idx, weights), None, tokens=tokens,
                                    hidden=x.shape[1], inter=weights.intermediate_size, top_k=k,
                                    local_experts=weights.num_local_experts)
        t0 = first_ring_token(kernel, tokens)
        if t0 > 0:
            slot = layout.src_slot  # (s T + t) k + j, -1 for padding
            mine = (slot >= 0) & (slot < ep * tokens * k) & ((slot // k) % tokens >= t0)
            row = jnp.where(mine, jnp.cumsum(mine.astype(jnp.int32)) - 1, -1).astype(jnp.int32)
            keep_pos = jnp.concatenate([row, jnp.full((1,), -1, jnp.int32)])[layout.pos.reshape(-1)]  # pos M: none
            return keep_pos, kept_rows("ring", kernel, tokens=tokens, top_k=k, local_experts=weights.num_local_experts,
                                       ep=ep), row
    return layout.pos.reshape(-1), m, None


def _moe_fwd(x, topk_idx, topk_weight, weights, fp8_weights, config, workspace):
    if config.implementation == "mok" and config.keep != "nothing":  # bf16 only (MoEConfig checks)
        ep, num_local = _ep_size(config), weights.num_local_experts
        if ep == 1:
            layout = op_layout(topk_idx, num_local, 0)
        else:
            layout = op_layout(jax.lax.all_gather(topk_idx, config.ep_axis, tiled=True), num_local,
                               jax.lax.axis_index(config.ep_axis))
        keep_pos, rows, row = _keep_plan(config, x, topk_idx, weights, layout, workspace)
        y, gu, shared_gu = _forward_mok(x, topk_idx, topk_weight, weights, config, keep=(keep_pos, rows),
                                        workspace=workspace)
        return y, MoEResiduals(x, topk_idx, topk_weight, weights, KeptGateUp(gu, layout, row, shared_gu))
    y = _forward(x, topk_idx, topk_weight, weights, fp8_weights, config, workspace)
    return y, MoEResiduals(x, topk_idx, topk_weight, weights, fp8_weights=fp8_weights)


def shared_gate_up_product(x: jax.Array, shared_gate_up: jax.Array) -> jax.Array:
    """The shared expert's g | u of tokens x, [T, 2Is] in x's dtype: x Wsgu accumulated in f32, rounded once, as the
    megakernel's forward keeps them (KeptGateUp.shared_gu) and as the routed experts' g, u are rounded."""
    return jnp.einsum("th,hn->tn", x, shared_gate_up, preferred_element_type=jnp.float32).astype(x.dtype)


def _shared_backward(x: jax.Array, weights: MoEWeights, dy: jax.Array, gu: jax.Array | None = None):
    """The shared SwiGLU expert's backward in XLA: (dx f32[T, H], d shared_gate_up, d shared_down), or (None,
    None, None) without a shared expert. x, dy: [T, H] and the shared weights in one dtype (bf16 on the layer's
    mok path; f32 only from the tests' reference runs, where the same code runs in f32). ``gu``: the forward's kept
    g | u of these tokens, bf16[T, 2Is] (KeptGateUp.shared_gu), used in place of the recompute x Wsgu (then four
    matmuls, not five), or None.

    Every matmul takes two operands of x's dtype and accumulates in f32 (in bf16: no f32 matmuls); the roundings
    are the routed kernel's (g, u rounded to x's dtype once, kept or recomputed, as ``shared_gate_up_product`` does;
    dgu and h rounded to x's dtype before their matmuls):

        g, u = split(round(x Wsgu));  h = silu(g) u;  dh = dy Wsd^T
        dgu = round([dh u silu'(g), dh silu(g)]);  dx = dgu Wsgu^T (kept f32, added to the routed experts' dx)
        d Wsd = round(h)^T dy;  d Wsgu = x^T dgu
    """
    if weights.shared_gate_up is None:
        return None, None, None
    wsgu, wsd = weights.shared_gate_up, weights.shared_down
    f32 = jnp.float32
    mm = functools.partial(jnp.einsum, preferred_element_type=f32)
    g, u = jnp.split((shared_gate_up_product(x, wsgu) if gu is None else gu).astype(f32), 2, axis=-1)
    h, dg, du = reference.swiglu_backward(g, u, mm("th,ih->ti", dy, wsd))
    dgu = jnp.concatenate([dg, du], axis=-1).astype(x.dtype)
    dx = mm("tn,hn->th", dgu, wsgu)
    d_wsd = mm("ti,th->ih", h.astype(x.dtype), dy).astype(wsd.dtype)
    d_wsgu = mm("th,tn->hn", x, dgu).astype(wsgu.dtype)
    return dx, d_wsgu, d_wsd


def _manual_axes(a) -> frozenset:
    """The manual mesh axes a value (or a jax.ShapeDtypeStruct) varies over (inside shard_map); empty outside it."""
    t = a if isinstance(a, jax.ShapeDtypeStruct) else jax.typeof(a)
    axis_type = getattr(t, "manual_axis_type", None)  # jax 0.11
    return frozenset(axis_type.varying) if axis_type is not None else frozenset(getattr(t, "vma", ()))


def _vary_like(g: jax.Array, primal: jax.Array) -> jax.Array:
    """g with its primal's manual axes. Inside shard_map a custom_vjp's cotangent must have its primal's type,
    axes included: an ffi_call's outputs vary over none (mark them varying), and the gradient of a replicated
    weight computed from varying tokens is a sum over the ranks (psum; a no-op at EP 1)."""
    want = _manual_axes(primal)
    if extra := tuple(sorted(_manual_axes(g) - want)):
        g = jax.lax.psum(g, extra)
    return _to_varying(g, tuple(want))


def _to_varying(a: jax.Array, axes: tuple) -> jax.Array:
    """a marked varying over ``axes`` (inside shard_map), where it is not already."""
    if missing := tuple(sorted(set(axes) - _manual_axes(a))):
        a = jax.lax.pcast(a, missing, to="varying")
    return a


NATIVE_LAYOUT_ENV = "MOK_JAX_NATIVE_LAYOUT"


def native_layout_on() -> bool:
    """Whether op_layout may use the native op: on unless MOK_JAX_NATIVE_LAYOUT=0 (read at trace time), the switch
    for an A/B against XLA's layout. On one H100 it gives the layer's gradients bit for bit and takes fwd+bwd from
    4.24 / 4.16 ms to 4.05 / 4.09 on qwen3-30b-a3b (docs/performance_history.md, the native layout)."""
    return os.environ.get(NATIVE_LAYOUT_ENV, "1") != "0"


def op_layout(topk_idx: jax.Array, num_local: int, rank) -> PaddedLayout:
    """rank_layout(topk_idx, num_local, rank), the same four arrays bit for bit, from the native op on CUDA
    (mok_jax.ops.expert_layout: three small kernels in place of XLA's sort, searches and scatter, ~0.05 ms of launches
    a fwd+bwd). ``jax.lax.platform_dependent`` lowers the op for CUDA and rank_layout for every other platform; where
    the op is switched off (native_layout_on), the native library is not loaded, or the op cannot take the call
    (ids not int32, more than MAX_LAYOUT_EXPERTS local experts), this is rank_layout itself. ``rank`` may be traced
    (jax.lax.axis_index).

    Inside shard_map the two branches must have one type, manual axes included, and rank_layout's is the one: the
    op's operands are marked varying over the axes of topk_idx and rank together (an ffi_call takes operands that
    vary alike), and each of its results, which vary over none, over the axes of rank_layout's array."""
    if not native_layout_on() or not _native.loaded() or topk_idx.dtype != jnp.int32 or \
            num_local > MAX_LAYOUT_EXPERTS:
        return rank_layout(topk_idx, num_local, rank)
    rank = jnp.asarray(rank, jnp.int32)
    operand_axes = tuple(sorted(_manual_axes(topk_idx) | _manual_axes(rank)))
    want = jax.eval_shape(lambda i, r: rank_layout(i, num_local, r), topk_idx, rank)
    result_axes = [tuple(sorted(_manual_axes(a))) for a in want]  # operand_axes, or none for constants (no slots)

    def native(idx, r):
        idx, first = _to_varying(idx, operand_axes), _to_varying(r * num_local, operand_axes)
        layout = expert_layout_call(idx, num_local, EXPERTS_BACKWARD_GROUP_ALIGN, first)
        return PaddedLayout(*(_to_varying(a, axes) for a, axes in zip(layout, result_axes)))

    def reference(idx, r):
        return rank_layout(idx, num_local, r)

    return jax.lax.platform_dependent(topk_idx, rank, cuda=native, default=reference)


class RoutedBackwardPart(NamedTuple):
    """One EP rank's share of the routed experts' backward over every rank's tokens (``routed_backward_rank``):
    dx_slots: bf16[N, k, H], the dx row of each slot its local experts own (zeros for the others' slots); dw:
    f32[N, k], likewise; d_gate_up, d_down: the local experts' weight gradients; status: the op's."""

    dx_slots: jax.Array
    dw: jax.Array
    d_gate_up: jax.Array
    d_down: jax.Array
    status: jax.Array


def routed_backward_rank(x, dy, topk_idx, topk_weight, gate_up, down, rank, experts_fn,
                          kept: KeptGateUp | None = None) -> RoutedBackwardPart:
    """EP rank ``rank``'s routed backward: x, dy: [N, H], topk_idx (global ids): [N, k], topk_weight: f32[N, k]
    of every rank's tokens (N = ep * T, rank-major: the global token order); gate_up, down: its L local experts
    [rank * L, (rank + 1) * L). Its layout (``op_layout``, or the kept one with its g, u) keeps its experts'
    slots in global (t, j) order, as the EP-1 layout does, so each slot's dx row and dw and each expert's weight
    gradient are the bits of EP size 1."""
    layout = op_layout(topk_idx, gate_up.shape[0], rank) if kept is None else kept.layout
    gu = {} if kept is None else kept.op_args()
    out = experts_fn(x, dy, topk_weight, layout.pos, layout.src_slot, layout.group_sizes, gate_up, down, **gu)
    # pos is M (one past the rows) for the other ranks' slots: they pick the appended zero row
    rows = jnp.concatenate([out.dx_rows, jnp.zeros((1, x.shape[1]), out.dx_rows.dtype)])
    return RoutedBackwardPart(rows[layout.pos], out.dw, out.d_gate_up, out.d_down, out.status)


def _routed_backward_fused(ws, config: MoEConfig, x, dy, topk_idx, w32, weights: MoEWeights,
                           kept: KeptGateUp | None = None):
    """This EP rank's routed backward inside shard_map as one fused kernel (mok_jax.ops.experts_backward_ep): the
    routing (ids and weights, P T k each) is all-gathered over the axis in XLA, each rank lays out its own experts'
    slots over every rank's tokens as ``routed_backward_rank`` does (or takes the forward's kept layout), and the
    token rows and the slots' dx rows cross NVLink inside the kernel. Returns its ExpertsBackwardEpOutput (R = 1)."""
    from mok_jax import ops

    axis = config.ep_axis
    gather = lambda a: jax.lax.all_gather(a, axis, tiled=True)  # noqa: E731
    layout = kept.layout if kept is not None else \
        op_layout(gather(topk_idx), weights.num_local_experts, jax.lax.axis_index(axis))
    gu = {} if kept is None else {name: a[None] for name, a in kept.op_args().items()}
    kernel = resolve_kernel(ws, config.kernel, tokens=x.shape[0], hidden=x.shape[1], inter=weights.intermediate_size,
                            top_k=topk_idx.shape[1], local_experts=weights.num_local_experts)
    return ops.experts_backward_ep(ws, x[None], dy[None], topk_idx[None], gather(w32)[None], layout.src_slot[None],
                                   layout.group_sizes[None], weights.gate_up[None], weights.down[None],
                                   comm_items=kernel.comm_items_bwd, **gu)


def slot_sum(dx_slots: jax.Array) -> jax.Array:
    """f32[N, H]: each token's slot rows [N, k, H] summed in f32 in slot order j = 0..k-1, as the op's slot sum."""
    dx = jnp.zeros(dx_slots.shape[::2], jnp.float32)
    for j in range(dx_slots.shape[1]):
        dx = dx + dx_slots[:, j].astype(jnp.float32)
    return dx


def drop_invalid_tokens(dy, topk_idx, num_experts, dtype):
    """dy in the compute dtype, zero for a token with an invalid id (its output row is NaN and its gradient
    dropped, as the xla path's jnp.where does)."""
    bad_token = jnp.any(_invalid_ids(topk_idx, num_experts), axis=1)
    return jnp.where(bad_token[:, None], jnp.zeros((), dy.dtype), dy).astype(dtype)


def finish_backward(x, dy, topk_weight, weights: MoEWeights, dx_routed, dw, failed, d_gate_up, d_down,
                     shared=None, shared_gu=None):
    """The gradients from the routed experts' parts: the shared expert's backward added (its dx in f32 before
    the one rounding), NaN where the op failed, every gradient in its primal's dtype. ``shared``: the shared
    expert's weight gradients when the op ran its backward (its dx is then in dx_routed already), else None
    (it runs here, in XLA, from ``shared_gu``, KeptGateUp.shared_gu, when the forward kept it)."""
    if shared is None:
        dx_shared, d_sgu, d_sdn = _shared_backward(x, weights, dy, shared_gu)
    else:
        dx_shared = None
        d_sgu, d_sdn = (g.astype(w.dtype) for g, w in zip(shared, (weights.shared_gate_up, weights.shared_down)))
    dx = dx_routed if dx_shared is None else dx_routed + dx_shared
    # failed (status != 0) means group sizes the layout never makes (a bug): NaN gradients rather than silently
    # wrong ones (the op's weight gradients are NaN then already; a jnp.where over them would cost a pass)
    dx = jnp.where(failed, jnp.nan, dx).astype(x.dtype)
    d_topk_weight = jnp.where(failed, jnp.nan, dw).astype(topk_weight.dtype)
    d_weights = MoEWeights(d_gate_up.astype(weights.gate_up.dtype), d_down.astype(weights.down.dtype), d_sgu, d_sdn)
    return dx, d_topk_weight, d_weights


# Whether at EP 1 the experts' backward op also runs the shared expert's backward (mok_jax.ops.experts_backward
# with its weights: its tiles in the same kernel) rather than XLA (as at EP > 1). Off: measured on the H200 at
# the bench shapes, the op with the shared expert's tiles took about 0.1-0.2 ms more than the routed op and XLA's
# five shared matmuls (docs/performance_history.md). Read at trace time; not a user setting: the two
# give different bits. mok_jax.bench.backward times both in one process.
_SHARED_IN_OP = False

# Whether at EP > 1 the layer's backward runs the fused expert-parallel op (mok_jax.ops.experts_backward_ep: one
# kernel per rank, the rows crossing NVLink inside it; memory T k H per rank) rather than the op between XLA
# collectives (an all-gather of x and dy, a reduce-scatter of P T k H slot rows). Both give the bits of EP 1. On:
# the fused kernel passed its tests on an H200 with every rank emulated on one GPU (emulated EP 2/4/8 the bits of
# EP 1, with the shared expert and kept g, u; a rank that skips a call times out with its status), ninth session
# (git show 6bd8602:benchmarks/results/moe_backward_h200.md); it has not yet run over real NVLink (issue 13). Read at
# trace time.
FUSED_EP_BACKWARD = True


def _backward_mok(config: MoEConfig, residuals: MoEResiduals, dy: jax.Array, experts_fn=None, workspace=None):
    """The gradients of implementation='mok': (dx, d topk_idx (float0), d topk_weight, d weights).

    The routed experts' backward runs on a padded expert-major layout of the slots (mok_jax.expert_layout) in
    ``experts_fn`` (mok_jax.ops.experts_backward when None; tests pass its reference). ``workspace``: moe's (the
    fused op's at EP > 1).

    EP size 1: the op gathers the rows and sums each token's slot rows of dx in f32 in slot order j = 0..k-1.
    The shared expert's backward runs in XLA (``_shared_backward``), or with ``_SHARED_IN_OP`` in the op; either
    way its dx is added in f32 before the one rounding.
    EP size P > 1, over XLA collectives on the mesh axis (unless FUSED_EP_BACKWARD: then the fused op,
    ``_routed_backward_fused``, moves the rows itself and gives the same bits): every rank all-gathers the
    tokens' x, dy, ids and weights (P * T rows), runs the op
    on the slots of its own experts (``routed_backward_rank``), and a reduce-scatter brings each token's
    per-slot dx rows [T, k, H] (bf16) and router-weight gradients home; every slot has exactly one owner, so the
    sums over ranks only add zeros (exact), and the slot-order f32 sum follows there. The routed gradients are
    then the bits of EP size 1. The shared expert's backward runs per rank on its tokens in XLA
    (``_shared_backward``), its dx added in f32 before the one rounding, its weight gradients summed over the
    ranks (psum). Memory: the gathered rows (2 P T H bf16) and the slot rows (P T k H bf16) per rank.
    """
    # EP > 1 with the kernels: the fused op (its communication inside) once FUSED_EP_BACKWARD is on, else (and
    # with an injected experts_fn: the tests' reference) the same math over XLA collectives
    ep = _ep_size(config)
    fused_ep = ep > 1 and experts_fn is None and FUSED_EP_BACKWARD
    if experts_fn is None:
        from mok_jax import ops

        experts_fn = ops.experts_backward
    x, topk_idx, topk_weight, weights, kept, _ = residuals
    dy = drop_invalid_tokens(dy, topk_idx, weights.num_local_experts * ep, x.dtype)
    w32 = topk_weight.astype(jnp.float32)
    if ep == 1:
        # Masked slots and invalid ids get no row (pos = M): the op gives them dw = 0 and adds nothing to dx.
        layout = op_layout(topk_idx, weights.num_local_experts, 0) if kept is None else kept.layout
        extra = {} if kept is None else kept.op_args()
        fused_shared = weights.has_shared and _SHARED_IN_OP
        if fused_shared:
            extra.update(shared_gate_up=weights.shared_gate_up.astype(x.dtype),
                         shared_down=weights.shared_down.astype(x.dtype))
        out = experts_fn(x, dy, w32, layout.pos, layout.src_slot, layout.group_sizes, weights.gate_up, weights.down,
                         **extra)
        dx_routed, dw, failed = out.dx, out.dw, out.status != 0
        d_gate_up, d_down = out.d_gate_up, out.d_down
        shared = (out.d_shared_gate_up, out.d_shared_down) if fused_shared else None
    elif fused_ep:
        axis = config.ep_axis
        out = _routed_backward_fused(_workspace(config, workspace, x, topk_idx, weights), config, x, dy, topk_idx,
                                     w32, weights, kept)
        out = jax.tree.map(lambda a: _to_varying(a[0], (axis,)), out)
        dx_routed, dw = out.dx, out.dw
        failed = jax.lax.psum((out.status != 0).astype(jnp.int32), axis) > 0
        d_gate_up, d_down = out.d_gate_up, out.d_down
        shared = None
    else:
        axis = config.ep_axis
        gather = lambda a: jax.lax.all_gather(a, axis, tiled=True)  # noqa: E731
        part = routed_backward_rank(gather(x), gather(dy), gather(topk_idx), gather(w32), weights.gate_up,
                                     weights.down, jax.lax.axis_index(axis), experts_fn, kept)
        # the op's outputs differ per rank: mark them varying before the collectives sum them
        part = jax.tree.map(lambda a: _to_varying(a, (axis,)), part)
        home = lambda a: jax.lax.psum_scatter(a, axis, scatter_dimension=0, tiled=True)  # noqa: E731
        dx_routed, dw = slot_sum(home(part.dx_slots)), home(part.dw)
        failed = jax.lax.psum((part.status != 0).astype(jnp.int32), axis) > 0
        d_gate_up, d_down = part.d_gate_up, part.d_down
        shared = None
    dx, d_topk_weight, d_weights = finish_backward(x, dy, topk_weight, weights, dx_routed, dw, failed, d_gate_up,
                                                    d_down, shared, None if kept is None else kept.shared_gu)
    d_weights = jax.tree.map(_vary_like, d_weights, weights)
    d_idx = np.zeros(topk_idx.shape, jax.dtypes.float0)
    return _vary_like(dx, x), d_idx, _vary_like(d_topk_weight, topk_weight), d_weights


def _moe_bwd(config, workspace, residuals, dy):
    # the E4M3 weights are a function of the bf16 ones that the backward does not differentiate (precision docs)
    d_fp8 = jax.tree.map(jnp.zeros_like, residuals.fp8_weights)
    if config.implementation == "mok":
        return *_backward_mok(config, residuals, dy, workspace=workspace), d_fp8
    _, vjp = jax.vjp(
        lambda x, w, W: _forward_xla(x, residuals.topk_idx, w, W, config),
        residuals.x, residuals.topk_weight, residuals.weights,
    )
    dx, dw, dW = vjp(dy)
    d_idx = np.zeros(residuals.topk_idx.shape, jax.dtypes.float0)
    return dx, d_idx, dw, dW, d_fp8


_moe.defvjp(_moe_fwd, _moe_bwd)


def moe(
    x: jax.Array,
    topk_idx: jax.Array,
    topk_weight: jax.Array,
    weights: MoEWeights,
    *,
    config: MoEConfig = MoEConfig(),
    workspace: Workspace | None = None,
    fp8_weights: Fp8ExpertWeights | None = None,
) -> jax.Array:
    """The MoE layer on one rank's tokens.

    x: bf16|f32[T, H]; topk_idx: int32[T, k] (global expert ids; -1 = masked slot); topk_weight: f32[T, k]
    (bf16 accepted); weights: MoEWeights in x's dtype, or f32 with bf16 x (routed weights are this rank's
    local experts when ``config.ep_axis`` is set; without it every expert, and the arguments may be sharded: on a
    mesh of Explicit axes y has x's sharding, ``_every_expert_here``). Returns [T, H] in x.dtype; NaN rows for
    tokens with an invalid expert id (module docstring). Differentiable w.r.t. x, topk_weight and every weight, at
    every EP size.

    workspace (``config.implementation="mok"``; ignored by "xla"): the megakernel's symmetric workspace, a runtime
    resource set up outside jit and passed beside the static config. Needed inside a caller's own shard_map with
    ``config.ep_axis`` set: ``mok_jax.workspace.moe_workspace(mesh, ep_axis, ...)`` (``expert_parallel_moe`` and
    the Flax modules set theirs up themselves); None without an EP axis uses a local one
    (``mok_jax.workspace.local_workspace``, cached per shape). It is a static argument of the op: a jitted caller
    that closes over one traces again for another.

    fp8_weights (only with ``config.precision="fp8"``): the E4M3 form of the routed weights that the forward
    reads, ``mok_jax.fp8.quantize_expert_weights(weights.gate_up, weights.down)`` (of this rank's experts), made
    once per optimizer step by the caller; None quantises them in every call. No gradient flows into them: the
    backward differentiates the bf16 layer (MoEConfig.precision).
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a mok_jax.MoEConfig, got {type(config).__name__}")
    check_workspace(workspace)
    x, topk_weight = jnp.asarray(x), jnp.asarray(topk_weight)
    topk_idx = jnp.asarray(topk_idx)
    ep = _ep_size(config)
    check_moe_args(x, topk_idx, topk_weight, weights, num_ep_ranks=ep)
    num_experts = weights.num_local_experts * ep
    check_routing_values(topk_idx, num_experts)
    if fp8_weights is not None:
        if config.precision != "fp8":
            raise ValueError("fp8_weights is given but MoEConfig.precision is 'bf16': set precision='fp8' (or drop "
                             "fp8_weights)")
        check_fp8_weights(fp8_weights, weights)
    if config.precision == "fp8":
        hidden, inter = weights.hidden_size, weights.intermediate_size
        if hidden % FP8_BLOCK or inter % FP8_BLOCK:
            raise ValueError(f"MoEConfig.precision='fp8' needs H and I multiples of {FP8_BLOCK} (the FP8 scale block), "
                             f"got H={hidden}, I={inter}")
    if config.implementation == "mok":
        require_native("implementation='mok'")
        if x.dtype != jnp.bfloat16:
            raise TypeError(f"implementation='mok' runs in bfloat16: x is {x.dtype} (cast x, or use "
                            f"implementation='xla')")
    if config.checkify_ids and isinstance(topk_idx, jax.core.Tracer):  # concrete ids were checked above
        report_invalid_ids(topk_idx, num_experts)
    # A masked slot's weight is ignored, even a NaN or inf (as a top-k over -inf logits gives): 0 from here on, so
    # that neither implementation's forward, residuals or backward reads it; its gradient is 0.
    topk_weight = jnp.where(topk_idx == -1, jnp.zeros((), topk_weight.dtype), topk_weight)
    if config.ep_axis is None:
        weights = _every_expert_here(weights, x)
    # Casts outside the custom_vjp, so that autodiff hands f32 master weights f32 gradients and a bf16
    # topk_weight a bf16 one; no-ops when the dtypes already match.
    weights = jax.tree.map(lambda w: w.astype(x.dtype), weights)
    return _moe(x, topk_idx, topk_weight.astype(jnp.float32), weights, fp8_weights, config, workspace)
