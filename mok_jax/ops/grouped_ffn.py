"""FFI wrappers for mok_grouped_ffn and mok_fp8_grouped_ffn (ffi/src/ffi_grouped_ffn.cu): the Hopper grouped expert
FFN in bf16 and in FP8 (E4M3, block-scaled), one op whose precision is its grouped GEMMs' mainloop."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._native import require_native
from mok_jax.fp8 import BLOCK, Fp8ExpertWeights
from mok_jax.validation import check_expert_weights, check_fp8_expert_weights, check_num_sms

__all__ = ["Fp8GroupedFfnOutput", "GroupedFfnOutput", "fp8_grouped_ffn", "grouped_ffn", "GROUPED_FFN_MAX_EXPERTS",
           "GROUPED_FFN_STATUS_NEGATIVE_GROUP", "GROUPED_FFN_STATUS_ROW_OVERFLOW"]

_F8 = jnp.float8_e4m3fn

GROUPED_FFN_MAX_EXPERTS = 1024  # kGroupedFfnMaxExperts in ffi/include/mok/grouped_ffn.cuh
GROUPED_FFN_STATUS_NEGATIVE_GROUP = 1  # status bit: some group size < 0
GROUPED_FFN_STATUS_ROW_OVERFLOW = 2  # status bit: sum(group_sizes) > M


def _rows(x: jax.Array, group_sizes: jax.Array) -> tuple[int, int, int]:
    """(M, H, E) of the rows and groups both precisions take: x bf16[M, H] with M below 2^31, group_sizes int32[E]."""
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"x must be rank 2 [M, H], got shape {getattr(x, 'shape', None)}")
    if getattr(group_sizes, "ndim", None) != 1:
        raise ValueError(f"group_sizes must be rank 1 [E], got shape {getattr(group_sizes, 'shape', None)}")
    if x.dtype != jnp.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    if group_sizes.dtype != jnp.int32:
        raise TypeError(f"group_sizes must be int32, got {group_sizes.dtype}")
    if x.shape[0] >= 2**31:
        raise ValueError(f"x: rows M must be below 2^31, got {x.shape[0]}")
    return (*x.shape, group_sizes.shape[0])


class GroupedFfnOutput(NamedTuple):
    """y: bf16[M, H]; h: bf16[M, I] (the SwiGLU activation, kept for the backward pass); status: int32[]."""

    y: jax.Array
    h: jax.Array
    status: jax.Array


def grouped_ffn(
    x: jax.Array, group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array, *, num_sms: int | None = None
) -> GroupedFfnOutput:
    """SwiGLU expert FFN over expert-major rows, on the GPU (persistent TMA + wgmma grouped GEMMs).

    x: bf16[M, H]; group_sizes: int32[E] (device values: rows [offset_e, offset_e + group_sizes[e]) are
    expert e's, offset = exclusive prefix sum); gate_up: bf16[E, H, 2I] (gate = first I columns, up = last
    I); down: bf16[E, I, H]. Returns (y: bf16[M, H], h: bf16[M, I], status: int32[]) with
    h = silu(x @ gate) * (x @ up) and y = h @ down per expert (fp32 accumulation). Rows past
    sum(group_sizes) are zeros in y and h. status is 0, or a bit mask of GROUPED_FFN_STATUS_* when the
    group sizes are bad (negative, or summing past M); then y and h are all zeros.

    num_sms: persistent CTAs (one per SM) to use; None uses every SM. The result does not depend on it.
    Same semantics as mok_jax.reference.grouped_ffn for y.
    """
    m, hidden, num_experts = _rows(x, group_sizes)
    if getattr(gate_up, "ndim", None) != 3:
        raise ValueError(f"gate_up must be rank 3 [E, H, 2I], got shape {getattr(gate_up, 'shape', None)}")
    if getattr(down, "ndim", None) != 3:
        raise ValueError(f"down must be rank 3 [E, I, H], got shape {getattr(down, 'shape', None)}")
    for name, arr in (("gate_up", gate_up), ("down", down)):
        if arr.dtype != jnp.bfloat16:
            raise TypeError(f"{name} must be bfloat16, got {arr.dtype}")
    inter = check_expert_weights(gate_up, down, num_experts, hidden, max_experts=GROUPED_FFN_MAX_EXPERTS)
    check_num_sms(num_sms)
    require_native("mok_jax.ops.grouped_ffn")
    out = (
        jax.ShapeDtypeStruct((m, hidden), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, inter), jnp.bfloat16),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    # vmap: "sequential" (a loop of unbatched calls). The op is pure, so one call per vmapped element is
    # exactly the unbatched semantics; "expand_dims"/"broadcast_all" would hand the handler a rank-3 x,
    # which it rejects (it takes x [M, H], group sizes of one problem). Folding a batch into one call
    # (the rows and groups of every element concatenated) is possible only with extra empty groups for each
    # element's padding rows past sum(group_sizes); not worth it until someone vmaps this for speed.
    y, h, status = jax.ffi.ffi_call("mok_grouped_ffn", out, vmap_method="sequential")(
        x, group_sizes, gate_up, down, num_sms=np.int32(0 if num_sms is None else num_sms)
    )
    return GroupedFfnOutput(y, h, status)


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
    GROUPED_FFN_STATUS_* when the group sizes are bad; then y is all zeros.

    num_sms: persistent CTAs (one per SM); None uses every SM. The result does not depend on it, and two
    runs give the same bits.
    """
    m, hidden, num_experts = _rows(x, group_sizes)
    inter = check_fp8_expert_weights(weights, num_experts, hidden, max_experts=GROUPED_FFN_MAX_EXPERTS)
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
    # vmap: "sequential", for the reason in grouped_ffn above.
    res = jax.ffi.ffi_call("mok_fp8_grouped_ffn", out, vmap_method="sequential")(
        x, group_sizes, weights.gate_up, weights.gate_up_scale, weights.down, weights.down_scale,
        num_sms=np.int32(0 if num_sms is None else num_sms),
    )
    return Fp8GroupedFfnOutput(*res)
