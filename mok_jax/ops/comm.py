"""FFI wrappers for the expert-parallel communication ops (ffi/src/ffi_comm.cu).

Both run per rank inside ``jax.shard_map`` over the workspace's EP axis and need a
:class:`mok_jax.workspace.Workspace` created outside ``jit``:

* ``dispatch(ws, x, topk_idx, topk_weight)`` -> ``(recv_x, layout)``: the rows this rank's experts
  need, expert-major (expert, source rank, token, slot), padding rows zeroed; ``layout`` holds the
  group sizes and what ``combine`` needs. With ``token_major=True`` recv_x holds each needed
  (source rank, token) row once, at s * T + t, and expert-major row i is
  ``recv_x[layout.row_source[i]]`` (the layout a row-gathering grouped GEMM reads).
* ``combine(ws, expert_out, layout)`` -> ``(y, status)``: per (token, owner rank) the owner's weighted
  sum of its experts' rows (fp32, slot order, rounded to bf16) goes back to the origin, which adds the
  owners' partials in rank order in fp32 and rounds to bf16.

With ``expert_out = recv_x`` (identity experts) the result equals
``mok_jax.reference.comm.ep_dispatch_combine_identity`` bitwise. ``status`` (int32[4]) is
``[error code, op, EP rank that detected it, awaited rank]``, zeros when healthy.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._native import require_native
from mok_jax.workspace import MODES, Workspace

__all__ = ["DispatchLayout", "combine", "dispatch"]


class DispatchLayout(NamedTuple):
    """What dispatch tells the experts and combine (all per rank, on the device).

    group_sizes: int32[E_local]   rows of each local expert in recv_x (expert-major, from row 0)
    row_table:   int32[ep, T, k]  row of recv_x holding slot (source rank, token, j), or -1
    row_weight:  f32[ep, T, k]    the source's topk_weight of that slot
    row_source:  int32[C]         s * T + t of expert-major row i (-1 past the total): the gather
                                  index into a token-major recv_x
    topk_idx:    int32[T, k]      this rank's own routing (combine needs its owner ranks)
    status:      int32[4]         dispatch's status (zeros when healthy)
    """

    group_sizes: jax.Array
    row_table: jax.Array
    row_weight: jax.Array
    row_source: jax.Array
    topk_idx: jax.Array
    status: jax.Array


# vmap of dispatch / combine: "sequential", one complete call (one protocol round) per vmapped element, in
# order. The ops have side effects on the workspace and talk to the other ranks, so a vmapped call must
# still be a sequence of whole calls that every rank makes alike: under shard_map every rank runs the same
# program (the same number of rounds in the same order, as for any other SPMD sequence of calls), and a
# producer of epoch e first waits for its consumers' acks of epoch e - 1 (ffi/include/mok/comm/workspace.cuh),
# so back-to-back rounds of one op never mix; a dispatch's layout is an output, so interleaving with combine
# does not matter either. "expand_dims"/"broadcast_all" are not an option: the handlers take unbatched
# ranks (x [T, H], ...) and would reject a batch dimension; a batched protocol does not exist.
# The megakernel (ops/moe_forward.py) declares the same for the same reasons (its signals are epoch stamps,
# one epoch per call); its per-call scratch output is unused, so jit drops it from the loop's outputs
# rather than stacking it once per element. (Folding a vmapped batch into the token dimension of one
# call would be faster, but can pass the workspace's max_tokens; not done.)
_VMAP_METHOD = "sequential"


def _mode(name: str | None, default: str, what: str) -> int:
    name = default if name is None else name
    if name not in MODES:
        raise ValueError(f"{what}: mode must be 'pull' or 'push', got {name!r}")
    return MODES[name]


def _num_sms(n: int | None, default: int, what: str) -> int:
    n = default if n is None else n
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not 1 <= n <= 4096:
        raise ValueError(f"{what}: num_sms must be an int in [1, 4096], got {n!r}")
    return int(n)


def check_dispatch_args(ws: Workspace, x, topk_idx, topk_weight, capacity: int | None) -> int:
    """Trace-time validation of dispatch's arguments; returns the output capacity."""
    cfg = ws.config
    what = "mok_jax.ops.dispatch"
    if x.ndim != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"{what}: x must be [tokens, hidden_size={cfg.hidden_size}] per rank, got {x.shape}")
    if x.dtype != jnp.bfloat16:
        raise TypeError(f"{what}: x must be bfloat16, got {x.dtype}")
    tokens = x.shape[0]
    if not 1 <= tokens <= cfg.max_tokens:
        raise ValueError(f"{what}: tokens per rank ({tokens}) must be in [1, max_tokens={cfg.max_tokens}]")
    if topk_idx.ndim != 2 or topk_idx.shape[0] != tokens or not 1 <= topk_idx.shape[1] <= cfg.top_k:
        raise ValueError(f"{what}: topk_idx must be [tokens={tokens}, k <= {cfg.top_k}], got {topk_idx.shape}")
    if topk_idx.dtype != jnp.int32:
        raise TypeError(f"{what}: topk_idx must be int32, got {topk_idx.dtype}")
    if topk_weight.shape != topk_idx.shape:
        raise ValueError(f"{what}: topk_weight must have topk_idx's shape {topk_idx.shape}, got {topk_weight.shape}")
    if topk_weight.dtype != jnp.float32:
        raise TypeError(f"{what}: topk_weight must be float32, got {topk_weight.dtype}")
    if capacity is None:
        capacity = cfg.capacity(tokens, topk_idx.shape[1])
    if not isinstance(capacity, (int, np.integer)) or not 1 <= capacity < 2**31:
        raise ValueError(f"{what}: capacity must be an int in [1, 2^31), got {capacity!r}")
    return int(capacity)


