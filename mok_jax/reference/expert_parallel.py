"""Expert-parallel reference: the MoE layer inside ``shard_map`` over an ``ep`` mesh axis.

Runs per rank on its local tokens and its local experts (rank r owns global experts
[r*E_local, (r+1)*E_local)). Dropless by construction:

1. dispatch: an ``all_to_all`` sends every token to every rank that owns at least one of its
   experts, once per rank (slot [dest, t] holds x_t or zeros) together with its routing;
2. each rank runs its local experts densely on what it received and sums, per received token, its
   local slots' weighted outputs in slot order (fp32);
3. combine: an ``all_to_all`` returns one partial per (token, owner rank), rounded to the input
   dtype (what crosses the network is bf16 in the bf16 path); the origin adds the partials in rank
   order in fp32, then the shared expert, and rounds once more.

This is the reduction order the megakernel uses (issue 6: one row per (token, owner rank)), so the
kernel's data movement can be checked bitwise against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mok_jax.reference.experts import routed_sum, shared_expert, swiglu_ffn
from mok_jax.weights import MoEWeights

__all__ = ["ep_moe"]


def ep_moe(
    x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, weights: MoEWeights, *, axis_name: str
) -> jax.Array:
    """Per-rank body: x: [T, H], topk_idx: int32[T, k] (global ids), topk_weight: f32[T, k],
    weights: local slice (gate_up [E_local, H, 2I]). Returns [T, H] in x.dtype."""
    ep = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    num_local = weights.num_local_experts

    owner = topk_idx // num_local  # [T, k]
    needs = jnp.any(owner[None, :, :] == jnp.arange(ep)[:, None, None], axis=-1)  # [ep, T]
    send_x = jnp.where(needs[..., None], x[None], jnp.zeros_like(x)[None])  # [ep, T, H]
    send_idx = jnp.broadcast_to(topk_idx, (ep, *topk_idx.shape))
    send_w = jnp.broadcast_to(topk_weight, (ep, *topk_weight.shape))

    recv_x = jax.lax.all_to_all(send_x, axis_name, 0, 0, tiled=False)  # [ep(src), T, H]
    recv_idx = jax.lax.all_to_all(send_idx, axis_name, 0, 0, tiled=False)
    recv_w = jax.lax.all_to_all(send_w, axis_name, 0, 0, tiled=False)

    rows = recv_x.reshape(-1, x.shape[-1])  # [ep*T, H]
    out = jax.vmap(swiglu_ffn, in_axes=(None, 0, 0))(rows, weights.gate_up, weights.down)  # [E_local, ep*T, H]
    partial = routed_sum(out, recv_idx.reshape(-1, topk_idx.shape[1]), recv_w.reshape(-1, topk_idx.shape[1]),
                         expert_offset=rank * num_local)
    partial = partial.astype(x.dtype).reshape(ep, *x.shape)
    back = jax.lax.all_to_all(partial, axis_name, 0, 0, tiled=False)  # [ep(owner), T, H]

    y = jnp.zeros(x.shape, jnp.float32)
    for r in range(ep):
        y = y + back[r].astype(jnp.float32)
    y = y + shared_expert(x, weights)
    return y.astype(x.dtype)
