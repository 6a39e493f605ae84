"""Device memory of one layer of implementation="mok" per EP rank, term by term (docs/memory.md has the tables).

``layer_memory_per_rank`` gives the bytes of every buffer the layer's forward and backward allocate per rank, each
from the code that sizes it, in these groups (a term is named ``group.buffer``):

- ``workspace``: the symmetric region (ffi/include/mok/comm/workspace.cuh, make_layout;
  ``mok_jax.workspace.CommConfig.workspace_bytes``) of a layer sized for the call (max_tokens = T, top_k = k,
  E = ep L); it lives as long as the layer.
- ``forward``: the forward's per-call scratch (ffi/src/moe_forward.cu, forward_scratch_layout; the sync words of
  mok/moe/plan.cuh, make_plan; ``mok_jax.ops.moe_forward.scratch_bytes``).
- ``backward``: the scratch results of the experts' backward op over its M = ep T k + 128 L rows
  (``mok_jax.ops.moe_backward._row_scratch``: ``experts_backward`` at EP 1, ``experts_backward_ep`` above), dropped
  by its wrapper; the g, u scratch costs nothing where XLA aliases it to the kept buffer.
- ``layout``: the int32 layout and f32 router weights that the layer hands that op (XLA arrays: kept from the
  forward or made in the backward).
- ``kept``: the forward's bf16 g | u kept for the backward (``mok_jax.layer.kept_rows`` rows of 2I), per layer.
- ``gradients``: what the op returns (dx, d topk_weight, the local experts' weight gradients): the same at every
  EP size, listed but not part of the goal's total (``TOTAL_GROUPS``).

Not counted: XLA's own temporaries around the op (the shared expert's backward, which runs in XLA; dy with the
invalid tokens zeroed; the sorts that build the layout; the all-gathers' buffers), the workspace's peer table
(8 ep bytes) and its two host-mapped words. The routed experts in bf16 only (``precision="bf16"``).
"""

from __future__ import annotations

from mok_jax.backward_types import EXPERTS_BACKWARD_GROUP_ALIGN
from mok_jax.config import KEEP, KernelConfig

__all__ = ["GROUPS", "TOTAL_GROUPS", "group_totals", "kept_rows", "layer_memory_per_rank", "markdown_tables"]

GROUPS = ("workspace", "forward", "backward", "layout", "kept", "gradients")
TOTAL_GROUPS = GROUPS[:-1]  # the workspace, scratch and kept bytes: every group but the gradients

_ALIGN = 256  # kRegionAlign (workspace.cuh) and align256 (moe_forward.cu): every region and scratch part
_LOCAL_STATE = 64  # sizeof(LocalState), workspace.cuh
_MIN_GRANULARITY = 512  # kMinGranularity: the workspace's per-microbatch stamps assume the smallest microbatch
_CHUNK = 64  # kChunkTokens: tokens of a schedule chunk
_MOE_STAMP_ROWS = 4  # kMoeStampRows: moe_stamps rows before the per-microbatch ones
_BWD_STAMP_ROWS = 3  # kBwdStampRows
_TILE_M = 128  # kTileM (plan.cuh): rows of an m-block
_SYNC_BLOCK = 64  # make_plan's take(): sync blocks are whole 256-byte blocks of int32 words
_CTL_WORDS = 16  # kCtlWords: the sync region's control block
_MAX_VIRTUAL_RANKS = 8  # kMaxVirtualRanks (forward.cuh): above it, the scratch holds the rank's kernel parameters
_RANK_PARAMS = 2432  # sizeof(RankParams) (forward_params.cuh): one rank's pointers and TMA descriptors
_ITEM_TIME_WORDS = 2 * 5 * 12  # kItemTimeWords (plan.cuh): the forward's lab item times, five u64 per kind
_BWD_TIME_WORDS = 6 * 10  # kExpertsBackwardTimeWords: three u64 per kind of work item (ops.moe_backward.ITEM_KINDS)
_DW_PART_COLS = 256  # kExpertsBackwardColBlock: a dw partial per 256 intermediate columns


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _aligned(n: int) -> int:
    return _cdiv(n, _ALIGN) * _ALIGN


