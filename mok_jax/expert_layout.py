"""The padded expert-major layout of a rank's top-k slots: which row of an expert-major buffer each slot gets.

Slot (t, j) of a token goes to expert ``topk_idx[t, j]``. The buffer holds expert 0's rows, then expert 1's, ...;
each expert's group is padded up to a multiple of ``block`` rows (the backward op's M tile), and within a group
the slots keep their (t, j) row-major order. With T tokens, k slots and E experts the buffer has the static

    M = T * k + block * E

rows, an upper bound of sum(group_sizes) (each group pads fewer than ``block`` rows); rows past the sum are
unused. Masked slots (id -1) and invalid ids get no row.

Deterministic: one stable sort, gathers, and one scatter whose indices are a permutation (unique). The binary
searches are unrolled (``method="scan_unrolled"``): the default ``"scan"`` is a while loop of a few small kernels
per step, which on the GPU cost more launches than the layout's own work.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mok_jax.backward_types import EXPERTS_BACKWARD_GROUP_ALIGN

__all__ = ["PaddedLayout", "gather_rows", "kept_blocks", "padded_layout", "rank_layout"]


class PaddedLayout(NamedTuple):
    """pos: int32[T, k], the buffer row of slot (t, j), or M (one past the end) for a masked or invalid slot;
    src_token: int32[M], the token of each row, -1 for padding; src_slot: int32[M], the flat slot t * k + j of each
    row, -1 for padding; group_sizes: int32[E], each expert's slot count rounded up to a multiple of ``block``."""

    pos: jax.Array
    src_token: jax.Array
    src_slot: jax.Array
    group_sizes: jax.Array

    @property
    def num_rows(self) -> int:
        """M, the static number of buffer rows."""
        return self.src_token.shape[0]


def padded_layout(topk_idx: jax.Array, num_experts: int, block: int = 128) -> PaddedLayout:
    """The padded expert-major layout of topk_idx: int32[T, k] (expert ids in [0, num_experts); -1 masked; any
    other id is invalid and, like -1, gets no row). See the module docstring."""
    if getattr(topk_idx, "ndim", None) != 2:
        raise ValueError(f"topk_idx must be rank 2 [T, k], got shape {getattr(topk_idx, 'shape', None)}")
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise TypeError(f"topk_idx must be an integer array, got {topk_idx.dtype}")
    for name, v in (("num_experts", num_experts), ("block", block)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    tokens, k = topk_idx.shape
    slots = tokens * k
    m = slots + block * num_experts
    if m >= 2**31:
        raise ValueError(f"the layout's rows T * k + block * E = {m} must be below 2^31")
    experts = jnp.arange(num_experts, dtype=jnp.int32)

    ids = topk_idx.reshape(-1).astype(jnp.int32)
    key = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # no row: sorts last
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # slots grouped by expert, (t, j) order within
    sorted_key = key[order]
    search = dict(method="scan_unrolled")  # no while loop (see the module docstring); the same results
    first = jnp.searchsorted(sorted_key, experts, side="left", **search).astype(jnp.int32)  # e's first sorted slot
    counts = jnp.searchsorted(sorted_key, experts, side="right", **search).astype(jnp.int32) - first
    group_sizes = (counts + block - 1) // block * block
    ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
    starts = ends - group_sizes

    # slot -> row: the sorted slot i of expert e sits at starts[e] + (i - first[e])
    rank = jnp.arange(slots, dtype=jnp.int32)
    e_sorted = jnp.minimum(sorted_key, num_experts - 1)
    row_sorted = jnp.where(sorted_key < num_experts, starts[e_sorted] + rank - first[e_sorted], m)
    pos = jnp.zeros((slots,), jnp.int32).at[order].set(row_sorted, unique_indices=True)

    # row -> slot: row r of expert e (the group whose end is past r) is its (r - starts[e])-th slot, if it has one
    row = jnp.arange(m, dtype=jnp.int32)
    e_row = jnp.searchsorted(ends, row, side="right", **search).astype(jnp.int32)  # == E past sum(group_sizes)
    e_safe = jnp.minimum(e_row, num_experts - 1)
    offset = row - starts[e_safe]
    used = (e_row < num_experts) & (offset < counts[e_safe])
    if slots:
        src_slot = jnp.where(used, order[jnp.clip(first[e_safe] + offset, 0, slots - 1)], -1)
    else:  # no tokens: every row is padding
        src_slot = jnp.full((m,), -1, jnp.int32)
    src_token = jnp.where(used, src_slot // k, -1)
    return PaddedLayout(pos.reshape(tokens, k), src_token, src_slot, group_sizes)


def gather_rows(values: jax.Array, src: jax.Array) -> jax.Array:
    """values[src] with zeros where src is -1: values [N, ...], src int32[M] -> [M, ...] in values.dtype."""
    picked = values[jnp.maximum(src, 0)]
    mask = (src >= 0).reshape(src.shape + (1,) * (values.ndim - 1))
    return jnp.where(mask, picked, jnp.zeros((), values.dtype))


def kept_blocks(src_slot: jax.Array, row_of: jax.Array, kept_rows: int, slots: int, block: int = 128) -> jax.Array:
    """int32[ceil(M / block)]: 1 for each block of ``block`` layout rows whose every slot row (src_slot in [0,
    slots)) has a kept row (row_of in [0, kept_rows)), else 0; padding rows need none. The experts' backward
    takes g, u from the kept rows in such a block and recomputes every other block."""
    m = src_slot.shape[0]
    ok = ((row_of >= 0) & (row_of < kept_rows)) | (src_slot < 0) | (src_slot >= slots)
    ok = jnp.concatenate([ok, jnp.ones((-m % block,), bool)])
    return jnp.all(ok.reshape(-1, block), axis=1).astype(jnp.int32)


def rank_layout(topk_idx, num_local: int, rank) -> PaddedLayout:
    """The padded layout of the slots of EP rank ``rank``'s experts [rank * L, (rank + 1) * L) among topk_idx
    (global ids of every rank's tokens, rank-major; every other slot masked): the rows its backward runs on,
    in global (t, j) order within each expert, as the EP-1 layout has them."""
    first = rank * num_local
    mine = (topk_idx >= first) & (topk_idx < first + num_local)
    return padded_layout(jnp.where(mine, topk_idx - first, -1), num_local, block=EXPERTS_BACKWARD_GROUP_ALIGN)
