"""FFI wrapper for mok_fp8_grouped_ffn (ffi/src/ffi_fp8.cu): the Hopper FP8 (E4M3, block-scaled) grouped
expert FFN."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._native import require_native
from mok_jax.fp8 import BLOCK, Fp8ExpertWeights
from mok_jax.validation import check_fp8_expert_weights, check_num_sms

__all__ = ["Fp8GroupedFfnOutput", "fp8_grouped_ffn"]

_F8 = jnp.float8_e4m3fn
_MAX_EXPERTS = 1024  # kGroupedFfnMaxExperts in ffi/include/mok/grouped_ffn.cuh


class Fp8GroupedFfnOutput(NamedTuple):
    """y: bf16[M, H]; h: float8_e4m3fn[M, I] and h_scale: f32[I/128, M] (the quantised SwiGLU activation);
    x_q: float8_e4m3fn[M, H] and x_scale: f32[H/128, M] (the quantised input); status: int32[].

    The scales are k-block major: h_scale[b, r] scales h[r, 128 b : 128 b + 128] (the transpose of
    ``mok_jax.fp8.quantize_rows``' [M, I/128]), the layout the kernels read."""

    y: jax.Array
    h: jax.Array
    h_scale: jax.Array
    x_q: jax.Array
    x_scale: jax.Array
    status: jax.Array


def fp8_grouped_ffn(
    x: jax.Array, group_sizes: jax.Array, weights: Fp8ExpertWeights, *, num_sms: int | None = None
) -> Fp8GroupedFfnOutput:
    """SwiGLU expert FFN over expert-major rows in FP8 (E4M3 with DeepSeek-V3 block scales), on the GPU.

    x: bf16[M, H]; group_sizes: int32[E] (device values: rows [offset_e, offset_e + group_sizes[e]) are expert
    e's, offset = exclusive prefix sum); weights: ``mok_jax.fp8.quantize_expert_weights(gate_up, down)``
    (E4M3, K-major, one fp32 scale per 128 x 128 block; see ``Fp8ExpertWeights`` for the layouts).
    H and I must be multiples of 128.

    Computes, as ``mok_jax.fp8.grouped_ffn_reference`` does: x quantised in 1 x 128 tiles; gate | up =
    block-scaled FP8 GEMM (fp32, promoted per 128-long k block); h = silu(gate) * up in fp32, quantised in
    1 x 128 tiles in the GEMM's epilogue; y = bf16(block-scaled FP8 GEMM of h with down). Rows past
    sum(group_sizes) are padding: y = 0, h = 0 with scale 1. status is 0, or a bit mask of
    GROUPED_FFN_STATUS_* (mok_jax.ops.grouped_ffn) when the group sizes are bad; then y is all zeros.

    num_sms: persistent CTAs (one per SM); None uses every SM. The result does not depend on it, and two
    runs give the same bits.
    """
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"x must be rank 2 [M, H], got shape {getattr(x, 'shape', None)}")
    if getattr(group_sizes, "ndim", None) != 1:
        raise ValueError(f"group_sizes must be rank 1 [E], got shape {getattr(group_sizes, 'shape', None)}")
    if x.dtype != jnp.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    if group_sizes.dtype != jnp.int32:
        raise TypeError(f"group_sizes must be int32, got {group_sizes.dtype}")
    m, hidden = x.shape
    (num_experts,) = group_sizes.shape
    inter = check_fp8_expert_weights(weights, num_experts, hidden, max_experts=_MAX_EXPERTS)
    if m >= 2**31:
        raise ValueError(f"x: rows M must be below 2^31, got {m}")
    check_num_sms(num_sms)
    require_native("mok_jax.ops.fp8_grouped_ffn")
    out = (
        jax.ShapeDtypeStruct((m, hidden), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, inter), _F8),
        jax.ShapeDtypeStruct((inter // BLOCK, m), jnp.float32),
        jax.ShapeDtypeStruct((m, hidden), _F8),
        jax.ShapeDtypeStruct((hidden // BLOCK, m), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    # vmap: "sequential", for the reason in mok_jax.ops.grouped_ffn.
    res = jax.ffi.ffi_call("mok_fp8_grouped_ffn", out, vmap_method="sequential")(
        x, group_sizes, weights.gate_up, weights.gate_up_scale, weights.down, weights.down_scale,
        num_sms=np.int32(0 if num_sms is None else num_sms),
    )
    return Fp8GroupedFfnOutput(*res)
