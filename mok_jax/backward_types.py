"""What the experts' backward ops return, and their limits and status bits: the contract that the native ops
(``mok_jax.ops.moe_backward``, which re-exports every name here) and their pure-JAX references
(``mok_jax.reference.backward``) share, in a module below both, so that the reference depends on nothing it
checks."""

from __future__ import annotations

from typing import NamedTuple

import jax

__all__ = ["EXPERTS_BACKWARD_GROUP_ALIGN", "EXPERTS_BACKWARD_MAX_EMULATED_RANKS", "EXPERTS_BACKWARD_MAX_EXPERTS",
           "EXPERTS_BACKWARD_MAX_TOP_K", "EXPERTS_BACKWARD_PARAM_RANKS", "EXPERTS_BACKWARD_STATUS_COMM",
           "EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP", "EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW",
           "EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP", "ExpertsBackwardEpOutput", "ExpertsBackwardOutput"]

EXPERTS_BACKWARD_GROUP_ALIGN = 128  # every group size is a multiple of this (the kernel's M tile)
EXPERTS_BACKWARD_MAX_EXPERTS = 1024  # as mok_grouped_ffn (GROUPED_FFN_MAX_EXPERTS)
EXPERTS_BACKWARD_MAX_TOP_K = 32  # the handler's limit on k (ffi/src/experts_backward.cu, the slot sum)
EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP = 1  # status bit: some group size < 0
EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW = 2  # status bit: sum(group_sizes) > M
EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP = 4  # status bit: some group size is not a multiple of 128
EXPERTS_BACKWARD_STATUS_COMM = 8  # status bit (experts_backward_ep): a wait for a peer failed; workspace poisoned
EXPERTS_BACKWARD_MAX_EMULATED_RANKS = 64  # ranks one emulated call of experts_backward_ep carries
# ranks whose kernel parameters the launch's parameter space holds; above it each rank's row of the counters scratch
# holds them (kExpertsBackwardParamRanks, experts_backward_ep_counter_words in ffi/include/mok/experts_backward.cuh)
EXPERTS_BACKWARD_PARAM_RANKS = 8


class ExpertsBackwardOutput(NamedTuple):
    """dx: f32[T, H] (the routed experts' part of d loss / d x); dw: f32[T, k] (d loss / d topk_weight, 0 for a
    slot without a row); d_gate_up: bf16[E, H, 2I]; d_down: bf16[E, I, H]; status: int32[] (0, or a bit mask of
    EXPERTS_BACKWARD_STATUS_*); dx_rows: bf16[M, H], each row's dx_r before the per-token sum (zeros past
    sum(group_sizes) and for padding rows): what the expert-parallel backward sends back to the tokens' ranks.
    d_shared_gate_up: bf16[H, 2Is], d_shared_down: bf16[Is, H]: the shared expert's weight gradients when the
    call was given its weights (dx then holds its part too), else None."""

    dx: jax.Array
    dw: jax.Array
    d_gate_up: jax.Array
    d_down: jax.Array
    status: jax.Array
    dx_rows: jax.Array
    d_shared_gate_up: jax.Array | None = None
    d_shared_down: jax.Array | None = None


class ExpertsBackwardEpOutput(NamedTuple):
    """experts_backward_ep's results, each with the leading rank axis R: dx: f32[R, T, H] (the routed experts'
    part of each rank's own tokens' d loss / d x); dw: f32[R, T, k]; d_gate_up: bf16[R, L, H, 2I]; d_down:
    bf16[R, L, I, H] (each rank's experts); status: int32[R] (0, or EXPERTS_BACKWARD_STATUS_* bits)."""

    dx: jax.Array
    dw: jax.Array
    d_gate_up: jax.Array
    d_down: jax.Array
    status: jax.Array
