"""FFI wrapper for mok_experts_backward (ffi/src/ffi_moe_backward.cu): the routed experts' backward at EP size 1.

Over expert-major rows (mok_jax.expert_layout: every group padded to a multiple of 128 rows) it recomputes the
SwiGLU forward from x and returns the gradients of x, of each slot's router weight and of the routed weights.
The kernel's scratch (gu, dgu, hw, the dw partials) are extra outputs that XLA allocates and this wrapper drops.
mok_jax.reference.experts_backward_reference has the same signature and semantics in pure JAX.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._native import require_native
from mok_jax.validation import check_experts_backward_args

__all__ = ["EXPERTS_BACKWARD_GROUP_ALIGN", "EXPERTS_BACKWARD_MAX_EXPERTS", "EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP",
           "EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW", "EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP",
           "ExpertsBackwardOutput", "experts_backward"]

EXPERTS_BACKWARD_GROUP_ALIGN = 128  # every group size is a multiple of this (the kernel's M tile)
EXPERTS_BACKWARD_MAX_EXPERTS = 1024  # as mok_grouped_ffn (GROUPED_FFN_MAX_EXPERTS)
EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP = 1  # status bit: some group size < 0
EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW = 2  # status bit: sum(group_sizes) > M
EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP = 4  # status bit: some group size is not a multiple of 128

_DW_PART_COLS = 256  # the kernel's dw partials: one column per 256 intermediate columns


class ExpertsBackwardOutput(NamedTuple):
    """dx: bf16[M, H]; dw: f32[M] (d loss / d w of each row's slot); d_gate_up: bf16[E, H, 2I];
    d_down: bf16[E, I, H]; status: int32[] (0, or a bit mask of EXPERTS_BACKWARD_STATUS_*)."""

    dx: jax.Array
    dw: jax.Array
    d_gate_up: jax.Array
    d_down: jax.Array
    status: jax.Array


def experts_backward(
    x_e: jax.Array, dy_e: jax.Array, w_e: jax.Array, group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array,
    *, num_sms: int | None = None,
) -> ExpertsBackwardOutput:
    """The routed SwiGLU experts' backward over expert-major rows, on the GPU.

    x_e: bf16[M, H] (each row a slot's token); dy_e: bf16[M, H] (that token's output gradient); w_e: f32[M] (the
    slot's router weight); group_sizes: int32[E] (device values; rows [start_e, start_e + group_sizes[e]) are expert
    e's, start = exclusive prefix sum; each a multiple of 128, EXPERTS_BACKWARD_GROUP_ALIGN; padding rows inside
    a group hold zeros in x_e and dy_e and w_e = 0); gate_up: bf16[E, H, 2I] (gate = first I columns, up = last I);
    down: bf16[E, I, H]. Per row r of expert e, fp32 accumulation throughout:

        g, u = split(bf16(x_r @ gate_up[e]));  h = silu(g) * u;  dh' = dy_r @ down[e]^T
        dw_r = <dh', h>;  dh = w_r dh';  dgu_r = bf16([dh u silu'(g), dh silu(g)]);  dx_r = bf16(dgu_r @ gate_up[e]^T)
        d_down[e] = bf16(sum_r bf16(w_r h_r)^T dy_r);  d_gate_up[e] = bf16(sum_r x_r^T dgu_r)  (zeros if empty)

    Rows past sum(group_sizes) give dx = 0 and dw = 0. status is 0, or a bit mask of EXPERTS_BACKWARD_STATUS_*
    when the group sizes are bad. dw is d loss / d w_r, not divided by anything: the router-weight gradient.

    num_sms: persistent CTAs (one per SM) to use; None uses every SM. The result does not depend on it.
    """
    m, hidden, inter, num_experts = check_experts_backward_args(
        x_e, dy_e, w_e, group_sizes, gate_up, down, where="mok_jax.ops.experts_backward",
        max_experts=EXPERTS_BACKWARD_MAX_EXPERTS)
    if m * max(hidden, 2 * inter) >= 2**31:
        raise ValueError(f"mok_jax.ops.experts_backward: x_e: rows M times H and times 2I must be below 2^31 (the "
                         f"kernel's 32-bit offsets), got M = {m}, H = {hidden}, I = {inter}")
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, (int, np.integer))
                                or num_sms < 1):
        raise ValueError(f"num_sms must be None (all SMs) or a positive int, got {num_sms!r}")
    require_native("mok_jax.ops.experts_backward")
    bf16, f32 = jnp.bfloat16, jnp.float32
    out = (
        jax.ShapeDtypeStruct((m, hidden), bf16),  # dx_e
        jax.ShapeDtypeStruct((m,), f32),  # dw_e
        jax.ShapeDtypeStruct((num_experts, hidden, 2 * inter), bf16),  # d_gate_up
        jax.ShapeDtypeStruct((num_experts, inter, hidden), bf16),  # d_down
        jax.ShapeDtypeStruct((), jnp.int32),  # status
        # scratch, dropped: gu, dgu, hw = bf16(w h), the dw partials
        jax.ShapeDtypeStruct((m, 2 * inter), bf16),
        jax.ShapeDtypeStruct((m, 2 * inter), bf16),
        jax.ShapeDtypeStruct((m, inter), bf16),
        jax.ShapeDtypeStruct((m, -(-inter // _DW_PART_COLS)), f32),
    )
    # vmap: "sequential", as mok_grouped_ffn (ops/grouped_ffn.py): the op is pure and the handler takes one
    # problem's rank-2 rows and rank-1 group sizes.
    dx, dw, d_gate_up, d_down, status, *_ = jax.ffi.ffi_call("mok_experts_backward", out, vmap_method="sequential")(
        x_e, dy_e, w_e, group_sizes, gate_up, down, num_sms=np.int32(0 if num_sms is None else num_sms))
    return ExpertsBackwardOutput(dx, dw, d_gate_up, d_down, status)
