"""The routed experts' backward over padded expert-major rows: what mok_jax.ops.experts_backward computes.

Written for obviousness: every expert runs on every row (masked to its own rows), in fp32 from the inputs, with
the kernel's roundings to the input dtype (bf16 as the kernel; with f32 inputs nothing is rounded, which makes it
comparable with autodiff of mok_jax.reference.experts.swiglu_ffn to fp32 precision). Per row r of expert e:

    g, u = split(round(x_r @ gate_up[e]));  h = silu(g) * u                    (h kept in fp32)
    dh' = dy_r @ down[e]^T;  dw_r = <dh', h>;  dh = w_r dh'
    dgu_r = round([dh u silu'(g), dh silu(g)]),  silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g)))
    dx_r = round(dgu_r @ gate_up[e]^T)
    d_down[e] = round(sum_r round(w_r h_r)^T dy_r);  d_gate_up[e] = round(sum_r x_r^T dgu_r)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mok_jax.ops.moe_backward import (
    EXPERTS_BACKWARD_GROUP_ALIGN,
    EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP,
    EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW,
    EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP,
    ExpertsBackwardOutput,
)
from mok_jax.validation import check_experts_backward_args

__all__ = ["experts_backward_reference"]

_F32 = jnp.float32


def _status(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    bits = jnp.where(jnp.any(group_sizes < 0), EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP, 0)
    bits |= jnp.where(jnp.sum(group_sizes) > num_rows, EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW, 0)
    bits |= jnp.where(jnp.any(group_sizes % EXPERTS_BACKWARD_GROUP_ALIGN != 0), EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP,
                      0)
    return bits.astype(jnp.int32)


def experts_backward_reference(
    x_e: jax.Array, dy_e: jax.Array, w_e: jax.Array, group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array,
    *, num_sms: int | None = None,
) -> ExpertsBackwardOutput:
    """mok_jax.ops.experts_backward in pure JAX (same signature, shapes and semantics; the module docstring has
    the math). x_e, dy_e, gate_up and down: bf16 or f32, one dtype (the dtype of every rounding and of dx,
    d_gate_up and d_down); w_e: f32[M]; group_sizes: int32[E]. num_sms is accepted and ignored.

    With bad group sizes (status != 0) the kernel's outputs are not specified; here they are zeros.
    """
    del num_sms
    m, hidden, inter, num_experts = check_experts_backward_args(
        x_e, dy_e, w_e, group_sizes, gate_up, down, where="mok_jax.reference.experts_backward_reference",
        dtypes=(jnp.bfloat16, jnp.float32))
    dtype = x_e.dtype
    status = _status(group_sizes, m)
    ends = jnp.cumsum(group_sizes)
    expert_of_row = jnp.searchsorted(ends, jnp.arange(m), side="right")  # == E past sum(group_sizes)
    x32, dy32, w32 = x_e.astype(_F32), dy_e.astype(_F32), w_e.astype(_F32)

    dx = jnp.zeros((m, hidden), _F32)
    dw = jnp.zeros((m,), _F32)
    d_gate_up, d_down = [], []
    with jax.default_matmul_precision("highest"):
        for e in range(num_experts):
            mine = (expert_of_row == e) & (status == 0)
            gu = (x32 @ gate_up[e].astype(_F32)).astype(dtype).astype(_F32)
            g, u = gu[:, :inter], gu[:, inter:]
            sig = jax.nn.sigmoid(g)
            silu = g * sig
            h = silu * u
            dh_raw = dy32 @ down[e].astype(_F32).T
            dw_e = jnp.sum(dh_raw * h, axis=1)
            dh = w32[:, None] * dh_raw
            dg = dh * u * sig * (1.0 + g * (1.0 - sig))
            du = dh * silu
            dgu = jnp.concatenate([dg, du], axis=1).astype(dtype).astype(_F32)
            dgu = jnp.where(mine[:, None], dgu, 0.0)
            hw = jnp.where(mine[:, None], (w32[:, None] * h).astype(dtype).astype(_F32), 0.0)
            x_mine = jnp.where(mine[:, None], x32, 0.0)
            dy_mine = jnp.where(mine[:, None], dy32, 0.0)
            dx = jnp.where(mine[:, None], dgu @ gate_up[e].astype(_F32).T, dx)
            dw = jnp.where(mine, dw_e, dw)
            d_down.append(hw.T @ dy_mine)
            d_gate_up.append(x_mine.T @ dgu)
    return ExpertsBackwardOutput(
        dx.astype(dtype), dw, jnp.stack(d_gate_up).astype(dtype), jnp.stack(d_down).astype(dtype), status)
