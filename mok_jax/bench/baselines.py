"""JAX-native expert-parallel MoE layers: what a JAX user would write instead of mok.

Each builder takes a mesh with an expert-parallel axis (default ``"ep"``) and returns a jitted

    fn(x, topk_idx, topk_weight, weights) -> (y, stats)

on global arrays: x: [T_total, H] (bf16 or f32) sharded over ep; topk_idx: int32[T_total, k] (global
expert ids, k distinct per token); topk_weight: f32[T_total, k]; weights: mok_jax.MoEWeights with
gate_up [E, H, 2I] and down [E, I, H] sharded over ep on dim 0 (rank r owns experts
[r*E/ep, (r+1)*E/ep)) and the shared pair replicated. y: [T_total, H] in x.dtype, sharded like x;
stats: a dict of int32 scalars (``dropped_slots`` for the capacity baseline). Differentiable
w.r.t. x, topk_weight and weights.

Precision: the strongest form a user writes, as a bf16 training stack runs it. Each GEMM takes the input dtype
and yields it (the einsum's and ragged_dot's default: f32 accumulation inside the GEMM, as cuBLAS does, one
rounding of the output), so with bf16 inputs the forward's g | u and expert outputs are bf16 and so are the
backward's cotangents; the SwiGLU runs in f32 from the bf16 g, u and its h is rounded to bf16; the shared
expert is ``mok_jax.bench.dense.dense_ffn`` (the same math). The weighted sum over a token's k slots runs in
f32 in slot order, the shared expert's output added to it, before the final rounding to x.dtype.
(Until issue 33 these baselines asked their einsums for f32 outputs, which made every cotangent of the backward
f32: 21.9 ms fwd+bwd on kimi-k2 where the bf16 form of the same layer takes about 10.75 ms. That form is not kept:
its numbers are in git history and in the README's older tables.)

- ``xla`` (dropless): dispatch to per-(destination rank, local expert) slots of capacity T (tokens per
  rank): a token picks an expert at most once, so slot [e, t] can be token t's own and nothing is
  ever dropped; ``all_to_all``; a batched einsum over the local experts; ``all_to_all`` back; gather
  each token's k rows and combine. The price of static shapes: the experts run E_total*T rows per
  GPU where T*k are useful (1.5x for kimi-k2 in ep64-slice on 2 GPUs; E/k in general).
- ``xla-capacity``: slots per (source rank, expert) = ceil(cf * T*k / E_total); a token's slot keeps
  its place in token order and slots past capacity are dropped (counted in ``dropped_slots``).
- ``ragged``: slots sorted by expert; at EP > 1 ``ragged_all_to_all`` straight into expert-major order on the
  receiver, at EP 1 a gather (no collective); then ``jax.lax.ragged_dot``: dropless with no padding in the math,
  the API JAX offers for this. XLA:CPU cannot run ragged-all-to-all; ``emulate_collective=True`` swaps in an
  all_gather-based equivalent (for CPU tests of the offset logic only).
- ``tokamax``: the same layout with ``tokamax.ragged_dot`` (the registry's ``tokamax``, the extra
  ``mok_jax[tokamax]``) for both grouped GEMMs and their backward, on its Pallas Mosaic GPU kernel
  (``implementation="mosaic"``, no fallback: a row times that kernel or says why it failed), each expert's rows
  padded to a multiple of ``TOKAMAX_ROW_ALIGN`` with zero rows. The grouped GEMM a JAX user would pick today.
- ``reference``: ``mok_jax.expert_parallel_moe`` with implementation="xla" (dense; small shapes only).
- ``mok``: the same with implementation="mok" and ``kernel`` (a KernelConfig, or None: mok_jax.tuning picks) and
  every other MoEConfig field its default (keep="balanced": the forward keeps the g, u of the rows a balanced
  routing fills, every slot at EP 1); differentiable at every EP size.
- ``mok-recompute``: ``mok`` with MoEConfig(keep="nothing"): the backward recomputes the gate/up GEMM.
- ``mok-keep``: ``mok`` with MoEConfig(keep="everything"): the forward keeps every slot's g, u (bf16) for the
  backward, which then skips its gate/up recompute (the same outputs and gradients; fwd+bwd is where it differs;
  at EP 1 the same as ``mok``).
- ``mok-ring``: ``mok`` with MoEConfig(keep="ring"): only the g, u of the tokens still in the forward's ring (the
  last ring_slots microbatches) are kept, the rest recomputed; the same as ``mok-keep`` when every token fits.
- ``mok-fp8``: ``mok`` with MoEConfig(precision="fp8"): the forward's routed experts in E4M3 with DeepSeek-V3 block
  scales (x, the shared expert, the combine and y stay bf16; the backward is bf16, recomputing). Its fn also
  takes ``fp8_weights=`` (``quantize_weights``: the E4M3 weights made once, as a user does per optimizer step);
  without it every call quantises the weights itself. H and I must be multiples of 128.

Every phase runs under a ``jax.named_scope`` (``<impl>/dispatch``, ``/experts``, ``/combine``,
``/shared``) so profiler traces read by name.
"""

