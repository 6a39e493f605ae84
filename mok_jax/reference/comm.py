"""Reference of the expert-parallel communication ops (``mok_jax.ops.dispatch`` / ``combine``).

Pure JAX, per rank inside ``shard_map`` over the EP axis, written for obviousness; plus numpy
oracles over all ranks at once (explicit loops, float32 numpy arithmetic: every multiply and add
rounded separately) that the tests use as an independent second opinion.

Dispatch, on owner rank r (experts [r*L, (r+1)*L), L = E / ep): every slot (s, t, j) whose expert is
local gets a row holding x_t of source rank s; rows are expert-major, then source rank, then token,
then slot; rows past the total are zeros. ``row_table[s, t, j]`` is that row (or -1) and
``row_weight[s, t, j]`` the source's weight.

Dispatch, identity experts, combine (the reduction order of ``ep_moe`` in ``expert_parallel.py``):

    partial_o(t) = bf16( sum_{j: expert j of t local to o, ascending j} fl(w_j * x_t) )   in fp32
    y_t          = bf16( sum_{o = 0..ep-1} partial_o(t) )                                 in fp32

Products are kept as separately rounded fp32 values (an optimisation barrier stops XLA from
contracting them into FMAs), which is what the kernels compute with __fmul_rn/__fadd_rn.

The layer's megakernel combines per slot instead (its owners push each slot's row, not a partial), so its y does
not depend on the EP size; ``moe_identity_numpy`` is that data path's oracle with identity experts:

    y_t = bf16( sum_{j: expert j of t valid, ascending j} fl(w_j * x_t) )                 in fp32
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = [
    "moe_identity_numpy",
    "dispatch_combine_identity_numpy",
    "dispatch_layout_numpy",
    "ep_dispatch_combine_identity",
    "ep_dispatch_layout",
]

_F32 = jnp.float32


def _local_slots(topk_idx: jax.Array, rank, num_local: int, num_experts: int):
    """(local expert index, mask) of each slot for owner ``rank``; ids outside [0, E) are nobody's."""
    local = topk_idx - rank * num_local
    mine = (topk_idx >= 0) & (topk_idx < num_experts) & (local >= 0) & (local < num_local)
    return local, mine


def ep_dispatch_layout(x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, *, axis_name: str,
                       num_experts: int, capacity: int | None = None):
    """Per rank: x: bf16[T, H], topk_idx: int32[T, k], topk_weight: f32[T, k] ->
    (recv_x [C, H], group_sizes int32[L], row_table int32[ep, T, k], row_weight f32[ep, T, k],
    row_source int32[C]), what dispatch returns on this rank as expert owner (C defaults to
    ep*T*min(k, L); row_source[i] = s * T + t of row i, -1 past the total)."""
    ep = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    num_local = num_experts // ep
    tokens, k = topk_idx.shape
    cap = ep * tokens * min(k, num_local) if capacity is None else capacity
    all_x = jax.lax.all_gather(x, axis_name)  # [ep, T, H]
    all_idx = jax.lax.all_gather(topk_idx, axis_name)  # [ep, T, k]
    all_w = jax.lax.all_gather(topk_weight, axis_name)
    local, mine = _local_slots(all_idx, rank, num_local, num_experts)
    key = jnp.where(mine, local, num_local).reshape(-1)  # slots are in (s, t, j) order already
    order = jnp.argsort(key, stable=True)  # expert-major, ties keep (s, t, j) order
    pos = jnp.zeros_like(key).at[order].set(jnp.arange(key.size, dtype=key.dtype))
    row_table = jnp.where(mine.reshape(-1) & (pos < cap), pos, -1).reshape(ep, tokens, k).astype(jnp.int32)
    group_sizes = jnp.sum(mine[..., None] & (local[..., None] == jnp.arange(num_local)), axis=(0, 1, 2))
    src = jnp.broadcast_to(all_x[:, :, None, :], (ep, tokens, k, x.shape[-1])).reshape(-1, x.shape[-1])
    target = jnp.where(row_table >= 0, row_table, cap).reshape(-1)
    recv_x = jnp.zeros((cap, x.shape[-1]), x.dtype).at[target].set(src, mode="drop")
    token_row = (jnp.arange(ep)[:, None, None] * tokens + jnp.arange(tokens)[None, :, None]) * jnp.ones_like(all_idx)
    row_source = jnp.full((cap,), -1, jnp.int32).at[target].set(token_row.reshape(-1).astype(jnp.int32), mode="drop")
    return recv_x, group_sizes.astype(jnp.int32), row_table, all_w, row_source


def _owner_partial(rows: jax.Array, idx: jax.Array, w: jax.Array, rank, num_local: int, num_experts: int):
    """f32[..., H]: sum over local slots j (ascending) of fl(w_j * row), in fp32."""
    local, mine = _local_slots(idx, rank, num_local, num_experts)
    rows32 = rows.astype(_F32)
    acc = jnp.zeros(rows.shape, _F32)
    for j in range(idx.shape[-1]):
        prod = jax.lax.optimization_barrier(w[..., j, None].astype(_F32) * rows32)
        acc = acc + jnp.where(mine[..., j, None], prod, 0.0)
    return acc


