"""FFI wrapper for mok_experts_backward (ffi/src/ffi_moe_backward.cu): the routed experts' backward at EP size 1.

From the tokens' x and dy, the router weights and a padded expert-major layout of the slots
(mok_jax.expert_layout.padded_layout: every group padded to a multiple of 128 rows) it gathers each row's token
and weight, recomputes the SwiGLU forward's fp32 gate/up (or takes the forward's kept copy, ``gu``), and returns
the gradients of x (each token's slot rows summed), of each slot's router weight and of the routed weights. The
gathered rows and the kernel's scratch (gu, dgu, hw, the dw partials, the per-row dx and dw) are extra outputs that
XLA allocates and this wrapper drops, except the per-row dx (``dx_rows``, for the expert-parallel backward).
mok_jax.reference.experts_backward_reference has the same signature and semantics in pure JAX.

With the shared expert's weights it also runs the shared expert's backward over the tokens' own rows (weight 1)
and adds its dx to dx.

The call's operands: x, dy, topk_weight, pos, src_slot, group_sizes, gate_up, down, gu_in (f32[M, 2I] when ``gu``
is given, else f32[0, 2I]), gu_part, gu_part_row and the blocks they cover (f32[R, 2I], int32[M], int32[ceil(M /
128)] when ``gu_part`` is given, else f32[0, 2I], int32[0], int32[0]), shared_gate_up, shared_down (bf16[H, 0] and
bf16[0, H] without a shared expert);
results: dx, dw, d_gate_up, d_down, status, then the scratch x_e, dy_e, w_e, gu (aliased to gu_in when kept),
dgu, hw, dw partials, dx_e, dw_e, flags, then d_shared_gate_up, d_shared_down and the shared expert's scratch
gus, dgus, hws, dxs (their rows: T with a shared expert, else none).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._native import require_native
from mok_jax.expert_layout import kept_blocks
from mok_jax.validation import check_experts_backward_args, check_num_sms

__all__ = ["EXPERTS_BACKWARD_GROUP_ALIGN", "EXPERTS_BACKWARD_MAX_EXPERTS", "EXPERTS_BACKWARD_MAX_TOP_K",
           "EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP", "EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW",
           "EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP", "ExpertsBackwardOutput", "experts_backward"]

EXPERTS_BACKWARD_GROUP_ALIGN = 128  # every group size is a multiple of this (the kernel's M tile)
EXPERTS_BACKWARD_MAX_EXPERTS = 1024  # as mok_grouped_ffn (GROUPED_FFN_MAX_EXPERTS)
EXPERTS_BACKWARD_MAX_TOP_K = 32  # the handler's limit on k (ffi/src/experts_backward.cu, the slot sum)
EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP = 1  # status bit: some group size < 0
EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW = 2  # status bit: sum(group_sizes) > M
EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP = 4  # status bit: some group size is not a multiple of 128

_DW_PART_COLS = 256  # the kernel's dw partials: one column per 256 intermediate columns
_DX_ROWS = 7  # index of dx_e (the per-row dx) among the call's scratch results
_FLAGS = 9  # index of the dependency counters (and time words) among them


# The kernel's kinds of work item, in its list's order (ffi/include/mok/experts_backward.cuh).
ITEM_KINDS = ("gather", "gate/up recompute", "down dgrad + SwiGLU bwd", "gate/up dgrad", "router-weight sum",
              "d_down", "d_gate_up", "slot sum")
_TIME_WORDS = 4 * len(ITEM_KINDS)  # two u64 per kind (consumers' ns, ns waited), summed over the CTAs


def _flag_words(rows: int, experts: int, shared_rows: int = 0) -> int:
    """s32 words of the kernel's scratch flags (experts_backward_flag_words in experts_backward.cuh): the time
    words, then the dependency counters (``shared_rows``: T with a shared expert, else 0)."""
    blocks = lambda n: -(-n // EXPERTS_BACKWARD_GROUP_ALIGN)  # noqa: E731
    return _TIME_WORDS + 3 * (blocks(rows) + experts + blocks(shared_rows)) + 2 * (experts + 1) + 3


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


def experts_backward(
    x: jax.Array, dy: jax.Array, topk_weight: jax.Array, pos: jax.Array, src_slot: jax.Array,
    group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array, *, num_sms: int | None = None,
    gu: jax.Array | None = None, shared_gate_up: jax.Array | None = None, shared_down: jax.Array | None = None,
    gu_part: jax.Array | None = None, gu_part_row: jax.Array | None = None,
    return_gu: bool = False, return_item_ns: bool = False,
) -> ExpertsBackwardOutput | tuple:
    """The routed SwiGLU experts' backward over padded expert-major rows, on the GPU.

    x: bf16[T, H]; dy: bf16[T, H] (the output gradient); topk_weight: f32[T, k] (k <= 32,
    EXPERTS_BACKWARD_MAX_TOP_K); pos: int32[T, k], src_slot: int32[M], group_sizes: int32[E]: a
    mok_jax.expert_layout.PaddedLayout (rows [start_e, start_e + group_sizes[e]) are expert e's, start = exclusive
    prefix sum, each size a multiple of 128, EXPERTS_BACKWARD_GROUP_ALIGN); gate_up: bf16[E, H, 2I] (gate = first
    I columns, up = last I); down: bf16[E, I, H].

    Gather: row r < sum(group_sizes) holds slot s = src_slot[r]: x_r = x[s // k], dy_r = dy[s // k], w_r =
    topk_weight.reshape(-1)[s]; a padding row (s = -1, or any s outside [0, T k)) holds zeros (w_r = 0).
    Per row r of expert e, fp32 accumulation throughout:

        g, u = split(x_r @ gate_up[e]) (fp32, or gu[r]);  h = silu(g) * u;  dh' = dy_r @ down[e]^T
        dw_r = <dh', h>;  dh = w_r dh';  dgu_r = bf16([dh u silu'(g), dh silu(g)]);  dx_r = bf16(dgu_r @ gate_up[e]^T)
        d_down[e] = bf16(sum_r bf16(w_r h_r)^T dy_r);  d_gate_up[e] = bf16(sum_r x_r^T dgu_r)  (zeros if empty)

    Rows past sum(group_sizes) give dx_r = 0 and dw_r = 0. Sum: dx[t] = sum_j dx_{pos[t, j]} over j = 0..k-1 in
    that order, in fp32 (of the bf16 rows), and dw[t, j] = dw_{pos[t, j]}; a slot with pos outside [0, M) (the
    layout's M for a masked or invalid slot) adds nothing and gets dw = 0. dw is d loss / d w, not divided by
    anything: the router-weight gradient. The op does not check that pos and src_slot are inverses; no value of
    them makes it read out of bounds.

    status is 0, or a bit mask of EXPERTS_BACKWARD_STATUS_* when the group sizes are bad: d_gate_up and d_down
    are then NaN (written by the kernel, so no caller needs a pass over them to flag it); dx and dw are not
    specified. num_sms: persistent CTAs (one per SM) to use; None uses every SM. The result does not depend
    on it.

    gu: None (the op recomputes g, u = x_r @ gate_up[e] in fp32 itself), or f32[M, 2I], the forward's kept fp32
    gate/up accumulators in this layout: row r holds g in columns [0, I) and u in [I, 2I) of row r's slot; rows
    that hold no slot may hold anything (the op zeroes the padding rows inside the groups, in place: XLA hands
    the op gu's buffer, and copies it first only if gu is still needed elsewhere). The op then skips its
    recompute and reads these; the outputs are the bits it gives when its recompute equals gu on the slots'
    rows (nothing else changes).

    gu_part, gu_part_row: None, or some rows' kept g | u (MoEConfig(keep="ring")): f32[R, 2I], and int32[M], row
    r's row of gu_part (outside [0, R): none). A block of 128 rows whose every slot row has one takes its g, u
    from there (``mok_jax.expert_layout.kept_blocks``; its padding rows get zeros), every other block is
    recomputed, all its rows. Again the outputs are the bits of the recompute when gu_part equals it on those
    rows. Not with ``gu``.

    shared_gate_up: bf16[H, 2Is], shared_down: bf16[Is, H] (both or neither): the shared expert, whose backward
    the same kernel then runs over the T tokens' own rows, as one more expert of weight 1 (fp32 accumulation,
    the routed roundings):

        g, u = split(x @ shared_gate_up);  h = silu(g) * u;  dh = dy @ shared_down^T
        dgu = bf16([dh u silu'(g), dh silu(g)]);  dx_s = dgu @ shared_gate_up^T          (fp32)
        d_shared_down = bf16(bf16(h)^T dy);  d_shared_gate_up = bf16(x^T dgu)            (K = T, in token order)

    and dx[t] becomes (the slot sum) + dx_s[t] in fp32. The shared expert's gradients do not depend on the group
    sizes or their status.

    return_gu: a test and benchmark hook: also return the f32[M, 2I] g, u that the op used: its own recompute
    (with ``gu_part``: and the rows it took from there)
    (rows past sum(group_sizes) set to zeros here, as the forward keeps them; not specified when status != 0),
    or ``gu`` itself when given. Returns (ExpertsBackwardOutput, gu) then.

    return_item_ns: a benchmark hook: also return f32[2, len(ITEM_KINDS)], per kind of the kernel's work items the
    ns its CTAs' consumers spent in them and the ns they waited for inputs, summed over the CTAs. Appended last.
    """
    where = "mok_jax.ops.experts_backward"
    tokens, top_k, m, hidden, inter, num_experts = check_experts_backward_args(
        x, dy, topk_weight, pos, src_slot, group_sizes, gate_up, down, where=where,
        max_experts=EXPERTS_BACKWARD_MAX_EXPERTS, gu=gu, shared_gate_up=shared_gate_up, shared_down=shared_down,
        gu_part=gu_part, gu_part_row=gu_part_row)
    if m * max(hidden, 2 * inter) >= 2**31:
        raise ValueError(f"{where}: src_slot: rows M times H and times 2I must be below 2^31 (the kernel's 32-bit "
                         f"offsets), got M = {m}, H = {hidden}, I = {inter}")
    if top_k > EXPERTS_BACKWARD_MAX_TOP_K:
        raise ValueError(f"{where}: topk_weight: slots per token k must be at most {EXPERTS_BACKWARD_MAX_TOP_K}, "
                         f"got {top_k}")
    if tokens * hidden >= 2**31:
        raise ValueError(f"{where}: x: tokens T times H must be below 2^31 (the kernel's 32-bit offsets), got "
                         f"T = {tokens}, H = {hidden}")
    shared = shared_gate_up is not None
    check_num_sms(num_sms)
    require_native(where)
    bf16, f32 = jnp.bfloat16, jnp.float32
    kept = gu is not None
    gu_in = gu if kept else jnp.zeros((0, 2 * inter), f32)  # [0, 2I]: none kept, the op recomputes them
    if gu_part is None:
        gu_part, gu_part_row, gu_block = jnp.zeros((0, 2 * inter), f32), jnp.zeros((0,), jnp.int32), \
            jnp.zeros((0,), jnp.int32)
    else:
        gu_block = kept_blocks(src_slot, gu_part_row, gu_part.shape[0], tokens * top_k, EXPERTS_BACKWARD_GROUP_ALIGN)
    s_inter = shared_down.shape[0] if shared else 0
    s_rows = tokens if shared else 0
    if not shared:
        shared_gate_up, shared_down = jnp.zeros((hidden, 0), bf16), jnp.zeros((0, hidden), bf16)
    out = (
        jax.ShapeDtypeStruct((tokens, hidden), f32),  # dx
        jax.ShapeDtypeStruct((tokens, top_k), f32),  # dw
        jax.ShapeDtypeStruct((num_experts, hidden, 2 * inter), bf16),  # d_gate_up
        jax.ShapeDtypeStruct((num_experts, inter, hidden), bf16),  # d_down
        jax.ShapeDtypeStruct((), jnp.int32),  # status
        # scratch, dropped: the gathered x_e, dy_e, w_e; gu, dgu, hw = bf16(w h), the dw partials; dx_e, dw_e
        jax.ShapeDtypeStruct((m, hidden), bf16),
        jax.ShapeDtypeStruct((m, hidden), bf16),
        jax.ShapeDtypeStruct((m,), f32),
        jax.ShapeDtypeStruct((m, 2 * inter), f32),  # g, u in fp32, as the forward has them (kept: aliases gu)
        jax.ShapeDtypeStruct((m, 2 * inter), bf16),
        jax.ShapeDtypeStruct((m, inter), bf16),
        jax.ShapeDtypeStruct((m, -(-inter // _DW_PART_COLS)), f32),
        jax.ShapeDtypeStruct((m, hidden), bf16),  # dx_e: the per-row dx (dx_rows)
        jax.ShapeDtypeStruct((m,), f32),
        jax.ShapeDtypeStruct((_flag_words(m, num_experts, s_rows),), jnp.int32),  # the dependency counters
        jax.ShapeDtypeStruct((hidden, 2 * s_inter), bf16),  # d_shared_gate_up
        jax.ShapeDtypeStruct((s_inter, hidden), bf16),  # d_shared_down
        # the shared expert's scratch, dropped: gus (f32), dgus, hws = bf16(h), dxs (its f32 dx)
        jax.ShapeDtypeStruct((s_rows, 2 * s_inter), f32),
        jax.ShapeDtypeStruct((s_rows, 2 * s_inter), bf16),
        jax.ShapeDtypeStruct((s_rows, s_inter), bf16),
        jax.ShapeDtypeStruct((s_rows, hidden), f32),
    )
    # vmap: "sequential", as mok_grouped_ffn (ops/grouped_ffn.py): the op is pure and the handler takes one
    # problem's rank-2 tokens and rank-1 rows and group sizes.
    # kept: the scratch gu (result 8) is the kept buffer itself (operand 8), whose padding rows the op zeroes
    dx, dw, d_gate_up, d_down, status, *scratch = jax.ffi.ffi_call(
        "mok_experts_backward", out, vmap_method="sequential", input_output_aliases={8: 8} if kept else None)(
        x, dy, topk_weight, pos, src_slot, group_sizes, gate_up, down, gu_in, gu_part, gu_part_row, gu_block,
        shared_gate_up, shared_down, num_sms=np.int32(0 if num_sms is None else num_sms))
    d_sgu, d_sdn = scratch[_FLAGS + 1], scratch[_FLAGS + 2]
    result = ExpertsBackwardOutput(dx, dw, d_gate_up, d_down, status, dx_rows=scratch[_DX_ROWS],
                                   d_shared_gate_up=d_sgu if shared else None, d_shared_down=d_sdn if shared else None)
    extras = []
    if return_gu:
        # the recompute leaves the rows past the groups unwritten (nothing reads them); zeros, as the forward keeps
        used = jnp.sum(jnp.maximum(group_sizes, 0))
        extras.append(gu if kept else jnp.where((jnp.arange(m) < used)[:, None], scratch[3], 0.0))
    if return_item_ns:
        words = scratch[_FLAGS][:_TIME_WORDS].reshape(2, len(ITEM_KINDS), 2)
        extras.append(_u64_as_f32(words))
    return (result, *extras) if extras else result


def _u64_as_f32(words: jax.Array) -> jax.Array:
    """[..., 2] s32 halves (low word first) of u64 counts, as f32 (rounded to 24 bits: ns read as ms)."""
    lo = words[..., 0].astype(jnp.uint32).astype(jnp.float32)
    hi = words[..., 1].astype(jnp.uint32).astype(jnp.float32)
    return hi * jnp.float32(2.0**32) + lo
