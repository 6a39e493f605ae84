"""FFI wrappers for mok_expert_counts and mok_expert_layout (ffi/src/ffi_routing.cu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._native import require_native
from mok_jax.expert_layout import PaddedLayout

__all__ = ["MAX_LAYOUT_EXPERTS", "expert_counts", "expert_layout", "expert_layout_call", "layout_chunk"]

# The most experts of one layout: the kernels keep a word per expert in shared memory (kMaxExpertsForCount,
# ffi/include/mok/routing.cuh).
MAX_LAYOUT_EXPERTS = 12 * 1024
# The layout kernels' chunks (ffi/include/mok/routing.cuh): each is a CTA of COUNT and a warp of PLACE, and SCAN, one
# CTA, scans a table of chunks x experts words. Chunks of LAYOUT_MIN_CHUNK slots give a warp a few dozen steps and
# the GPU a warp per 1024 slots; past LAYOUT_MAX_CELLS words of table the chunks grow instead, so that SCAN's work is
# bounded (many experts and many slots: fewer, longer chunks).
LAYOUT_MIN_CHUNK = 1024
LAYOUT_MAX_CELLS = 1 << 18


def expert_counts(topk_idx: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Tokens routed to each expert, on the GPU.

    topk_idx: int32[T, k] -> (counts: int32[num_experts], num_invalid: int32[]) where num_invalid
    counts indices outside [0, num_experts) (they are not counted for any expert).
    """
    _check_ids_and_experts(topk_idx, num_experts)
    require_native("mok_jax.ops.expert_counts")
    out = (jax.ShapeDtypeStruct((num_experts,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    # vmap: "sequential" (a loop of unbatched calls): the op is pure and its handler takes topk_idx of rank 2
    # only, so "expand_dims"/"broadcast_all" (a batch dimension handed to the handler) would be rejected.
    return jax.ffi.ffi_call("mok_expert_counts", out, vmap_method="sequential")(topk_idx)


def layout_chunk(slots: int, num_experts: int) -> int:
    """Slots per chunk of the layout kernels for ``slots`` slots and ``num_experts`` experts: a multiple of 32 (a
    warp's step), at least LAYOUT_MIN_CHUNK where there are that many slots, with at most LAYOUT_MAX_CELLS //
    num_experts chunks."""
    chunks = max(1, min(-(-slots // LAYOUT_MIN_CHUNK), LAYOUT_MAX_CELLS // num_experts))
    per_chunk = -(-slots // chunks)
    return max(32, -(-per_chunk // 32) * 32)


def _check_ids_and_experts(topk_idx, num_experts) -> None:
    """The arguments both kernels take (kMaxExpertsForCount in ffi/include/mok/routing.cuh bounds both)."""
    if getattr(topk_idx, "ndim", None) != 2:
        raise ValueError(f"topk_idx must be rank 2 [tokens, top_k], got shape {getattr(topk_idx, 'shape', None)}")
    if topk_idx.dtype != jnp.int32:
        raise TypeError(f"topk_idx must be int32, got {topk_idx.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_LAYOUT_EXPERTS:
        raise ValueError(f"num_experts must be an int in [1, {MAX_LAYOUT_EXPERTS}], got {num_experts!r}")


def _check_layout_args(topk_idx, num_experts, block) -> None:
    _check_ids_and_experts(topk_idx, num_experts)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    rows = topk_idx.shape[0] * topk_idx.shape[1] + block * num_experts
    if rows >= 2**31:
        raise ValueError(f"the layout's rows T * k + block * E = {rows} must be below 2^31")


def expert_layout_call(topk_idx: jax.Array, num_experts: int, block: int, first_expert) -> PaddedLayout:
    """``expert_layout``'s ffi_call without the check that this machine has the kernels: for a branch that is traced
    everywhere and lowered only for CUDA (``jax.lax.platform_dependent``, mok_jax.layer.op_layout). ``first_expert``:
    an int32 scalar (an array); it and topk_idx must vary over the same manual axes inside shard_map, and the results
    vary over none (the caller marks them)."""
    _check_layout_args(topk_idx, num_experts, block)
    tokens, k = topk_idx.shape
    slots, rows = tokens * k, tokens * k + block * num_experts
    chunk = layout_chunk(slots, num_experts)
    i32 = jnp.int32
    out = (jax.ShapeDtypeStruct((tokens, k), i32), jax.ShapeDtypeStruct((rows,), i32),
           jax.ShapeDtypeStruct((rows,), i32), jax.ShapeDtypeStruct((num_experts,), i32),
           jax.ShapeDtypeStruct((-(-slots // chunk) * num_experts + num_experts,), i32))  # scratch: table and shift
    # vmap: "sequential", as expert_counts: the handler takes topk_idx of rank 2 and a scalar first_expert only.
    pos, src_token, src_slot, group_sizes, _ = jax.ffi.ffi_call("mok_expert_layout", out, vmap_method="sequential")(
        topk_idx, jnp.asarray(first_expert, i32), block=np.int32(block), chunk=np.int32(chunk))
    return PaddedLayout(pos, src_token, src_slot, group_sizes)


def expert_layout(topk_idx: jax.Array, num_experts: int, block: int = 128, first_expert=0) -> PaddedLayout:
    """The padded expert-major layout of topk_idx on the GPU: the bits of mok_jax.expert_layout.padded_layout
    (first_expert 0) and of rank_layout (first_expert = rank * num_experts, block 128), in three small kernels.

    topk_idx: int32[T, k]; slot (t, j) goes to local expert topk_idx[t, j] - first_expert when that is in [0,
    num_experts), and gets no row otherwise (-1 masks, invalid ids, other ranks' experts). num_experts: at most
    MAX_LAYOUT_EXPERTS. first_expert: an int or an int32 scalar, which may be traced (``jax.lax.axis_index``).
    Returns PaddedLayout(pos int32[T, k], src_token int32[M], src_slot int32[M], group_sizes int32[E]), M = T * k +
    block * num_experts.
    """
    _check_layout_args(topk_idx, num_experts, block)
    require_native("mok_jax.ops.expert_layout")
    return expert_layout_call(topk_idx, num_experts, block, first_expert)