def _workspace(ep: int, T: int, H: int, k: int, L: int) -> dict[str, int]:
    own = 2 * T * H  # bf16 [T][H]
    terms = {
        "signals": 5 * _aligned(8 * ep),  # sig_route, sig_x, ack_disp, sig_comb, ack_comb: u64[ep] each
        "error_state": _aligned(8) + _aligned(_LOCAL_STATE),
        "moe_stamps": _aligned(8 * (_MOE_STAMP_ROWS + _cdiv(T, _MIN_GRANULARITY)) * ep),
        "chunks": 2 * _aligned(4 * ep * _cdiv(T, _CHUNK) * L),  # chunk_count, chunk_base: i32[ep][chunks][L]
        "routing": 2 * _aligned(4 * ep * _cdiv(T * k, 4) * 4),  # route_idx, route_w: [ep][T k rounded up to 4]
        "dispatch_rows": _aligned(ep * own),
        # [ep][T][H] partials (the comm ops), [T][k][H] slot rows (the layer; none cross at EP 1)
        "combine_rows": _aligned((ep if ep == 1 else max(ep, k)) * own),
    }
    fused = ep > 1  # the fused EP backward's buffers
    terms.update(bwd_stamps=_aligned(8 * _BWD_STAMP_ROWS * ep) if fused else 0,
                 bwd_x_dy=2 * _aligned(own) if fused else 0, bwd_dx=_aligned(own * k) if fused else 0,
                 bwd_dw=_aligned(4 * T * k) if fused else 0)
    return terms


def _max_segments(ep: int, microbatches: int) -> int:
    """Plan::max_segments: SEND (EP > 1) and REDUCE of each microbatch, DISPATCH of each but the first, GU and DN."""
    return (5 if ep > 1 else 4) * microbatches


def _forward(ep: int, T: int, H: int, I: int, Is: int, k: int, L: int, kernel: KernelConfig) -> dict[str, int]:
    g, mb, slots = kernel.microbatches(T)
    slot_rows = ep * min(g, T) * min(k, L)  # the dropless worst case of one microbatch
    words = lambda n: _cdiv(n, _SYNC_BLOCK) * _SYNC_BLOCK  # noqa: E731
    segments = _max_segments(ep, mb)
    mb_cap = _cdiv(slot_rows, _TILE_M) + L
    sync = (_CTL_WORDS + 4 * words(mb)  # disp, send, reduce, dn
            + words(_cdiv(T, _TILE_M)) + words(mb * mb_cap)  # sgu, gu
            + 2 * words(ep * _cdiv(T, _CHUNK) * L)  # cnt, base
            + 2 * words(ep * T * k)  # row, w: every slot of the EP group
            + 4 * words(mb * (L + 1))  # row_start, tile_gu, tile_dn, mblock
            + words(segments + 1) + 2 * words(segments)  # seg_begin, seg_kind, seg_mb
            + words(_ITEM_TIME_WORDS))  # item_times
    return {
        "recv": _aligned(slots * slot_rows * H * 2),
        "h": _aligned(slots * slot_rows * I * 2),
        "shared_h": _aligned(T * Is * 2),
        "shared_out": _aligned(T * H * 4) if Is else 0,
        "row_slot": _aligned(mb * slot_rows * 4),
        "sync": _aligned(sync * 4),
        # an emulated launch of more than 8 ranks reads each rank's parameters there (forward_kernel_many)
        "rank_params": _aligned(_RANK_PARAMS) if ep > _MAX_VIRTUAL_RANKS else 0,
    }


def kept_shared_gu_bytes(keep: str, *, tokens: int, shared_inter: int) -> int:
    """Bytes per rank and layer of the shared expert's kept g | u (KeptGateUp.shared_gu, bf16 [T, 2Is]): the forward
    keeps them with any keep but "nothing" (mok_jax.layer._moe_fwd), so that the backward does not recompute them;
    0 without a shared expert (shared_inter 0)."""
    return 0 if keep == "nothing" else tokens * 2 * shared_inter * 2


