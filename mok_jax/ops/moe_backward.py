"""FFI wrapper for mok_experts_backward (ffi/src/ffi_moe_backward.cu): the routed experts' backward at EP size 1.

From the tokens' x and dy, the router weights and a padded expert-major layout of the slots
(mok_jax.expert_layout.padded_layout: every group padded to a multiple of 128 rows) it gathers each row's token
and weight, recomputes the SwiGLU forward's gate/up (fp32 accumulation, stored in bf16: KEPT_GU_DTYPE), or takes the
forward's kept copy (``gu``, rounded the same way), and returns
the gradients of x (each token's slot rows summed), of each slot's router weight and of the routed weights. The
gathered rows and the kernel's scratch (gu, dgu, hw, the dw partials, the per-row dx and dw) are extra outputs that
XLA allocates and this wrapper drops, except the per-row dx (``dx_rows``, for the expert-parallel backward).
mok_jax.reference.experts_backward_reference has the same signature and semantics in pure JAX.

With the shared expert's weights it also runs the shared expert's backward over the tokens' own rows (weight 1)
and adds its dx to dx.

The call's operands: x, dy, topk_weight, pos, src_slot, group_sizes, gate_up, down, gu_in (bf16[M, 2I] when ``gu``
is given, else bf16[0, 2I]), gu_part, gu_part_row and the blocks they cover (bf16[R, 2I], int32[M], int32[ceil(M /
128)] when ``gu_part`` is given, else bf16[0, 2I], int32[0], int32[0]), shared_gate_up, shared_down (bf16[H, 0] and
bf16[0, H] without a shared expert);
results: dx, dw, d_gate_up, d_down, status, then the scratch x_e, dy_e, w_e, gu (aliased to gu_in when kept),
dgu, hw, dw partials, dx_e, dw_e, counters, then d_shared_gate_up, d_shared_down and the shared expert's scratch
gus, dgus, hws, dxs (their rows: T with a shared expert, else none).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._native import require_native
from mok_jax.backward_types import (  # noqa: F401  (re-exported: the op's contract, shared with its reference)
    EXPERTS_BACKWARD_GROUP_ALIGN,
    EXPERTS_BACKWARD_MAX_EMULATED_RANKS,
    EXPERTS_BACKWARD_MAX_EXPERTS,
    EXPERTS_BACKWARD_MAX_TOP_K,
    EXPERTS_BACKWARD_PARAM_RANKS,
    EXPERTS_BACKWARD_STATUS_COMM,
    EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP,
    EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW,
    EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP,
    ExpertsBackwardEpOutput,
    ExpertsBackwardOutput,
)
from mok_jax.expert_layout import kept_blocks
from mok_jax.validation import (KEPT_GU_DTYPE, check_experts_backward_args, check_kept_gu, check_num_sms,
                                 check_workspace_call)

__all__ = ["EXPERTS_BACKWARD_GROUP_ALIGN", "EXPERTS_BACKWARD_MAX_EXPERTS", "EXPERTS_BACKWARD_MAX_TOP_K",
           "EXPERTS_BACKWARD_STATUS_COMM", "EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP",
           "EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW", "EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP", "ExpertsBackwardEpOutput",
           "ExpertsBackwardOutput", "experts_backward", "experts_backward_ep"]


_DW_PART_COLS = 256  # the kernel's dw partials: one column per 256 intermediate columns
_DX_ROWS = 7  # index of dx_e (the per-row dx) among the call's scratch results
_COUNTERS = 9  # index of the dependency counters (and time words) among them


# The kernel's kinds of work item, in its list's order (ffi/include/mok/experts_backward.cuh); "share" and "send"
# run only in the expert-parallel form (experts_backward_ep).
ITEM_KINDS = ("share", "gather", "gate/up recompute", "down dgrad + SwiGLU bwd", "gate/up dgrad",
              "router-weight sum", "send", "d_down", "d_gate_up", "slot sum")
# three u64 per kind, summed over the CTAs: the consumers' ns, the ns waited, a GEMM tile's ns after its last MMA
ITEM_TIMES = ("busy", "wait", "epilogue")
_TIME_WORDS = 2 * len(ITEM_TIMES) * len(ITEM_KINDS)


def _counter_words(rows: int, experts: int, shared_rows: int = 0) -> int:
    """s32 words of the kernel's scratch counters (experts_backward_counter_words in experts_backward.cuh): the time
    words, then the dependency counters (``shared_rows``: T with a shared expert, else 0), rounded up to 4."""
    blocks = lambda n: -(-n // EXPERTS_BACKWARD_GROUP_ALIGN)  # noqa: E731
    words = _TIME_WORDS + 4 * (blocks(rows) + experts + blocks(shared_rows)) + 2 * (experts + 1) + 5
    return -(-words // 4) * 4  # a multiple of 4: each emulated rank's u64 time words stay 8-byte aligned


def _ep_counter_words(rows: int, experts: int, ranks: int) -> int:
    """s32 words of one rank's row of the expert-parallel op's counters (experts_backward_ep_counter_words in
    experts_backward.cuh): ``_counter_words``, and in an emulated call of more than EXPERTS_BACKWARD_PARAM_RANKS ranks,
    from the next multiple of 16 words, the rank's kernel parameters, whose size the native library gives."""
    if ranks <= EXPERTS_BACKWARD_PARAM_RANKS:
        return _counter_words(rows, experts)
    from mok_jax.workspace.native import _host_lib  # the library's functions, declared for ctypes once

    return int(_host_lib().mok_experts_backward_ep_counter_words(rows, experts, ranks))


