"""FFI wrapper for mok_expert_counts (ffi/src/ffi_routing.cu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mok_jax._native import require_native

__all__ = ["expert_counts"]


def expert_counts(topk_idx: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Tokens routed to each expert, on the GPU.

    topk_idx: int32[T, k] -> (counts: int32[num_experts], num_invalid: int32[]) where num_invalid
    counts indices outside [0, num_experts) (they are not counted for any expert).
    """
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be rank 2 [tokens, top_k], got shape {topk_idx.shape}")
    if topk_idx.dtype != jnp.int32:
        raise TypeError(f"topk_idx must be int32, got {topk_idx.dtype}")
    require_native("mok_jax.ops.expert_counts")
    out = (jax.ShapeDtypeStruct((num_experts,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    # vmap: "sequential" (a loop of unbatched calls): the op is pure and its handler takes topk_idx of rank 2
    # only, so "expand_dims"/"broadcast_all" (a batch dimension handed to the handler) would be rejected.
    return jax.ffi.ffi_call("mok_expert_counts", out, vmap_method="sequential")(topk_idx)