def check_combine_args(ws: Workspace, expert_out, layout: DispatchLayout) -> None:
    cfg = ws.config
    what = "mok_jax.ops.combine"
    if not isinstance(layout, DispatchLayout):
        raise TypeError(f"{what}: layout must be the DispatchLayout that dispatch returned, got {type(layout)}")
    if expert_out.ndim != 2 or expert_out.shape[1] != cfg.hidden_size:
        raise ValueError(f"{what}: expert_out must be [capacity, hidden_size={cfg.hidden_size}], got {expert_out.shape}")
    if expert_out.dtype != jnp.bfloat16:
        raise TypeError(f"{what}: expert_out must be bfloat16, got {expert_out.dtype}")
    tokens, k = layout.topk_idx.shape
    if layout.row_table.shape != (cfg.ep, tokens, k) or layout.row_weight.shape != (cfg.ep, tokens, k):
        raise ValueError(f"{what}: layout.row_table/row_weight must be [ep={cfg.ep}, {tokens}, {k}], "
                         f"got {layout.row_table.shape} / {layout.row_weight.shape}")


def _attrs(ws: Workspace, mode: int, num_sms: int, zero_padding: bool, token_major: bool = False) -> dict:
    return dict(ws_id=np.int64(ws.id), mode=np.int32(mode), num_sms=np.int32(num_sms),
                zero_padding=np.int32(bool(zero_padding)), token_major=np.int32(bool(token_major)))


def dispatch(ws: Workspace, x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, *,
             mode: str | None = None, num_sms: int | None = None, capacity: int | None = None,
             zero_padding: bool = True, token_major: bool = False) -> tuple[jax.Array, DispatchLayout]:
    """Per rank: x: bf16[T, H], topk_idx: int32[T, k] (global expert ids; ids outside [0, E) go
    nowhere), topk_weight: f32[T, k] -> (recv_x: bf16[capacity, H], layout).

    capacity defaults to the dropless worst case ep*T*min(k, E_local); mode 'pull' (owners read the
    sources' posted rows) or 'push' (sources write into the owners' dispatch_rows); num_sms is the
    number of communication blocks (one per SM). mode and num_sms default to the workspace's KernelConfig
    (``kernel.dispatch``, ``kernel.comm_items_fwd``). token_major: recv_x is bf16[ep * T, H] instead, one
    row per (source rank, token) (zeros for tokens with no local expert when zero_padding)."""
    ws.require_open("mok_jax.ops.dispatch")
    cap = check_dispatch_args(ws, x, topk_idx, topk_weight, capacity)
    m = _mode(mode, ws.config.dispatch_mode, "mok_jax.ops.dispatch")
    sms = _num_sms(num_sms, ws.config.num_sms, "mok_jax.ops.dispatch")
    require_native("mok_jax.ops.dispatch")
    cfg = ws.config
    tokens, k = topk_idx.shape
    recv_rows = cfg.ep * tokens if token_major else cap
    out = (
        jax.ShapeDtypeStruct((recv_rows, cfg.hidden_size), jnp.bfloat16),
        jax.ShapeDtypeStruct((cfg.num_local_experts,), jnp.int32),
        jax.ShapeDtypeStruct((cfg.ep, tokens, k), jnp.int32),
        jax.ShapeDtypeStruct((cfg.ep, tokens, k), jnp.float32),
        jax.ShapeDtypeStruct((cap,), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    recv_x, group_sizes, row_table, row_weight, row_source, status = jax.ffi.ffi_call(
        "mok_comm_dispatch", out, has_side_effect=True, vmap_method=_VMAP_METHOD)(
            x, topk_idx, topk_weight, **_attrs(ws, m, sms, zero_padding, token_major))
    return recv_x, DispatchLayout(group_sizes, row_table, row_weight, row_source, topk_idx, status)


def combine(ws: Workspace, expert_out: jax.Array, layout: DispatchLayout, *, mode: str | None = None,
            num_sms: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Per rank: expert_out: bf16[capacity, H] (rows in dispatch's order), layout from dispatch ->
    (y: bf16[T, H], status: int32[4]). mode ('push': owners write their partials into the origins; 'pull':
    origins read them) and num_sms default to the workspace's KernelConfig (``kernel.combine``,
    ``kernel.comm_items_fwd``)."""
    ws.require_open("mok_jax.ops.combine")
    check_combine_args(ws, expert_out, layout)
    m = _mode(mode, ws.config.combine_mode, "mok_jax.ops.combine")
    sms = _num_sms(num_sms, ws.config.num_sms, "mok_jax.ops.combine")
    require_native("mok_jax.ops.combine")
    tokens = layout.topk_idx.shape[0]
    out = (jax.ShapeDtypeStruct((tokens, ws.config.hidden_size), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32))
    y, status = jax.ffi.ffi_call("mok_comm_combine", out, has_side_effect=True, vmap_method=_VMAP_METHOD)(
        expert_out, layout.row_table, layout.row_weight, layout.topk_idx, **_attrs(ws, m, sms, False))
    return y, status
