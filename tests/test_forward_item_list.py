"""The forward kernel's work items of one rank, decoded on the host with the kernel's own plan, segment writer and
decoder (`ops.moe_forward.item_list`; no GPU): every kind has the items the plan says, every tile covers its m-block
and column block once, and every item comes after everything it waits for (ffi/include/mok/moe/plan.cuh), which is
what keeps the persistent kernel free of deadlocks. The GPU tests check what the items compute; these check which
items there are and in which order, for shapes and routings no GPU test reaches (64 ranks, 64 microbatches)."""
import math

import numpy as np
import pytest

from mok_jax import _native
from mok_jax.config import KernelConfig
from mok_jax.ops.moe_forward import ITEM_FIELDS, ITEM_TIME_KINDS, item_list

pytestmark = pytest.mark.skipif(_native.library() is None,
                                reason=f"the list is the native library's: {_native.native_status()}")

K = {name: i for i, name in enumerate(ITEM_TIME_KINDS)}
F = {name: i for i, name in enumerate(ITEM_FIELDS)}
TILE_M, GU_COLS, DN_COLS = 128, 128, 256  # plan.cuh: kTileM, kGuCols, kDnCols


def _rows(rng, microbatches: int, local: int, slot_rows: int, how: str) -> np.ndarray:
    """Rows per (microbatch, local expert): a balanced share, a skew, empty experts, or a ring slot filled."""
    share = slot_rows // max(1, local) // 2
    if how == "balanced":
        r = rng.integers(share // 2, share + 1, (microbatches, local))
    elif how == "skewed":
        r = (share * 2.0 / np.arange(1, local + 1) * rng.uniform(0.5, 1.5, (microbatches, local))).astype(int)
    elif how == "empty":
        r = np.where(rng.random((microbatches, local)) < 0.4, 0, rng.integers(1, 300, (microbatches, local)))
    else:  # "full": every microbatch fills its slot exactly
        r = np.full((microbatches, local), slot_rows // local)
        r[:, 0] += slot_rows - r.sum(1)
    return r.astype(np.int32)


def _d0(*, T, g, H, k, L, Is, ep, ctas, D):
    """DISPATCH(0)'s items (plan.cuh, Plan::D0): every CTA without a shared expert; at EP 1 with one, the share of
    the CTAs that ends it with the SHARED_GU tiles beside it (135 FLOP per byte), at least D; else D."""
    if ctas <= D:
        return D
    if Is == 0:
        return ctas
    if ep > 1:
        return D
    dispatch = min(g, T) * min(k, L) * H * 2 * 135.0
    return max(D, int(ctas * dispatch / (dispatch + 2.0 * T * H * 2 * Is) + 0.5))


def _check(*, T, H, I, Is, k, L, ep, G, S, D, ctas, how, seed=0, timing_mode=0):
    cfg = KernelConfig(granularity=G, comm_items_fwd=D, ring_slots=S)
    g, M, slots = cfg.microbatches(T)
    slot_rows = ep * min(g, T) * min(k, L)
    rows = _rows(np.random.default_rng(seed), M, L, slot_rows, how)
    items = item_list(rows, tokens=T, hidden=H, inter=I, shared_inter=Is, top_k=k, local_experts=L, ep=ep,
                      kernel=cfg, ctas=ctas, timing_mode=timing_mode)
    kind, mb = items[:, F["kind"]], items[:, F["mb"]]
    t = np.arange(len(items))

    def where(name, m=None):
        sel = kind == K[name]
        return sel if m is None else sel & (mb == m)

    # the static prefix, in the plan's order
    n_post = D if ep > 1 else 0
    n_count = math.ceil(ep * math.ceil(T / 64) / 8)
    d0 = _d0(T=T, g=g, H=H, k=k, L=L, Is=Is, ep=ep, ctas=ctas, D=D)
    s_mb = math.ceil(T / TILE_M)
    n_sgu, n_sdn = (s_mb * math.ceil(Is / GU_COLS), s_mb * math.ceil(H / DN_COLS)) if Is else (0, 0)
    # the production order: late at EP 1, early above; the lab's bits 64 ("shared down early") and 128 (late)
    late = n_sdn > 0 and (bool(timing_mode & 128) or (ep == 1 and not timing_mode & 64))
    prefix = (["post"] * n_post + ["count"] * n_count + ["scan"] + ["place"] * n_count + ["dispatch"] * d0
              + ["shared gate/up"] * n_sgu + ["shared down"] * (0 if late else n_sdn))
    assert [ITEM_TIME_KINDS[q] for q in kind[:len(prefix)]] == prefix
    for name, n in (("post", n_post), ("count", n_count), ("scan", 1), ("place", n_count),
                    ("shared gate/up", n_sgu), ("shared down", n_sdn)):
        assert where(name).sum() == n, name
    for name, n in (("post", n_post), ("count", n_count), ("place", n_count)):  # idx of count, once each
        assert sorted(items[where(name), F["idx"]].tolist()) == list(range(n)), name
        assert (items[where(name), F["count"]] == n).all(), name

    # the shared expert's tiles: each (m-block, column block) once; SHARED_DN after its m-block's SHARED_GU tiles
    for name, cols in (("shared gate/up", GU_COLS), ("shared down", DN_COLS)):
        tiles = items[where(name)]
        got = {(int(a), int(b)) for a, b in zip(tiles[:, F["mblock"]], tiles[:, F["n_block"]])}
        assert len(got) == len(tiles) == (s_mb * math.ceil((Is if "gate" in name else H) / cols) if Is else 0)
        assert (tiles[:, F["row0"]] == tiles[:, F["mblock"]] * TILE_M).all() and (tiles[:, F["row_end"]] == T).all()
    for b in range(s_mb if Is else 0):
        last_gu = t[where("shared gate/up") & (items[:, F["mblock"]] == b)].max()
        assert t[where("shared down") & (items[:, F["mblock"]] == b)].min() > last_gu
    if late:  # one segment between GU(0) and DN(0)
        sdn = t[where("shared down")]
        assert (np.diff(sdn) == 1).all()
        assert sdn.min() > t[where("gate/up", 0)].max(initial=-1)
        assert sdn.max() < t[where("down", 0)].min(initial=len(t))

    # each microbatch's items, and what each waits for before it in ticket order
    capped = np.minimum(np.cumsum(rows, 1), slot_rows)
    starts = np.concatenate([np.zeros((M, 1), np.int64), capped], 1)
    for m in range(M):
        disp = t[where("dispatch", m)]
        assert len(disp) == (d0 if m == 0 else D)
        assert sorted(items[disp, F["idx"]].tolist()) == list(range(len(disp)))
        per_expert = np.diff(starts[m])
        blocks = -(-per_expert // TILE_M)
        first_block = np.concatenate([[0], np.cumsum(blocks)])
        for name, cols in (("gate/up", I), ("down", H)):
            nb = math.ceil(cols / (GU_COLS if name == "gate/up" else DN_COLS))
            tiles = items[where(name, m)]
            assert len(tiles) == blocks.sum() * nb, (name, m)
            got = {(int(a), int(b)) for a, b in zip(tiles[:, F["mblock"]], tiles[:, F["n_block"]])}
            assert len(got) == len(tiles), (name, m)
            e = tiles[:, F["group"]]
            local_block = tiles[:, F["mblock"]] - first_block[e]
            assert ((0 <= local_block) & (local_block < blocks[e])).all(), (name, m)
            slot0 = (m % slots) * slot_rows
            assert (tiles[:, F["row0"]] == slot0 + starts[m][e] + local_block * TILE_M).all(), (name, m)
            assert (tiles[:, F["row_end"]] == slot0 + starts[m][e + 1]).all(), (name, m)
        gu, dn = where("gate/up", m), where("down", m)
        if gu.any():
            assert t[gu].min() > disp.max(), f"GU({m}) before DISPATCH({m})"
        for b in np.unique(items[dn, F["mblock"]]):
            assert t[dn & (items[:, F["mblock"]] == b)].min() > t[gu & (items[:, F["mblock"]] == b)].max()
        last = m == M - 1
        for name in ("send", "reduce"):
            if name == "send" and ep == 1:
                assert not where(name, m).any()
                continue
            phase = t[where(name, m)]
            assert len(phase) == (ctas if last else D), (name, m)
            before = disp.max() if not dn.any() else max(disp.max(), t[dn].max())
            assert phase.min() > before, f"{name.upper()}({m}) before DISPATCH({m}) or DN({m})"
        if Is:
            assert t[where("reduce", m)].min() > t[where("shared down")].max(), f"REDUCE({m}) before SHARED_DN"
        if m >= slots:  # the ring slot is free again: its last readers, SEND and REDUCE of microbatch m - S
            prev = t[where("reduce", m - slots) | where("send", m - slots)]
            assert disp.min() > prev.max(), f"DISPATCH({m}) before microbatch {m - slots} left the ring"
    return items


@pytest.mark.parametrize("ep,how", [(1, "balanced"), (1, "skewed"), (2, "empty"), (4, "full"), (8, "skewed")])
def test_every_item_once_and_after_what_it_waits_for(ep, how):
    _check(T=1200, H=512, I=384, Is=256, k=4, L=4, ep=ep, G=512, S=2, D=3, ctas=20, how=how)


@pytest.mark.parametrize("S", [1, 2, 3])
def test_without_a_shared_expert_and_each_ring_size(S):
    """No shared expert: DISPATCH(0) takes every CTA. One ring slot runs dispatch and compute in the same step."""
    _check(T=2000, H=256, I=256, Is=0, k=2, L=3, ep=2, G=512, S=S, D=4, ctas=16, how="balanced")


@pytest.mark.parametrize("ep,T,G", [(2, 26624, 512), (16, 4096, 512), (64, 2048, 512), (1, 32768, 512)])
def test_many_microbatches_fit_the_segment_table(ep, T, G):
    """52 microbatches and more at EP > 1 overflowed the segment table before ec2cc32 counted SEND in its bound; the
    list raises when SCAN would write past it, so these calls fit."""
    items = _check(T=T, H=256, I=128, Is=0, k=2, L=2, ep=ep, G=G, S=2, D=2, ctas=8, how="empty", seed=ep)
    assert (items[:, F["kind"]] == K["reduce"]).any()


def test_the_kimi_k2_shape():
    """12 local experts, T = 2048 at G 2048 (one microbatch), the shared expert, 32 items on 132 CTAs."""
    items = _check(T=2048, H=7168, I=2048, Is=2048, k=8, L=12, ep=1, G=2048, S=2, D=32, ctas=132, how="balanced")
    assert (items[:, F["kind"]] == K["shared down"]).sum() == 16 * 28


def test_a_phase_never_has_more_items_than_the_rank_has_ctas():
    """comm_items past the rank's CTAs is clipped to them, as launch_forward does."""
    cfg = KernelConfig(granularity=512, comm_items_fwd=48, ring_slots=2)
    items = item_list(np.full((2, 3), 100, np.int32), tokens=1000, hidden=256, inter=256, shared_inter=128, top_k=2,
                      local_experts=3, ep=1, kernel=cfg, ctas=10)
    kind = items[:, F["kind"]]
    assert (kind == K["dispatch"]).sum() == 2 * 10 and (items[kind == K["dispatch"], F["count"]] == 10).all()


@pytest.mark.parametrize("model,k,L,H,Is,d0", [("kimi-k2", 8, 12, 7168, 2048, 32), ("glm-5", 8, 8, 6144, 2048, 32),
                                                ("deepseek-v4-pro", 6, 12, 7168, 3072, 32),
                                                ("qwen3.5-397b-a17b", 10, 16, 4096, 1024, 52)])
def test_first_dispatch_ends_with_the_shared_gate_up(model, k, L, H, Is, d0):
    """At EP 1 with a shared expert DISPATCH(0) takes the share of the CTAs that ends it with the SHARED_GU tiles
    beside it, at least D: on one H100's 132 CTAs, T = 2048 and E/32 experts, qwen3.5's 52 CTAs (it ended 110 us
    after SHARED_GU with 32); the three with a larger shared expert keep D = 32. At EP 2 it is D."""
    cfg = KernelConfig(granularity=2048, comm_items_fwd=32, ring_slots=2)
    kw = dict(tokens=2048, hidden=H, inter=1024, shared_inter=Is, top_k=k, local_experts=L, kernel=cfg, ctas=132)
    for ep, want in ((1, d0), (2, 32)):
        items = item_list(np.full((1, L), 2048 * ep * k // L, np.int32), ep=ep, **kw)
        first = items[(items[:, F["kind"]] == K["dispatch"]) & (items[:, F["mb"]] == 0)]
        assert len(first) == want and (first[:, F["count"]] == want).all(), (model, ep)


@pytest.mark.parametrize("ep,G,S", [(1, 2048, 2), (1, 512, 1), (2, 512, 2), (4, 512, 3)])
def test_shared_down_runs_between_gu0_and_dn0(ep, G, S):
    """At EP 1 the SHARED_DN tiles run as one segment between GU(0) and DN(0), at EP > 1 in the static prefix; the
    lab's timing bits "shared down early" (64) and "shared down late" (128) choose either order at any EP size: the
    same items, and each still after what it waits for (and REDUCE after it)."""
    kw = dict(T=2048, H=512, I=256, Is=384, k=4, L=4, ep=ep, G=G, S=S, D=3, ctas=24, how="balanced")
    production, early, late = _check(**kw), _check(**kw, timing_mode=64), _check(**kw, timing_mode=128 + 32)
    assert (production == (late if ep == 1 else early)).all()
    assert sorted(map(tuple, early.tolist())) == sorted(map(tuple, late.tolist()))
    assert not (early == late).all()


def test_bad_rows_and_calls():
    cfg = KernelConfig(granularity=512, comm_items_fwd=2, ring_slots=2)
    kw = dict(tokens=1000, hidden=256, inter=256, shared_inter=0, top_k=2, local_experts=3, ep=1, kernel=cfg, ctas=8)
    with pytest.raises(ValueError, match=r"rows must be \[microbatches, local_experts\] = \[2, 3\]"):
        item_list(np.zeros((1, 3)), **kw)
    with pytest.raises(ValueError, match="rows must be counts"):
        item_list(-np.ones((2, 3)), **kw)
    with pytest.raises(ValueError, match="does not support this call"):
        item_list(np.zeros((2, 3)), **{**kw, "ctas": 0})
    with pytest.raises(ValueError, match="item_list: timing_mode 192 asks for both orders"):
        item_list(np.zeros((2, 3)), **kw, timing_mode=192)
