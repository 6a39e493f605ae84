"""The routed experts' backward over padded expert-major rows: what mok_jax.ops.experts_backward computes.

Written for obviousness: the slots' tokens and weights are gathered into the layout's rows, every expert runs on
every row (masked to its own rows), in fp32 from the inputs, with the kernel's roundings to the input dtype (bf16
as the kernel; with f32 inputs nothing is rounded, which makes it comparable with autodiff of
mok_jax.reference.experts.swiglu_ffn to fp32 precision). Row r holds slot s = src_slot[r] (zeros for padding);
per row r of expert e:

    g, u = round(split(x_r @ gate_up[e]));  h = silu(g) * u      (fp32 accumulation; g, u stored rounded, h fp32)
    dh' = dy_r @ down[e]^T;  dw_r = <dh', h>;  dh = w_r dh'
    dgu_r = round([dh u silu'(g), dh silu(g)]),  silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g)))
    dx_r = round(dgu_r @ gate_up[e]^T)
    d_down[e] = round(sum_r round(w_r h_r)^T dy_r);  d_gate_up[e] = round(sum_r x_r^T dgu_r)

(round: to the inputs' dtype, as the kernel stores each value; the identity with f32 inputs.)

and per token t: dx[t] = sum_j dx_{pos[t, j]} in fp32 in slot order, dw[t, j] = dw_{pos[t, j]} (a slot whose pos
is outside [0, M) adds nothing and gets 0). Given the forward's kept g, u (``gu``, [M, 2I] in the inputs' dtype: the
same rounding of the same accumulators), row r of expert e takes its g, u from gu[r] instead of round(x_r @
gate_up[e]) (a row without a slot: zeros, whatever gu holds there); everything else is the same.

With the shared expert's weights (shared_gate_up [H, 2Is], shared_down [Is, H]) its backward runs over the tokens'
own rows, weight 1, with the same roundings, and its dx (f32, dgu_s @ shared_gate_up^T) is added to each token's
slot sum: dx[t] = sum_j dx_{pos[t, j]} + dx_s[t]; d_shared_down = round(round(h)^T dy), d_shared_gate_up =
round(x^T dgu_s).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mok_jax.backward_types import (
    EXPERTS_BACKWARD_GROUP_ALIGN,
    EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP,
    EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW,
    EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP,
    ExpertsBackwardEpOutput,
    ExpertsBackwardOutput,
)
from mok_jax.expert_layout import gather_rows, kept_blocks
from mok_jax.reference.experts import swiglu_backward
from mok_jax.validation import check_experts_backward_args

__all__ = ["experts_backward_ep_reference", "experts_backward_reference"]

_F32 = jnp.float32


def _status(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    bits = jnp.where(jnp.any(group_sizes < 0), EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP, 0)
    bits |= jnp.where(jnp.sum(group_sizes) > num_rows, EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW, 0)
    bits |= jnp.where(jnp.any(group_sizes % EXPERTS_BACKWARD_GROUP_ALIGN != 0), EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP,
                      0)
    return bits.astype(jnp.int32)


def experts_backward_reference(
    x: jax.Array, dy: jax.Array, topk_weight: jax.Array, pos: jax.Array, src_slot: jax.Array,
    group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array, *, num_sms: int | None = None,
    gu: jax.Array | None = None, shared_gate_up: jax.Array | None = None, shared_down: jax.Array | None = None,
    gu_part: jax.Array | None = None, gu_part_row: jax.Array | None = None,
) -> ExpertsBackwardOutput:
    """mok_jax.ops.experts_backward in pure JAX (same signature, shapes and semantics; the module docstring has
    the math). x, dy, gate_up and down: bf16 or f32, one dtype (the dtype of every rounding and of d_gate_up and
    d_down; dx and dw are f32); topk_weight: f32[T, k]; pos: int32[T, k]; src_slot: int32[M]; group_sizes:
    int32[E]. num_sms is accepted and ignored. gu: None, or [M, 2I] in x's dtype, the forward's kept g | u per row
    (as mok_jax.ops.experts_backward takes them in bf16): row r of expert e then uses gu[r] as its g, u;
    rows of no expert are not read. gu_part, gu_part_row: None, or some rows' kept g | u and each row's row of them
    (as the op takes them): rows of a block of 128 whose slot rows all have one use those (kept_blocks), the other
    blocks recompute. shared_gate_up, shared_down: the shared expert (both or neither), in x's dtype.

    With bad group sizes (status != 0) d_gate_up and d_down are NaN, as the kernel's; dx and dw are not specified
    (here zeros).
    """
    del num_sms
    tokens, k, m, hidden, inter, num_experts = check_experts_backward_args(
        x, dy, topk_weight, pos, src_slot, group_sizes, gate_up, down,
        where="mok_jax.reference.experts_backward_reference", dtypes=(jnp.bfloat16, jnp.float32), gu=gu,
        shared_gate_up=shared_gate_up, shared_down=shared_down, gu_part=gu_part, gu_part_row=gu_part_row)
    dtype = x.dtype
    rnd = lambda a: a.astype(dtype).astype(_F32)  # noqa: E731  (the kernel's stores; nothing with f32 inputs)
    shared = shared_gate_up is not None
    status = _status(group_sizes, m)

    # gather: a row whose slot is outside [0, T k) is padding (zeros)
    slot_ok = (src_slot >= 0) & (src_slot < tokens * k)
    slot = jnp.where(slot_ok, src_slot, -1)
    x32 = gather_rows(x, jnp.where(slot_ok, slot // k, -1)).astype(_F32)
    dy32 = gather_rows(dy, jnp.where(slot_ok, slot // k, -1)).astype(_F32)
    w32 = gather_rows(topk_weight.reshape(-1), slot).astype(_F32)
    if gu is not None:  # a row without a slot may hold anything: zeros, as the op's gather makes them
        gu = jnp.where(slot_ok[:, None], gu.astype(_F32), 0.0)
    from_part = None
    if gu_part is not None:  # rows of the kept blocks: their kept row (zeros without one), the others recomputed
        rows = gu_part.shape[0]
        block = kept_blocks(src_slot, gu_part_row, rows, tokens * k, EXPERTS_BACKWARD_GROUP_ALIGN)
        from_part = jnp.repeat(block, EXPERTS_BACKWARD_GROUP_ALIGN)[:m] == 1
        has = (gu_part_row >= 0) & (gu_part_row < rows)
        part = gather_rows(gu_part, jnp.where(has, gu_part_row, -1)).astype(_F32) if rows else \
            jnp.zeros((m, 2 * inter), _F32)

    ends = jnp.cumsum(group_sizes)
    expert_of_row = jnp.searchsorted(ends, jnp.arange(m), side="right")  # == E past sum(group_sizes)
    dx_rows = jnp.zeros((m, hidden), _F32)
    dw_rows = jnp.zeros((m,), _F32)
    d_gate_up, d_down = [], []
    with jax.default_matmul_precision("highest"):
        for e in range(num_experts):
            mine = (expert_of_row == e) & (status == 0)
            # fp32 accumulation, rounded as the op stores it (or as the forward kept it)
            gu_e = rnd(x32 @ gate_up[e].astype(_F32)) if gu is None else gu
            if from_part is not None:
                gu_e = jnp.where(from_part[:, None], part, gu_e)
            g, u = gu_e[:, :inter], gu_e[:, inter:]
            dh_raw = dy32 @ down[e].astype(_F32).T
            h, dg, du = swiglu_backward(g, u, w32[:, None] * dh_raw)
            dw_e = jnp.sum(dh_raw * h, axis=1)
            dgu = rnd(jnp.concatenate([dg, du], axis=1))
            dgu = jnp.where(mine[:, None], dgu, 0.0)
            hw = jnp.where(mine[:, None], rnd(w32[:, None] * h), 0.0)
            x_mine = jnp.where(mine[:, None], x32, 0.0)
            dy_mine = jnp.where(mine[:, None], dy32, 0.0)
            dx_rows = jnp.where(mine[:, None], dgu @ gate_up[e].astype(_F32).T, dx_rows)
            dw_rows = jnp.where(mine, dw_e, dw_rows)
            d_down.append(hw.T @ dy_mine)
            d_gate_up.append(x_mine.T @ dgu)
    dx_rows = dx_rows.astype(dtype).astype(_F32)  # each row rounded, then summed per token in f32

    # sum: slot j of token t adds row pos[t, j] when it is in [0, M)
    row_ok = (pos >= 0) & (pos < m)
    row = jnp.clip(pos, 0, m - 1)
    dx = jnp.zeros((tokens, hidden), _F32)
    for j in range(k):
        dx = dx + jnp.where(row_ok[:, j, None], dx_rows[row[:, j]], 0.0)
    dw = jnp.where(row_ok, dw_rows[row], 0.0)
    d_shared = {}
    if shared:
        dx_s, d_sgu, d_sdn = _shared_backward(x, dy, shared_gate_up, shared_down)
        dx = dx + dx_s
        d_shared = dict(d_shared_gate_up=d_sgu, d_shared_down=d_sdn)
    poison = lambda g: jnp.where(status == 0, g, jnp.nan).astype(dtype)  # noqa: E731
    return ExpertsBackwardOutput(dx, dw, poison(jnp.stack(d_gate_up)), poison(jnp.stack(d_down)), status,
                                 dx_rows=dx_rows.astype(dtype), **d_shared)


def _shared_backward(x, dy, shared_gate_up, shared_down):
    """The shared expert's part: (dx_s f32[T, H], d_shared_gate_up, d_shared_down), fp32 from the inputs with the
    routed experts' roundings (weight 1; g, u rounded as the op stores them)."""
    dtype, s_inter = x.dtype, shared_down.shape[0]
    rnd = lambda a: a.astype(dtype).astype(_F32)  # noqa: E731
    x32, dy32 = x.astype(_F32), dy.astype(_F32)
    wsgu, wsd = shared_gate_up.astype(_F32), shared_down.astype(_F32)
    with jax.default_matmul_precision("highest"):
        gu = rnd(x32 @ wsgu)
        h, dg, du = swiglu_backward(gu[:, :s_inter], gu[:, s_inter:], dy32 @ wsd.T)
        dgu = rnd(jnp.concatenate([dg, du], axis=1))
        return dgu @ wsgu.T, (x32.T @ dgu).astype(dtype), (rnd(h).T @ dy32).astype(dtype)