ITEM_FIELDS = ("kind", "shared", "group", "mb", "m_block", "n_block", "row0", "row_end")


def item_list(group_sizes, *, rows: int, hidden: int, inter: int, shared_inter: int = 0, shared_rows: int = 0,
              ep: int = 1, kept: bool = False, share_items: int = 0) -> np.ndarray:
    """The backward kernel's work items in ticket order, as its CTAs decode them, computed on the host by the native
    library (mok_experts_backward_item_list; no GPU): int32[n, len(ITEM_FIELDS)], ``kind`` an index of ITEM_KINDS.
    For tests and reading of the list's order: ``group_sizes`` the routed experts' padded rows of ``rows``, the
    shared expert's ``shared_inter`` and ``shared_rows`` (0: none), ``kept`` g | u (no gate/up recompute items)."""
    from mok_jax.workspace.native import _host_lib

    lib = _host_lib()
    sizes = np.ascontiguousarray(group_sizes, np.int32)
    args = (sizes.ctypes.data, sizes.size, rows, hidden, inter, shared_inter, shared_rows, ep, int(kept), share_items)
    n = int(lib.mok_experts_backward_item_list(*args, None, 0))
    if n < 0:
        raise ValueError(f"group_sizes: {sizes.size} experts, the kernel takes at most {EXPERTS_BACKWARD_MAX_EXPERTS}")
    out = np.zeros((n, len(ITEM_FIELDS)), np.int32)
    lib.mok_experts_backward_item_list(*args, out.ctypes.data, n)
    return out


