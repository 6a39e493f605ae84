"""Expert FFNs and the single-device MoE, as dense masked einsums.

Precision follows docs/design.md ("Precision"): matmuls take the input dtype and accumulate in fp32; the SwiGLU
activation h is rounded to the input dtype (the kernel stores it so); the weighted sum over the
top-k slots runs in fp32 in slot order j = 0..k-1, then the shared expert is added, then the
result is rounded to the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mok_jax.weights import MoEWeights

__all__ = ["grouped_ffn", "moe", "shared_expert", "swiglu_backward", "swiglu_ffn"]

_F32 = jnp.float32


def swiglu_ffn(x: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """One SwiGLU expert: x: [..., H], gate_up: [H, 2I], down: [I, H] -> f32[..., H]."""
    gu = jnp.einsum("...h,hn->...n", x, gate_up, preferred_element_type=_F32)
    gate, up = jnp.split(gu, 2, axis=-1)
    h = (jax.nn.silu(gate) * up).astype(x.dtype)
    return jnp.einsum("...i,ih->...h", h, down, preferred_element_type=_F32)


def swiglu_backward(g: jax.Array, u: jax.Array, dh: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The SwiGLU activation h = silu(g) * u and its input gradients for the output gradient dh, elementwise in
    the inputs' dtype: (h, dg, du) with dg = dh * u * silu'(g), silu'(g) = s (1 + g (1 - s)), s = sigmoid(g), and
    du = dh * silu(g). The backward of the routed experts' reference and of the shared expert both use it."""
    sig = jax.nn.sigmoid(g)
    silu = g * sig
    return silu * u, dh * u * sig * (1.0 + g * (1.0 - sig)), dh * silu


def shared_expert(x: jax.Array, weights: MoEWeights) -> jax.Array:
    """The shared expert's f32 output, or zeros when the layer has none."""
    if weights.shared_gate_up is None:
        return jnp.zeros(x.shape, _F32)
    return swiglu_ffn(x, weights.shared_gate_up, weights.shared_down)


def routed_sum(expert_out: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, expert_offset=0) -> jax.Array:
    """sum_j topk_weight[t, j] * expert_out[topk_idx[t, j] - expert_offset, t], in slot order, in f32.
    expert_out: f32[E_local, T, H]. A slot whose expert is not in [offset, offset + E_local) (a masked slot, -1;
    another rank's expert; an invalid id) adds nothing. Each slot's row is selected among the experts (the one whose
    id matches; exact zeros from the others), not gathered by a clipped id: a slot without an expert here reads no
    expert's row, so a NaN or inf weight there reaches neither the sum nor any gradient, and no index needs a
    sharding on a mesh of Explicit axes.
    """
    num_local = expert_out.shape[0]
    acc = jnp.zeros(expert_out.shape[1:], _F32)
    for j in range(topk_idx.shape[1]):
        local = topk_idx[:, j] - expert_offset
        mine = (local >= 0) & (local < num_local)
        chosen = local[None, :] == jnp.arange(num_local)[:, None]  # [E_local, T]: the slot's expert, or none
        row = jnp.sum(jnp.where(chosen[..., None], expert_out, 0.0), axis=0)
        # fl(w row), then the f32 add, as documented (the barrier keeps XLA from contracting the two into an fma)
        prod = jax.lax.optimization_barrier(topk_weight[:, j, None].astype(_F32) * row)
        acc = acc + jnp.where(mine[:, None], prod, 0.0)
    return acc


def moe(x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, weights: MoEWeights) -> jax.Array:
    """y_t = sum_j topk_weight[t, j] * expert_{topk_idx[t, j]}(x_t) + shared(x_t), all experts local.

    x: [T, H] (bf16 or f32), topk_idx: int32[T, k], topk_weight: f32[T, k] -> [T, H] in x.dtype.
    Dense: every expert runs on every token (E times the work), which is what makes it obvious.
    """
    all_out = jax.vmap(swiglu_ffn, in_axes=(None, 0, 0))(x, weights.gate_up, weights.down)  # [E, T, H]
    y = routed_sum(all_out, topk_idx, topk_weight) + shared_expert(x, weights)
    return y.astype(x.dtype)


def grouped_ffn(x: jax.Array, group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """SwiGLU FFN over expert-major rows (the layout dispatch produces).

    x: [M, H]; group_sizes: int32[E] with rows [offset_e, offset_e + group_sizes[e]) belonging to
    expert e; rows past sum(group_sizes) are padding and come out as zeros. Returns [M, H] in x.dtype.
    """
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(x.shape[0])
    expert_of_row = jnp.searchsorted(ends, row, side="right")  # == E for padding rows
    y = jnp.zeros(x.shape, _F32)
    for e in range(gate_up.shape[0]):
        y = jnp.where((expert_of_row == e)[:, None], swiglu_ffn(x, gate_up[e], down[e]), y)
    return y.astype(x.dtype)