from __future__ import annotations

import functools
import math
import importlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mok_jax.bench.accounting import capacity as _capacity
from mok_jax.bench.dense import dense_ffn
from mok_jax.config import KernelConfig, MoEConfig
from mok_jax.fp8 import Fp8ExpertWeights, quantize_expert_weights
from mok_jax.sharding import place
from mok_jax.weights import MoEWeights

__all__ = ["BASELINES", "IMPLEMENTATIONS", "MOK_IMPLEMENTATIONS", "TOKAMAX_BUFFER_ALIGN", "TOKAMAX_IMPLEMENTATION",
           "TOKAMAX_ROW_ALIGN", "MokVariant", "build", "mok", "quantize_weights", "ragged", "reference", "tokamax",
           "xla_capacity", "xla_dropless"]

_F32 = jnp.float32
# tokamax's kernel: its Pallas Mosaic GPU ragged_dot (the sm90 kernel on an H200), asked for by name so that it
# never falls back to XLA's ragged_dot (which densifies: HARDWARE.md)
TOKAMAX_IMPLEMENTATION = "mosaic"
# Each expert's rows padded to a multiple of 8 for tokamax: its Mosaic GPU kernel aligns group starts to 8 rows,
# and HARDWARE.md records it failing ("rows not a multiple of 8") on kimi-k2's groups of about 2731 rows. The zero
# rows add at most 7 rows per local expert.
TOKAMAX_ROW_ALIGN = 8
# ... and the whole row buffer to a multiple of 64: its backward's kernel tiles the rows by 64 (on the H200:
# "dimension 1 must have size smaller or a multiple of its tiling 64, but got 16472" for kimi-k2's fwd+bwd).
TOKAMAX_BUFFER_ALIGN = 64
MoEFn = Callable[..., tuple[jax.Array, dict]]


# ----------------------------------------------------------------------------- shared pieces


def _swiglu(gu: jax.Array, dtype) -> jax.Array:
    """h = silu(g) u in f32 from a GEMM's g | u (in the GEMM's output dtype: bf16 for bf16 inputs), rounded to
    ``dtype``: gu [..., 2I] -> [..., I]."""
    gate, up = jnp.split(gu, 2, axis=-1)
    return (jax.nn.silu(gate.astype(_F32)) * up.astype(_F32)).astype(dtype)


def _experts(recv: jax.Array, weights: MoEWeights) -> jax.Array:
    """Local SwiGLU experts over slot-major rows: recv [S, E_local, C, H] -> [S, E_local, C, H] in recv.dtype."""
    S, E_local, C, H = recv.shape
    with jax.named_scope("experts"):
        rows = recv.transpose(1, 0, 2, 3).reshape(E_local, S * C, H)  # expert-major: one GEMM batch per expert
        h = _swiglu(jnp.einsum("erh,ehn->ern", rows, weights.gate_up), recv.dtype)
        out = jnp.einsum("eri,eih->erh", h, weights.down)
        return out.reshape(E_local, S, C, H).transpose(1, 0, 2, 3)