def _row_scratch(m: int, hidden: int, inter: int, counter_words: int, lead: tuple = ()) -> tuple:
    """The op's scratch results over its M rows (each with the leading axes ``lead``: (R,) for the EP form),
    dropped by the wrappers: the gathered x_e, dy_e, w_e; gu (g, u in KEPT_GU_DTYPE, as the forward keeps them; kept:
    aliases gu_in), dgu, hw = bf16(w h), the dw partials; dx_e (the per-row dx, dx_rows), dw_e; the dependency
    counters."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    shapes = (((m, hidden), bf16), ((m, hidden), bf16), ((m,), f32), ((m, 2 * inter), KEPT_GU_DTYPE),
              ((m, 2 * inter), bf16),
              ((m, inter), bf16), ((m, -(-inter // _DW_PART_COLS)), f32), ((m, hidden), bf16), ((m,), f32),
              ((counter_words,), jnp.int32))
    return tuple(jax.ShapeDtypeStruct((*lead, *shape), dtype) for shape, dtype in shapes)


def _kept_operands(gu, gu_part, gu_part_row, src_slot, inter: int, slots: int, ranks: int | None = None) -> tuple:
    """The op's operands of kept g, u (gu_in, gu_part, gu_part_row, gu_block), checked by the caller: ``gu`` as
    gu_in, or [0, 2I] when none is kept (the op recomputes them); ``gu_part`` with its row map and which of the
    128-row blocks it covers are kept blocks (kept_blocks over the ``slots`` slot ids), or empty ones. ``ranks``: the
    EP form's leading rank axis (each rank's blocks from its own layout), None at EP 1."""
    lead = () if ranks is None else (ranks,)
    gu_in = gu if gu is not None else jnp.zeros((*lead, 0, 2 * inter), KEPT_GU_DTYPE)
    if gu_part is None:
        return gu_in, jnp.zeros((*lead, 0, 2 * inter), KEPT_GU_DTYPE), jnp.zeros((*lead, 0), jnp.int32), \
            jnp.zeros((*lead, 0), jnp.int32)

    def blocks(src, row, part):
        return kept_blocks(src, row, part.shape[0], slots, EXPERTS_BACKWARD_GROUP_ALIGN)

    gu_block = blocks(src_slot, gu_part_row, gu_part) if ranks is None else \
        jnp.stack([blocks(src_slot[r], gu_part_row[r], gu_part[r]) for r in range(ranks)])
    return gu_in, gu_part, gu_part_row, gu_block


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

    gu: None (the op recomputes g, u = x_r @ gate_up[e] itself, fp32 accumulation stored in bf16), or bf16[M, 2I],
    the forward's kept gate/up accumulators in this layout, rounded to bf16 as the op rounds its own: row r holds
    g in columns [0, I) and u in [I, 2I) of row r's slot; rows that hold no slot may hold anything (the op zeroes
    the padding rows inside the groups, in place: XLA hands the op gu's buffer, and copies it first only if gu is
    still needed elsewhere). The op then skips its recompute and reads these; the outputs are the bits it gives
    when its recompute equals gu on the slots' rows (nothing else changes).

    gu_part, gu_part_row: None, or some rows' kept g | u (MoEConfig(keep="ring" | "balanced")): bf16[R, 2I], and
    int32[M], row r's row of gu_part (outside [0, R): none). A block of 128 rows whose every slot row has one
    takes its g, u from there (``mok_jax.expert_layout.kept_blocks``; its padding rows get zeros), every other
    block is recomputed, all its rows. Again the outputs are the bits of the recompute when gu_part equals it on
    those rows. Not with ``gu``.

    shared_gate_up: bf16[H, 2Is], shared_down: bf16[Is, H] (both or neither): the shared expert, whose backward
    the same kernel then runs over the T tokens' own rows, as one more expert of weight 1 (fp32 accumulation,
    the routed roundings):

        g, u = bf16(split(x @ shared_gate_up));  h = silu(g) * u;  dh = dy @ shared_down^T
        dgu = bf16([dh u silu'(g), dh silu(g)]);  dx_s = dgu @ shared_gate_up^T          (fp32)
        d_shared_down = bf16(bf16(h)^T dy);  d_shared_gate_up = bf16(x^T dgu)            (K = T, in token order)

    and dx[t] becomes (the slot sum) + dx_s[t] in fp32. The shared expert's gradients do not depend on the group
    sizes or their status.

    return_gu: a test and benchmark hook: also return the bf16[M, 2I] g, u that the op used: its own recompute
    (with ``gu_part``: and the rows it took from there)
    (rows past sum(group_sizes) set to zeros here, as the forward keeps them; not specified when status != 0),
    or ``gu`` itself when given. Returns (ExpertsBackwardOutput, gu) then.

    return_item_ns: a benchmark hook: also return f32[3, len(ITEM_KINDS)], per kind of the kernel's work items the
    ns its CTAs' consumers spent in them, the ns they waited for inputs and, of the first, the ns a GEMM tile spent
    after its last MMA (its epilogue), summed over the CTAs (rows in ITEM_TIMES order). Appended last.
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
    gu_in, gu_part, gu_part_row, gu_block = _kept_operands(gu, gu_part, gu_part_row, src_slot, inter, tokens * top_k)
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
        *_row_scratch(m, hidden, inter, _counter_words(m, num_experts, s_rows)),
        jax.ShapeDtypeStruct((hidden, 2 * s_inter), bf16),  # d_shared_gate_up
        jax.ShapeDtypeStruct((s_inter, hidden), bf16),  # d_shared_down
        # the shared expert's scratch, dropped: gus (as gu), dgus, hws = bf16(h), dxs (its f32 dx)
        jax.ShapeDtypeStruct((s_rows, 2 * s_inter), KEPT_GU_DTYPE),
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
    d_sgu, d_sdn = scratch[_COUNTERS + 1], scratch[_COUNTERS + 2]
    result = ExpertsBackwardOutput(dx, dw, d_gate_up, d_down, status, dx_rows=scratch[_DX_ROWS],
                                   d_shared_gate_up=d_sgu if shared else None, d_shared_down=d_sdn if shared else None)
    extras = []
    if return_gu:
        # the recompute leaves the rows past the groups unwritten (nothing reads them); zeros, as the forward keeps
        used = jnp.sum(jnp.maximum(group_sizes, 0))
        zero = jnp.zeros((), KEPT_GU_DTYPE)
        extras.append(gu if kept else jnp.where((jnp.arange(m) < used)[:, None], scratch[3], zero))
    if return_item_ns:
        words = scratch[_COUNTERS][:_TIME_WORDS].reshape(len(ITEM_TIMES), len(ITEM_KINDS), 2)
        extras.append(_u64_as_f32(words))
    return (result, *extras) if extras else result


def _u64_as_f32(words: jax.Array) -> jax.Array:
    """[..., 2] s32 halves (low word first) of u64 counts, as f32 (rounded to 24 bits: ns read as ms)."""
    lo = words[..., 0].astype(jnp.uint32).astype(jnp.float32)
    hi = words[..., 1].astype(jnp.uint32).astype(jnp.float32)
    return hi * jnp.float32(2.0**32) + lo


def experts_backward_ep(
    ws, x: jax.Array, dy: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, src_slot: jax.Array,
    group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array, *, num_sms: int | None = None,
    comm_items: int = 24, gu: jax.Array | None = None, gu_part: jax.Array | None = None,
    gu_part_row: jax.Array | None = None, skip_rank: int = -1, return_item_ns: bool = False,
) -> ExpertsBackwardEpOutput | tuple:
    """The routed experts' backward at EP size P > 1 as one kernel per rank and call, its communication inside
    (mok_experts_backward_ep): experts_backward's math over every rank's tokens, each rank on its own experts'
    slots, with the rows crossing NVLink through ``ws`` (the layer's symmetric workspace, P ranks).

    Every array has a leading rank axis R: 1 inside shard_map (this device's rank), or P with an emulated
    workspace (every rank on one GPU, one launch). Per rank: x, dy: bf16[T, H], its own tokens; topk_idx: int32[T, k],
    its own tokens' global expert ids; topk_weight: f32[P T, k], every rank's router weights in rank order (the
    all-gather); src_slot: int32[M], group_sizes: int32[L]: its padded layout of the slots of its experts
    [r L, (r + 1) L) over the P T tokens (``mok_jax.layer.rank_layout``; slot s = t_global k + j); gate_up:
    bf16[L, H, 2I], down: bf16[L, I, H]; gu or gu_part, gu_part_row: its kept g | u in that layout, as
    experts_backward takes them (with R leading).

    Inside the kernel each rank shares its x and dy rows through the workspace (SHARE); each owner gathers its rows'
    tokens from their ranks, runs experts_backward's GEMMs, and writes each slot's bf16 dx row and dw into the
    token's rank at (t, j); each rank then sums its tokens' k slot rows in slot order in f32. So dx, dw and the
    weight gradients are the bits of experts_backward at EP 1 over the same tokens, for every num_sms and
    comm_items (the items SHARE, the copy of x and dy for the peers, is split into). status as experts_backward's, or
    EXPERTS_BACKWARD_STATUS_COMM: a peer never came within the workspace's timeout (every rank must make the
    same calls in the same order); the workspace is then poisoned and its next call fails. A rank's outputs are
    defined only when every rank's status is 0 (an owner with bad group sizes sends no rows: the layer ORs the
    statuses over the axis and gives NaN gradients then). A peer more than 10 s late fails the call even under a
    longer workspace timeout (the kernel's bound on its waits inside a rank). skip_rank: a test
    mode of an emulated workspace, one rank that makes no call. return_item_ns: as experts_backward's
    (f32[R, 3, len(ITEM_KINDS)]).
    """
    from mok_jax.workspace import Workspace

    where = "mok_jax.ops.experts_backward_ep"
    if isinstance(ws, Workspace) and ws.config.ep < 2:
        raise ValueError(f"{where}: the workspace spans {ws.config.ep} EP rank; at EP 1 use "
                         f"mok_jax.ops.experts_backward")
    arrays = (("x", x, 3, jnp.bfloat16), ("dy", dy, 3, jnp.bfloat16), ("topk_idx", topk_idx, 3, jnp.int32),
              ("topk_weight", topk_weight, 3, jnp.float32), ("src_slot", src_slot, 2, jnp.int32),
              ("group_sizes", group_sizes, 2, jnp.int32), ("gate_up", gate_up, 4, jnp.bfloat16),
              ("down", down, 4, jnp.bfloat16))
    R, T, H = x.shape if x.ndim == 3 else (0, 0, 0)  # a bad rank is reported by the check
    check_workspace_call(ws, where, arrays, ranks=R, tokens=T, hidden=H, max_ranks=EXPERTS_BACKWARD_MAX_EMULATED_RANKS)
    cfg = ws.config
    if dy.shape != x.shape:
        raise ValueError(f"{where}: dy must have x's shape {x.shape}, got {dy.shape}")
    k = topk_idx.shape[2]
    if topk_idx.shape[:2] != (R, T) or not 1 <= k <= min(cfg.top_k, EXPERTS_BACKWARD_MAX_TOP_K):
        raise ValueError(f"{where}: topk_idx must be [{R}, {T}, k] with k in [1, {min(cfg.top_k, 32)}], got "
                         f"{topk_idx.shape}")
    if topk_weight.shape != (R, cfg.ep * T, k):
        raise ValueError(f"{where}: topk_weight must be every rank's router weights, [{R}, {cfg.ep * T}, {k}], got "
                         f"{topk_weight.shape}")
    L, I2 = gate_up.shape[1], gate_up.shape[3]
    if gate_up.shape[0] != R or gate_up.shape[2] != H or I2 % 2:
        raise ValueError(f"{where}: gate_up must be [{R}, L, {H}, 2I], got {gate_up.shape}")
    inter = I2 // 2
    if L * cfg.ep != cfg.num_experts:
        raise ValueError(f"{where}: gate_up holds {L} experts per rank; the workspace has {cfg.num_experts // cfg.ep}")
    if down.shape != (R, L, inter, H):
        raise ValueError(f"{where}: down must be {(R, L, inter, H)}, got {down.shape}")
    if group_sizes.shape != (R, L):
        raise ValueError(f"{where}: group_sizes must be [{R}, {L}], got {group_sizes.shape}")
    m = src_slot.shape[1]
    if src_slot.shape[0] != R or m < 1:
        raise ValueError(f"{where}: src_slot must be [{R}, M] with M >= 1, got {src_slot.shape}")
    if m * max(H, 2 * inter) >= 2**31 or cfg.ep * T * k >= 2**31 or T * H >= 2**31:
        raise ValueError(f"{where}: rows M times H and 2I, T times H, and ep T k must be below 2^31 (32-bit offsets)")
    if L > EXPERTS_BACKWARD_MAX_EXPERTS:
        raise ValueError(f"{where}: gate_up: at most {EXPERTS_BACKWARD_MAX_EXPERTS} experts per rank, got {L}")
    if isinstance(comm_items, bool) or not isinstance(comm_items, (int, np.integer)) or comm_items < 1:
        raise ValueError(f"{where}: comm_items must be an int >= 1, got {comm_items!r}")
    if not (isinstance(skip_rank, (int, np.integer)) and -1 <= skip_rank < R) or (skip_rank >= 0 and R == 1):
        raise ValueError(f"{where}: skip_rank must be -1, or a rank of an emulated call, got {skip_rank!r}")
    check_num_sms(num_sms)
    check_kept_gu(where, gu, gu_part, gu_part_row, m, inter, ranks=R)
    f32 = jnp.float32
    kept = gu is not None
    gu_in, gu_part, gu_part_row, gu_block = _kept_operands(gu, gu_part, gu_part_row, src_slot, inter, cfg.ep * T * k,
                                                           ranks=R)
    require_native(where)
    bf16 = jnp.bfloat16
    out = (
        jax.ShapeDtypeStruct((R, T, H), f32),  # dx
        jax.ShapeDtypeStruct((R, T, k), f32),  # dw
        jax.ShapeDtypeStruct((R, L, H, 2 * inter), bf16),  # d_gate_up
        jax.ShapeDtypeStruct((R, L, inter, H), bf16),  # d_down
        jax.ShapeDtypeStruct((R,), jnp.int32),  # status
        *_row_scratch(m, H, inter, _ep_counter_words(m, L, R), lead=(R,)),
    )
    # has_side_effect: the call talks to the peers through the workspace (as the comm ops and the forward)
    dx, dw, d_gate_up, d_down, status, *scratch = jax.ffi.ffi_call(
        "mok_experts_backward_ep", out, has_side_effect=True, vmap_method="sequential",
        input_output_aliases={8: 8} if kept else None)(
        x, dy, topk_idx, topk_weight, src_slot, group_sizes, gate_up, down, gu_in, gu_part, gu_part_row, gu_block,
        ws_id=np.int64(ws.id), num_sms=np.int32(0 if num_sms is None else num_sms), comm_items=np.int32(comm_items),
        skip_rank=np.int32(skip_rank))
    result = ExpertsBackwardEpOutput(dx, dw, d_gate_up, d_down, status)
    if return_item_ns:
        words = scratch[_COUNTERS][:, :_TIME_WORDS].reshape(R, len(ITEM_TIMES), len(ITEM_KINDS), 2)
        return result, _u64_as_f32(words)
    return result