def kept_rows(keep: str, kernel, *, tokens: int, top_k: int, local_experts: int, ep: int = 1) -> int:
    """Rows of the bf16 [rows, 2I] buffer of g | u that implementation="mok"'s forward keeps per rank and layer with
    MoEConfig(keep=keep) and the resolved knobs ``kernel`` (a KernelConfig; "ring" reads granularity and ring_slots)
    for ``tokens`` per rank: 0 for "nothing"; M = ep T k + 128 L for "everything" (the dropless layout's bound), and
    for "ring" when every token fits in the ring; else ep (T - t0) k for the ring's tokens [t0, T); T k + 128 L
    for "balanced" (M at EP 1). The layer sizes its kept buffer with this (``mok_jax.layer.kept_rows``); when it is
    M, the backward takes the kept buffer as its own g, u scratch."""
    if keep == "nothing":
        return 0
    bound = ep * tokens * top_k + EXPERTS_BACKWARD_GROUP_ALIGN * local_experts
    if keep == "balanced":
        return min(bound, tokens * top_k + EXPERTS_BACKWARD_GROUP_ALIGN * local_experts)
    t0 = kernel.first_ring_token(tokens) if keep == "ring" else 0
    if t0:
        return ep * (tokens - t0) * top_k
    return bound


def layer_memory_per_rank(*, ep: int, tokens: int, hidden: int, inter: int, shared_inter: int, top_k: int,
                          local_experts: int, kernel: KernelConfig, keep: str = "balanced") -> dict[str, int]:
    """Bytes per EP rank of every buffer of one layer of implementation="mok" (bf16), by term ``group.buffer``
    (the module docstring lists the groups), for ``tokens`` T per rank, H, I, the shared expert's Is (0: none),
    k, L = E / ep experts per rank, the resolved knobs ``kernel`` (granularity and ring_slots size the forward's
    ring) and MoEConfig ``keep``. Pure arithmetic: no native library or device needed."""
    sizes = dict(ep=ep, tokens=tokens, hidden=hidden, inter=inter, shared_inter=shared_inter, top_k=top_k,
                 local_experts=local_experts)
    for name, v in sizes.items():
        least = 0 if name == "shared_inter" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"layer_memory_per_rank: {name} must be an int >= {least}, got {v!r}")
    if not isinstance(kernel, KernelConfig):
        raise TypeError(f"layer_memory_per_rank: kernel must be a mok_jax.KernelConfig, got {type(kernel).__name__}")
    if keep not in KEEP:
        raise ValueError(f"layer_memory_per_rank: keep must be one of {', '.join(map(repr, KEEP))}, got {keep!r}")
    T, H, I, Is, k, L = tokens, hidden, inter, shared_inter, top_k, local_experts
    m = ep * T * k + EXPERTS_BACKWARD_GROUP_ALIGN * L  # the backward layout's rows: every rank's slots could be here
    rows = kept_rows(keep, kernel, tokens=T, top_k=k, local_experts=L, ep=ep)
    aliased = rows == m  # the whole layout: the backward takes the kept buffer as its g, u
    part = rows > 0 and not aliased  # gu_part with its row map: the op recomputes what it lacks
    counter_words = _BWD_TIME_WORDS + 4 * (_cdiv(m, EXPERTS_BACKWARD_GROUP_ALIGN) + L) + 2 * (L + 1) + 5  # unrounded
    backward = {
        "x_e": m * H * 2, "dy_e": m * H * 2, "w_e": m * 4,
        "gu": 0 if aliased else m * 2 * I * 2,  # aliased: XLA hands the op the kept buffer
        "dgu": m * 2 * I * 2, "hw": m * I * 2, "dw_partials": m * _cdiv(I, _DW_PART_COLS) * 4,
        "dx_e": m * H * 2, "dw_e": m * 4,
        "counters": 4 * _cdiv(counter_words, 4) * 4,
    }
    layout = {
        "pos": T * k * 4 if ep == 1 else 0,  # the EP-1 op sums a token's slots through pos; the EP op takes none
        "src_slot": m * 4, "group_sizes": L * 4,
        "topk_weight": ep * T * k * 4 if ep > 1 else 0,  # every rank's router weights, all-gathered
        "gu_part_row": m * 4 if part else 0, "gu_block": _cdiv(m, EXPERTS_BACKWARD_GROUP_ALIGN) * 4 if part else 0,
    }
    gradients = {"dx": T * H * 4, "dw": T * k * 4, "d_gate_up": L * H * 2 * I * 2, "d_down": L * I * H * 2,
                 "status": 4}
    groups = {
        "workspace": _workspace(ep, T, H, k, L),
        "forward": _forward(ep, T, H, I, Is, k, L, kernel),
        "backward": backward,
        "layout": layout,
        "kept": {"gu": rows * 2 * I * 2, "shared_gu": kept_shared_gu_bytes(keep, tokens=T, shared_inter=Is)},
        "gradients": gradients,
    }
    return {f"{group}.{name}": n for group in GROUPS for name, n in groups[group].items()}