def _slot_rows(src_slot: jax.Array, slots: int) -> jax.Array:
    """int32[slots]: the row of each slot in a layout (the inverse of src_slot), M (one past the rows) for none."""
    m = src_slot.shape[0]
    valid = (src_slot >= 0) & (src_slot < slots)
    return jnp.full((slots,), m, jnp.int32).at[jnp.where(valid, src_slot, slots)].set(
        jnp.arange(m, dtype=jnp.int32), mode="drop")


def experts_backward_ep_reference(
    ws, x: jax.Array, dy: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, src_slot: jax.Array,
    group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array, *, axis_name: str | None = None,
    gu: jax.Array | None = None, gu_part: jax.Array | None = None, gu_part_row: jax.Array | None = None,
    num_experts: int | None = None, **_knobs,
):
    """mok_jax.ops.experts_backward_ep in pure JAX (same arguments and results; ``ws`` and the kernel's knobs are
    not read). Either every rank of the group at once (R = P, no ``axis_name``: the emulated form), or one rank
    inside shard_map over ``axis_name`` (R = 1), where its collectives stand in for the kernel's NVLink traffic.

    Each rank's slots run through experts_backward_reference over every rank's tokens (the all-gather), each slot's
    dx row and dw go to its token's rank (a reduce-scatter of rows that only one rank holds: exact), and there each
    token's k slot rows are summed in slot order in f32, a slot adding something only when its id is in
    [0, num_experts) (default: P L) -- the op's semantics.
    """

    R, T, H = x.shape
    k = topk_idx.shape[2]
    n = topk_weight.shape[1]
    P = n // T if T else R  # (no tokens: nothing has an owner, P is not needed)
    total = P * gate_up.shape[1] if num_experts is None else num_experts
    if axis_name is None and R != P:
        raise ValueError(f"experts_backward_ep_reference: without axis_name x must carry all {P} ranks, got {R}")
    if axis_name is not None and R != 1:
        raise ValueError(f"experts_backward_ep_reference: inside shard_map x carries its rank only, got {R}")
    if axis_name is None:
        xa, dya = x.reshape(n, H), dy.reshape(n, H)
    else:
        xa, dya = (jax.lax.all_gather(a[0], axis_name, tiled=True) for a in (x, dy))
    parts, out_w, d_gu, d_dn, status = [], [], [], [], []
    for r in range(R):
        kept = {} if gu is None else dict(gu=gu[r])
        if gu_part is not None:
            kept = dict(gu_part=gu_part[r], gu_part_row=gu_part_row[r])
        pos = _slot_rows(src_slot[r], n * k).reshape(n, k)
        out = experts_backward_reference(xa, dya, topk_weight[r], pos, src_slot[r], group_sizes[r], gate_up[r], down[r],
                                         **kept)
        rows = jnp.concatenate([out.dx_rows, jnp.zeros((1, H), out.dx_rows.dtype)])
        parts.append(rows[pos])  # [n, k, H]: this owner's slots' rows, zeros for the others'
        out_w.append(out.dw)
        d_gu.append(out.d_gate_up), d_dn.append(out.d_down), status.append(out.status)
    if axis_name is None:  # each slot has one owner: the sums over the ranks add zeros
        dx_slots = functools.reduce(jnp.add, parts).reshape(R, T, k, H)
        dw = functools.reduce(jnp.add, out_w).reshape(R, T, k)
    else:
        dx_slots = jax.lax.psum_scatter(parts[0], axis_name, scatter_dimension=0, tiled=True)[None]
        dw = jax.lax.psum_scatter(out_w[0], axis_name, scatter_dimension=0, tiled=True)[None]
    has_owner = (topk_idx >= 0) & (topk_idx < total)
    dx = jnp.zeros((R, T, H), _F32)
    for j in range(k):
        dx = dx + jnp.where(has_owner[:, :, j, None], dx_slots[:, :, j].astype(_F32), 0.0)
    dw = jnp.where(has_owner, dw, 0.0)
    return ExpertsBackwardEpOutput(dx, dw, jnp.stack(d_gu), jnp.stack(d_dn), jnp.stack(status))