def _combine_rows(rows: jax.Array, topk_weight: jax.Array) -> jax.Array:
    """sum_j topk_weight[t, j] * rows[t, j] in fp32, slot order j = 0..k-1: rows [T, k, H] -> f32[T, H]."""
    acc = jnp.zeros((rows.shape[0], rows.shape[2]), _F32)
    for j in range(rows.shape[1]):
        acc = acc + topk_weight[:, j, None].astype(_F32) * rows[:, j].astype(_F32)
    return acc


def _finish(y_routed: jax.Array, x: jax.Array, weights: MoEWeights) -> jax.Array:
    """The routed f32 sum plus the shared expert (the dense FFN's math, in x.dtype), rounded to x.dtype."""
    if weights.shared_gate_up is not None:
        with jax.named_scope("shared"):
            y_routed = y_routed + dense_ffn(x, weights.shared_gate_up, weights.shared_down).astype(_F32)
    return y_routed.astype(x.dtype)


def _ep_callable(body: Callable, mesh: Mesh, axis: str, name: str, stat_names: tuple[str, ...] = (),
                 check_vma: bool = True) -> MoEFn:
    """jit(shard_map(body)) over ``axis``; body(x, topk_idx, topk_weight, weights) -> (y, stats) per rank.
    ``check_vma``: shard_map's tracking of the axes each value varies over (off for a body whose custom VJPs do
    not carry it)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {mesh.axis_names}")
    others = [a for a in mesh.axis_names if a != axis and mesh.shape[a] != 1]
    if others:
        raise ValueError(f"the baselines run on a mesh with only the {axis!r} axis; got axes {dict(mesh.shape)}")
    ep = mesh.shape[axis]

    def fn(x, topk_idx, topk_weight, weights: MoEWeights):
        if not isinstance(weights, MoEWeights):
            raise TypeError(f"weights must be a mok_jax.MoEWeights, got {type(weights).__name__}")
        if weights.gate_up.shape[0] % ep:
            raise ValueError(f"the number of experts ({weights.gate_up.shape[0]}) must be divisible by the "
                             f"{axis!r} axis size ({ep})")
        if x.ndim != 2 or x.shape[0] % ep:
            raise ValueError(f"x must be [tokens, hidden] with tokens divisible by {ep}, got {x.shape}")
        tok = P(axis)
        shared = P() if weights.shared_gate_up is not None else None
        wspec = MoEWeights(P(axis), P(axis), shared, shared)
        specs = (tok, tok, tok, wspec)
        args = (x, topk_idx, topk_weight.astype(_F32), weights)
        args = jax.tree.map(lambda a, s: place(a, NamedSharding(mesh, s)), args, specs)
        with jax.named_scope(name):
            return jax.shard_map(functools.partial(body, axis=axis), mesh=mesh, in_specs=specs,
                                 out_specs=(tok, {s: P() for s in stat_names}), check_vma=check_vma)(*args)

    fn.__name__ = fn.__qualname__ = name.replace("-", "_") + "_moe"
    return jax.jit(fn)


# ----------------------------------------------------------------------------- xla (dropless)


def _dropless_body(x, topk_idx, topk_weight, weights: MoEWeights, *, axis: str):
    ep, num_local = lax.axis_size(axis), weights.num_local_experts
    num_experts = ep * num_local
    T, H = x.shape
    with jax.named_scope("dispatch"):
        picked = jnp.any(topk_idx[:, :, None] == jnp.arange(num_experts, dtype=topk_idx.dtype), axis=1)  # [T, E]
        send = jnp.where(picked.T[:, :, None], x[None], jnp.zeros((), x.dtype))  # slot [e, t] = x_t or 0
        recv = lax.all_to_all(send.reshape(ep, num_local, T, H), axis, 0, 0, tiled=True)  # [src, E_local, T, H]
    out = _experts(recv, weights)
    with jax.named_scope("combine"):
        back = lax.all_to_all(out, axis, 0, 0, tiled=True).reshape(num_experts, T, H)  # [global expert, T, H]
        rows = back[topk_idx, jnp.arange(T)[:, None]]  # [T, k, H]
        y = _combine_rows(rows, topk_weight)
    return _finish(y, x, weights), {}


def xla_dropless(mesh: Mesh, *, axis: str = "ep") -> MoEFn:
    """Dropless shard_map + all_to_all + batched einsum (capacity T per (rank, expert) slot)."""
    return _ep_callable(_dropless_body, mesh, axis, "xla")


# ----------------------------------------------------------------------------- xla-capacity


def _slot_positions(flat_e: jax.Array, num_experts: int) -> jax.Array:
    """Position of each (token, slot) among the slots choosing the same expert, in token order."""
    n = flat_e.shape[0]
    order = jnp.argsort(flat_e, stable=True)
    counts = jnp.bincount(flat_e, length=num_experts)
    starts = jnp.cumsum(counts) - counts
    rank_in_sorted = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)
    return rank_in_sorted - starts[flat_e]


def _capacity_body(x, topk_idx, topk_weight, weights: MoEWeights, *, axis: str, capacity_factor: float):
    ep, num_local = lax.axis_size(axis), weights.num_local_experts
    num_experts = ep * num_local
    T, H = x.shape
    k = topk_idx.shape[1]
    cap = _capacity(T, k, num_experts, capacity_factor)
    with jax.named_scope("dispatch"):
        flat_e = topk_idx.reshape(-1)
        pos = _slot_positions(flat_e, num_experts)
        kept = pos < cap
        slot = jnp.where(kept, flat_e * cap + pos, num_experts * cap)  # past the end: dropped
        token_of_slot = jnp.full(num_experts * cap, T, jnp.int32).at[slot].set(
            jnp.arange(T * k, dtype=jnp.int32) // k, mode="drop", unique_indices=True)
        x_pad = jnp.concatenate([x, jnp.zeros((1, H), x.dtype)])  # row T: the empty slot
        send = x_pad[token_of_slot].reshape(ep, num_local, cap, H)
        recv = lax.all_to_all(send, axis, 0, 0, tiled=True)  # [src, E_local, cap, H]
    out = _experts(recv, weights)
    with jax.named_scope("combine"):
        back = lax.all_to_all(out, axis, 0, 0, tiled=True).reshape(num_experts * cap, H)
        back = jnp.concatenate([back, jnp.zeros((1, H), back.dtype)])  # a dropped slot reads zeros
        rows = back[slot].reshape(T, k, H)
        y = _combine_rows(rows, topk_weight)
    dropped = lax.psum(jnp.sum(~kept, dtype=jnp.int32), axis)
    return _finish(y, x, weights), {"dropped_slots": dropped}


def xla_capacity(mesh: Mesh, *, capacity_factor: float = 1.25, axis: str = "ep") -> MoEFn:
    """Capacity-padded shard_map + all_to_all + batched einsum; stats["dropped_slots"] counts (token, slot)
    pairs over capacity, summed over ranks."""
    _capacity(1, 1, 1, capacity_factor)  # validates
    body = functools.partial(_capacity_body, capacity_factor=capacity_factor)
    return _ep_callable(body, mesh, axis, "xla-capacity", ("dropped_slots",))


# ----------------------------------------------------------------------------- ragged


def _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
    """lax.ragged_all_to_all's result built from all_gathers (XLA:CPU has no ragged-all-to-all). Tests only."""
    del recv_sizes  # implied by the senders' sizes
    ep, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    per_dest = input_offsets.shape[0] // ep
    gather = functools.partial(lax.all_gather, axis_name=axis_name)
    ops, ioff, size, ooff = gather(operand), gather(input_offsets), gather(send_sizes), gather(output_offsets)
    mine = lambda a: lax.dynamic_slice_in_dim(a, me * per_dest, per_dest, axis=1)  # slices sent to me: [src, n]
    ioff, size, ooff = mine(ioff), mine(size), mine(ooff)
    m = jnp.arange(output.shape[0])[:, None, None]
    inside = ((m >= ooff) & (m < ooff + size)).reshape(output.shape[0], -1)  # [M, src*n]
    which = jnp.argmax(inside, axis=1)
    src, i = which // per_dest, which % per_dest
    row = jnp.clip(ioff[src, i] + m[:, 0, 0] - ooff[src, i], 0, operand.shape[0] - 1)
    got = ops[src, row]
    return jnp.where(jnp.any(inside, axis=1)[:, None], got, output)