def group_totals(terms: dict[str, int]) -> dict[str, int]:
    """The bytes of each of GROUPS among ``terms`` (layer_memory_per_rank's), and "total": those of TOTAL_GROUPS."""
    out = {g: sum(n for name, n in terms.items() if name.split(".")[0] == g) for g in GROUPS}
    out["total"] = sum(out[g] for g in TOTAL_GROUPS)
    return out


def markdown_tables(*, eps, tokens: int, hidden: int, inter: int, shared_inter: int, top_k: int, local_experts: int,
                    keep: str = "balanced", reference_ep: int = 8) -> str:
    """docs/memory.md's two tables for EP sizes ``eps`` (``reference_ep`` among them), with the knobs of the heuristic
    (mok_jax.tuning.heuristic: no tuned entry at EP > 1): the totals per group in MB, the total against that at
    ``reference_ep``; then every term that is not 0 at ``reference_ep`` or at the largest EP size, in bytes, and how
    much it grows from one to the other."""
    from mok_jax import tuning

    def terms(ep):
        key = tuning.ProblemKey(hidden=hidden, intermediate=inter, top_k=top_k, experts_per_rank=local_experts, ep=ep,
                                tokens=tokens)
        return layer_memory_per_rank(ep=ep, tokens=tokens, hidden=hidden, inter=inter, shared_inter=shared_inter,
                                     top_k=top_k, local_experts=local_experts, kernel=tuning.heuristic(key), keep=keep)

    per_ep = {ep: terms(ep) for ep in eps}
    totals = {ep: group_totals(t) for ep, t in per_ep.items()}
    ref, top = reference_ep, max(eps)
    mb = lambda n: f"{n / 1e6:,.1f}"  # noqa: E731
    lines = [f"| EP | {' | '.join(TOTAL_GROUPS)} | total | total / EP {ref} | gradients |",
             "| --: " * (len(TOTAL_GROUPS) + 4) + "|"]
    for ep, t in totals.items():
        ratio = t["total"] / totals[ref]["total"]
        cells = [str(ep), *(mb(t[g]) for g in TOTAL_GROUPS), mb(t["total"]), f"{ratio:.2f}x", mb(t["gradients"])]
        lines.append(f"| {' | '.join(cells)} |")
    lines += ["", f"| term | EP {ref} | EP {top} | EP {top} / EP {ref} |", "| --- | --: | --: | --: |"]
    for name, n in per_ep[ref].items():
        m = per_ep[top][name]
        if n or m:
            lines.append(f"| `{name}` | {n:,} | {m:,} | {f'{m / n:.2f}x' if n else '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":  # the kimi-k2 tables of docs/memory.md: T = 2048, the ep64-slice's 6 experts per rank
    from mok_jax.config import load_model

    kimi = load_model("kimi-k2")
    print(markdown_tables(eps=(1, 2, 4, 8, 16, 32, 64), tokens=2048, hidden=kimi.hidden_size,
                          inter=kimi.intermediate_size, shared_inter=kimi.shared_size, top_k=kimi.top_k,
                          local_experts=kimi.num_experts // 64))