def ep_dispatch_combine_identity(x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, *, axis_name: str,
                                 num_experts: int) -> jax.Array:
    """Per rank: dispatch -> identity experts -> combine. x: bf16[T, H] -> bf16[T, H].

    Same structure as ``ep_moe`` (an all_to_all of each token to every owner rank it needs, one
    partial per (token, owner) rounded to x.dtype, an all_to_all back, a rank-ordered fp32 sum)."""
    ep = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    num_local = num_experts // ep
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    owner = jnp.where(valid, topk_idx // num_local, -1)
    needs = jnp.any(owner[None, :, :] == jnp.arange(ep)[:, None, None], axis=-1)  # [ep, T]
    send_x = jnp.where(needs[..., None], x[None], jnp.zeros_like(x)[None])
    recv_x = jax.lax.all_to_all(send_x, axis_name, 0, 0, tiled=False)  # [ep(src), T, H]
    recv_idx = jax.lax.all_to_all(jnp.broadcast_to(topk_idx, (ep, *topk_idx.shape)), axis_name, 0, 0, tiled=False)
    recv_w = jax.lax.all_to_all(jnp.broadcast_to(topk_weight, (ep, *topk_weight.shape)), axis_name, 0, 0,
                                tiled=False)
    partial = _owner_partial(recv_x, recv_idx, recv_w, rank, num_local, num_experts).astype(x.dtype)
    back = jax.lax.all_to_all(partial, axis_name, 0, 0, tiled=False)  # [ep(owner), T, H]
    y = jnp.zeros(x.shape, _F32)
    for r in range(ep):
        y = y + back[r].astype(_F32)
    return y.astype(x.dtype)


# --- numpy oracles over all ranks ------------------------------------------------------------------


def dispatch_layout_numpy(xs: np.ndarray, idxs: np.ndarray, ws: np.ndarray, num_experts: int,
                          capacity: int | None = None) -> list[dict[str, np.ndarray]]:
    """xs: bf16[ep, T, H], idxs: int32[ep, T, k], ws: f32[ep, T, k] -> per owner rank, a dict with
    recv_x, group_sizes, row_table, row_weight, row_source, and the token-major recv_x of
    ``dispatch(token_major=True)`` as recv_tokens (explicit loops in the documented order)."""
    ep, tokens, k = idxs.shape
    num_local = num_experts // ep
    cap = ep * tokens * min(k, num_local) if capacity is None else capacity
    out = []
    for r in range(ep):
        recv = np.zeros((cap, xs.shape[-1]), xs.dtype)
        table = np.full((ep, tokens, k), -1, np.int32)
        sizes = np.zeros(num_local, np.int32)
        source = np.full(cap, -1, np.int32)
        tokens_x = np.zeros((ep * tokens, xs.shape[-1]), xs.dtype)
        row = 0
        for e in range(num_local):
            g = r * num_local + e
            for s in range(ep):
                for t in range(tokens):
                    for j in range(k):
                        if idxs[s, t, j] == g:
                            if row < cap:
                                recv[row] = xs[s, t]
                                table[s, t, j] = row
                                source[row] = s * tokens + t
                                tokens_x[s * tokens + t] = xs[s, t]
                            row += 1
                            sizes[e] += 1
        out.append(dict(recv_x=recv, group_sizes=sizes, row_table=table, row_weight=ws.astype(np.float32).copy(),
                        row_source=source, recv_tokens=tokens_x))
    return out


def moe_identity_numpy(x: np.ndarray, idx: np.ndarray, w: np.ndarray, num_experts: int) -> np.ndarray:
    """x: bf16[T, H] (every rank's tokens, in rank order), idx: [T, k], w: [T, k] -> y: bf16[T, H], the layer
    forward with identity experts and no shared expert (the megakernel's per-slot combine; the same at every EP
    size)."""
    x32 = np.asarray(x).astype(np.float32)
    idx, w = np.asarray(idx), np.asarray(w, np.float32)
    y = np.zeros(x32.shape, np.float32)
    for j in range(idx.shape[1]):  # ascending slots, one rounding per multiply and per add
        valid = ((idx[:, j] >= 0) & (idx[:, j] < num_experts))[:, None]
        y = np.where(valid, (y + (w[:, j, None] * x32).astype(np.float32)).astype(np.float32), y)
    return y.astype(ml_dtypes.bfloat16)


def dispatch_combine_identity_numpy(xs: np.ndarray, idxs: np.ndarray, ws: np.ndarray,
                                    num_experts: int) -> np.ndarray:
    """xs: bf16[ep, T, H] -> y: bf16[ep, T, H] (dispatch -> identity experts -> combine)."""
    ep, tokens, k = idxs.shape
    num_local = num_experts // ep
    ys = np.zeros(xs.shape, xs.dtype)
    for s in range(ep):
        for t in range(tokens):
            x32 = xs[s, t].astype(np.float32)
            y = np.zeros(xs.shape[-1], np.float32)
            for o in range(ep):
                acc = np.zeros(xs.shape[-1], np.float32)
                for j in range(k):
                    g = int(idxs[s, t, j])
                    if 0 <= g < num_experts and g // num_local == o:
                        acc = acc + np.float32(ws[s, t, j]) * x32
                y = y + acc.astype(ml_dtypes.bfloat16).astype(np.float32)
            ys[s, t] = y.astype(ml_dtypes.bfloat16)
    return ys