def _round_up(n: jax.Array, multiple: int) -> jax.Array:
    return (n + multiple - 1) // multiple * multiple


def _local_rows(flat_e: jax.Array, order: jax.Array, counts: jax.Array, row_align: int) -> tuple[jax.Array, jax.Array]:
    """EP 1 (no collective): the expert-major row of each (token, slot) in slot order, with each expert's rows
    padded to a multiple of ``row_align``, and the padded group sizes: (int32[T*k], int32[E])."""
    padded = _round_up(counts, row_align)
    start = jnp.cumsum(padded) - padded
    first = jnp.cumsum(counts) - counts  # an expert's first slot in sorted order
    expert_of_sorted = flat_e[order]
    row_of_sorted = start[expert_of_sorted] + jnp.arange(flat_e.shape[0], dtype=jnp.int32) - first[expert_of_sorted]
    row_of_slot = jnp.zeros_like(row_of_sorted).at[order].set(row_of_sorted, unique_indices=True)
    return row_of_slot, padded


def _ragged_body(x, topk_idx, topk_weight, weights: MoEWeights, *, axis: str, dot: Callable, row_align: int,
                 emulate_collective: bool, buffer_align: int = 1):
    """Slots sorted by (rank, local expert), each expert's rows padded to a multiple of ``row_align`` (zero rows),
    the row buffer to a multiple of ``buffer_align`` too, ``dot(rows, w, group_sizes)`` (a ragged_dot) for gate_up
    and down. At EP 1 a gather lays out the rows and
    another brings them back (no collective); at EP > 1 ragged_all_to_all does."""
    ep, me, num_local = lax.axis_size(axis), lax.axis_index(axis), weights.num_local_experts
    num_experts = ep * num_local
    T, H = x.shape
    k = topk_idx.shape[1]
    pad_rows = num_local * (row_align - 1)  # the most zero rows that padding the local experts' groups adds
    align = math.lcm(row_align, buffer_align)  # the row buffer's size: a multiple of both (tokamax's kernels)
    rows_of = lambda n: -(-n // align) * align  # noqa: E731
    with jax.named_scope("dispatch"):
        flat_e = topk_idx.reshape(-1)
        order = jnp.argsort(flat_e, stable=True)  # slots grouped by (dest rank, local expert)
        counts = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)  # slice i = (dest, local expert)
        if ep == 1:
            row_of_slot, group_sizes = _local_rows(flat_e, order, counts, row_align)
            token_of_row = jnp.full(rows_of(T * k + pad_rows), T, jnp.int32).at[row_of_slot].set(
                jnp.arange(T * k, dtype=jnp.int32) // k, unique_indices=True)
            recv = jnp.concatenate([x, jnp.zeros((1, H), x.dtype)])[token_of_row]  # row T: a padding row
        else:
            a2a = functools.partial(_ragged_all_to_all_emulated if emulate_collective else lax.ragged_all_to_all,
                                    axis_name=axis)
            # a source sends a token at most min(k, E_local) times
            worst_rows = rows_of(ep * T * min(k, num_local) + pad_rows)
            xs = x[order // k]  # [T*k, H]
            in_off = jnp.cumsum(counts) - counts
            all_counts = lax.all_gather(counts, axis).reshape(ep, ep, num_local)  # [src, dest, local expert]
            per_expert = all_counts.sum(axis=0)  # rows each (dest, local expert) receives: [dest, E_local]
            padded = _round_up(per_expert, row_align)
            expert_start = jnp.cumsum(padded, axis=1) - padded
            before = jnp.cumsum(all_counts, axis=0) - all_counts  # rows of earlier sources
            out_off_all = (expert_start[None] + before).astype(jnp.int32)  # receiver offset: expert-major, then source
            recv_sizes = all_counts[:, me, :].reshape(-1)  # slice i = (src, local expert)
            recv = a2a(xs, jnp.zeros((worst_rows, H), x.dtype), in_off, counts, out_off_all[me].reshape(-1),
                       recv_sizes)
            group_sizes = padded[me]
    with jax.named_scope("experts"):
        h = _swiglu(dot(recv, weights.gate_up, group_sizes), x.dtype)
        out = dot(h, weights.down, group_sizes)
    with jax.named_scope("combine"):
        if ep == 1:
            rows = out[row_of_slot].reshape(T, k, H)
        else:
            src_in_off = lax.all_gather(in_off, axis).reshape(ep, ep, num_local)[:, me, :].reshape(-1)
            back = a2a(out, jnp.zeros((T * k, H), x.dtype), out_off_all[:, me, :].reshape(-1), recv_sizes,
                       src_in_off, counts)  # [T*k, H] in sorted slot order
            rows = jnp.zeros_like(back).at[order].set(back, unique_indices=True).reshape(T, k, H)
        y = _combine_rows(rows, topk_weight)
    return _finish(y, x, weights), {}


def ragged(mesh: Mesh, *, axis: str = "ep", row_align: int = 1, emulate_collective: bool = False) -> MoEFn:
    """ragged_all_to_all (a gather at EP 1) + lax.ragged_dot, dropless. ``row_align``: each expert's rows padded to
    a multiple of it with zero rows (tokamax's layout, TOKAMAX_ROW_ALIGN; 1: none). ``emulate_collective``: for
    CPU tests only."""
    if isinstance(row_align, bool) or not isinstance(row_align, int) or row_align < 1:
        raise ValueError(f"row_align must be a positive int, got {row_align!r}")
    body = functools.partial(_ragged_body, dot=lax.ragged_dot, row_align=row_align,
                             emulate_collective=emulate_collective)
    return _ep_callable(body, mesh, axis, "ragged")


# ----------------------------------------------------------------------------- tokamax


def _import_tokamax():
    """The tokamax module, imported by name: it is an optional extra (``pip install mok_jax[tokamax]``, Python >=
    3.12), so mok_jax imports, and its dependency check (tests/test_readme.py) passes, without it. ImportError
    with the way to install it otherwise."""
    try:
        return importlib.import_module("tokamax")
    except ImportError as e:
        raise ImportError(f"tokamax is not installed ({e}); pip install 'mok_jax[tokamax]' (Python >= 3.12)") from None


def tokamax(mesh: Mesh, *, axis: str = "ep", implementation: str | Callable = TOKAMAX_IMPLEMENTATION,
            emulate_collective: bool = False) -> MoEFn:
    """The ``ragged`` layout with tokamax.ragged_dot(implementation=...) for the grouped GEMMs (their backward
    tokamax's own, on the same kernel), each expert's rows padded to a multiple of TOKAMAX_ROW_ALIGN. On CPU
    tests pass ``implementation="xla"`` (tokamax's XLA path: the Mosaic GPU kernel needs an NVIDIA GPU) or a
    callable. Raises ImportError (saying how to install it) when tokamax is not installed."""
    tk = _import_tokamax()
    dot = functools.partial(tk.ragged_dot, implementation=implementation)
    body = functools.partial(_ragged_body, dot=dot, row_align=TOKAMAX_ROW_ALIGN, buffer_align=TOKAMAX_BUFFER_ALIGN,
                             emulate_collective=emulate_collective)
    # tokamax's Mosaic GPU ragged_dot has a custom VJP whose weight cotangent does not carry shard_map's varying
    # axes (on the H200: "the bwd rule produced an output of type bfloat16[16,768,2048] corresponding to an input"
    # of another type), so its shard_map does not track them
    return _ep_callable(body, mesh, axis, "tokamax", check_vma=False)


# ----------------------------------------------------------------------------- the library's own paths


class MokVariant(NamedTuple):
    """The MoEConfig fields a mok implementation sets besides implementation="mok" and the kernel (keep None: the
    MoEConfig default)."""

    keep: str | None = None
    precision: str = "bf16"


def _library(mesh: Mesh, axis: str, implementation: str, kernel: KernelConfig | None = None,
             variant: MokVariant = MokVariant()) -> MoEFn:
    from mok_jax import sharding

    config = MoEConfig(implementation=implementation, ep_axis=axis, kernel=kernel, **variant._asdict())
    name = "reference" if implementation == "xla" else "mok" + ("-fp8" if variant.precision == "fp8" else "")

    def fn(x, topk_idx, topk_weight, weights, fp8_weights: Fp8ExpertWeights | None = None):
        with jax.named_scope(name):
            return sharding.expert_parallel_moe(x, topk_idx, topk_weight, weights, mesh=mesh, config=config,
                                                fp8_weights=fp8_weights), {}

    fn.__name__ = fn.__qualname__ = name.replace("-", "_") + "_moe"
    return jax.jit(fn)


def reference(mesh: Mesh, *, axis: str = "ep") -> MoEFn:
    """mok_jax.expert_parallel_moe(implementation="xla"): the dense reference (small shapes only)."""
    return _library(mesh, axis, "xla")


def mok(mesh: Mesh, *, axis: str = "ep", kernel: KernelConfig | None = None, keep: str = "nothing",
        precision: str = "bf16") -> MoEFn:
    """mok_jax.expert_parallel_moe(implementation="mok", kernel=kernel, keep=keep, precision=precision): the
    megakernel (kernel None: the tuned table or the heuristic, mok_jax.tuning). Its fn takes fp8_weights= too
    (precision "fp8": ``quantize_weights``; None quantises inside every call)."""
    if kernel is not None and not isinstance(kernel, KernelConfig):
        raise TypeError(f"kernel must be a mok_jax.KernelConfig or None, got {type(kernel).__name__}")
    return _library(mesh, axis, "mok", kernel, MokVariant(keep=keep, precision=precision))


def quantize_weights(weights: MoEWeights, mesh: Mesh, *, axis: str = "ep") -> Fp8ExpertWeights:
    """The E4M3 form of the routed weights (mok_jax.fp8.quantize_expert_weights), each rank quantising its own
    experts, sharded over ``axis`` like gate_up: the fp8_weights of mok-fp8's forward, made once per optimizer
    step by a user. H and I must be multiples of 128."""
    spec = P(axis)
    quantize = jax.shard_map(quantize_expert_weights, mesh=mesh, in_specs=(spec, spec),
                             out_specs=Fp8ExpertWeights(*[spec] * 4))
    laid_out = lambda gate_up, down: quantize(*(place(a, NamedSharding(mesh, spec)) for a in (gate_up, down)))
    return jax.jit(laid_out)(weights.gate_up, weights.down)


BASELINES: dict[str, Callable[..., MoEFn]] = {
    "xla": xla_dropless, "xla-capacity": xla_capacity, "ragged": ragged, "tokamax": tokamax, "reference": reference,
}
MOK_IMPLEMENTATIONS = {"mok": MokVariant(), "mok-recompute": MokVariant(keep="nothing"),
                       "mok-ring": MokVariant(keep="ring"), "mok-keep": MokVariant(keep="everything"),
                       "mok-fp8": MokVariant(precision="fp8")}
IMPLEMENTATIONS = (*BASELINES, *MOK_IMPLEMENTATIONS)


def build(name: str, mesh: Mesh, *, axis: str = "ep", capacity_factor: float = 1.25,
          kernel: KernelConfig | None = None) -> MoEFn:
    """The jitted callable of implementation ``name`` (one of IMPLEMENTATIONS); ``kernel`` is mok's (the
    others have no kernel knobs and ignore it)."""
    if name in MOK_IMPLEMENTATIONS:
        return mok(mesh, axis=axis, kernel=kernel, **MOK_IMPLEMENTATIONS[name]._asdict())
    if name not in BASELINES:
        raise ValueError(f"unknown implementation {name!r}; choose from {', '.join(IMPLEMENTATIONS)}")
    if name == "xla-capacity":
        return xla_capacity(mesh, capacity_factor=capacity_factor, axis=axis)
    return BASELINES[name](mesh, axis=axis)
