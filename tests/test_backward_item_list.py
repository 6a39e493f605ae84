"""The backward kernel's list of work items, decoded on the host by the native library's own `make_shape` and `decode`
(`ops.moe_backward.item_list`; no GPU): every kind's items cover their m-blocks or tiles exactly once, in the kinds'
order, and GATHER goes in rounds over the experts (m-block b of every expert before b + 1, for as many rounds as the
smallest expert has m-blocks), then expert by expert. The GPU tests check what the items compute; these check which
items there are, for group sizes no GPU test reaches (hundreds of experts, skewed, empty, bad tables)."""
import numpy as np
import pytest

from mok_jax import _native
from mok_jax.ops.moe_backward import ITEM_FIELDS, ITEM_KINDS, item_list

pytestmark = pytest.mark.skipif(_native.library() is None,
                                reason=f"the list is the native library's: {_native.native_status()}")

BLOCK = 128  # the kernel's m-block and n-block rows (kBlockM) and its tiles' 256 output columns (kBlockN)
N_BLOCK = 256
KIND = {name: i for i, name in enumerate(ITEM_KINDS)}
F = {name: i for i, name in enumerate(ITEM_FIELDS)}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sizes(rng, E: int, how: str) -> np.ndarray:
    """Padded group sizes (multiples of 128) of E experts."""
    if how == "uniform":
        blocks = rng.integers(30, 35, E)
    elif how == "skewed":  # expert e with about 40 / (e + 1) m-blocks, at least one
        blocks = np.maximum(1, (40.0 / np.arange(1, E + 1) * rng.uniform(0.7, 1.3, E)).astype(int))
    elif how == "empty":  # some experts without rows
        blocks = np.where(rng.random(E) < 0.3, 0, rng.integers(1, 9, E))
    else:  # "small": at most one m-block each
        blocks = rng.integers(0, 2, E)
    return (blocks * BLOCK).astype(np.int32)


def _check(sizes: np.ndarray, *, hidden: int = 512, inter: int = 384, kept: bool = False, extra_rows: int = 0):
    E = sizes.size
    rows = int(sizes.sum()) + extra_rows
    items = item_list(sizes, rows=rows, hidden=hidden, inter=inter, kept=kept)
    kinds = items[:, F["kind"]]
    assert (np.diff(kinds) >= 0).all(), "the kinds are not in the list's order"
    blocks = sizes // BLOCK
    tile_start = np.concatenate([[0], np.cumsum(blocks)])
    row_start = np.concatenate([[0], np.cumsum(sizes)])
    nmb = int(tile_start[-1])
    group_of = np.repeat(np.arange(E), blocks)  # each m-block's expert

    # GATHER: a bijection onto the m-blocks, each with its expert's rows, in rounds then expert by expert
    gather = items[kinds == KIND["gather"]]
    assert len(gather) == nmb
    mb, group = gather[:, F["mb"]], gather[:, F["group"]]
    assert sorted(mb.tolist()) == list(range(nmb)), "GATHER misses or repeats an m-block"
    assert (group == group_of[mb]).all()
    assert (gather[:, F["row0"]] == row_start[group] + (mb - tile_start[group]) * BLOCK).all()
    assert (gather[:, F["row_end"]] == np.minimum(gather[:, F["row0"]] + BLOCK, row_start[group + 1])).all()
    r = int(blocks.min()) if E else 0
    i = np.arange(E * r)
    assert (group[: E * r] == i % E).all() and (mb[: E * r] == tile_start[i % E] + i // E).all(), "not in rounds"
    rest = mb[E * r:]
    assert (np.diff(rest) > 0).all(), "the blocks past the rounds are not expert by expert"
    assert all(mb_ - tile_start[g] >= r for mb_, g in zip(rest, group[E * r:]))

    # DWSUM: one item per m-block, in order
    assert (items[kinds == KIND["router-weight sum"]][:, F["mb"]] == np.arange(nmb)).all()

    # the row GEMMs: each (m-block, n-block) once
    for kind, cols in (("gate/up recompute", 2 * inter), ("down dgrad + SwiGLU bwd", inter),
                       ("gate/up dgrad", hidden)):
        tiles = items[kinds == KIND[kind]]
        want = 0 if kind == "gate/up recompute" and kept else nmb * _cdiv(cols, N_BLOCK)
        assert len(tiles) == want, kind
        m, n = tiles[:, F["mb"]], tiles[:, F["n_block"]]
        assert len({(int(a), int(b)) for a, b in zip(m, n)}) == want, kind
        assert ((0 <= m) & (m < nmb) & (0 <= n) & (n < _cdiv(cols, N_BLOCK))).all(), kind
        assert (group_of[m] == tiles[:, F["group"]]).all(), kind

    # the weight gradients: each expert's output tiles once
    for kind, (out_rows, out_cols) in (("d_down", (inter, hidden)), ("d_gate_up", (hidden, 2 * inter))):
        tiles = items[kinds == KIND[kind]]
        per = _cdiv(out_rows, BLOCK) * _cdiv(out_cols, N_BLOCK)
        assert len(tiles) == E * per, kind
        got = {(int(t[F["group"]]), int(t[F["m_block"]]), int(t[F["n_block"]])) for t in tiles}
        assert len(got) == E * per, kind
    return items


@pytest.mark.parametrize("E,how", [(1, "uniform"), (4, "skewed"), (16, "uniform"), (16, "skewed"), (33, "empty"),
                                   (200, "small"), (384, "uniform"), (1024, "small")])
def test_every_item_once_and_gather_in_rounds(E, how):
    rng = np.random.default_rng(E * 7 + len(how))
    _check(_sizes(rng, E, how))


def test_rows_past_the_groups_and_kept_g_u():
    rng = np.random.default_rng(5)
    _check(_sizes(rng, 8, "skewed"), extra_rows=3 * BLOCK, kept=True, hidden=7168, inter=2048)


def test_gather_rounds_skip_nothing_when_an_expert_is_empty():
    """One empty expert: no rounds (r = 0), GATHER expert by expert, the old order."""
    sizes = np.array([4, 0, 3, 2], np.int32) * BLOCK
    items = _check(sizes)
    gather = items[items[:, F["kind"]] == KIND["gather"]]
    assert gather[:, F["mb"]].tolist() == list(range(9))


def test_the_qwen3_30b_shape_gathers_in_rounds():
    """16 experts of 4096 rows (T = 8192, k = 8, uniform): all 32 m-blocks of every expert go in rounds."""
    items = _check(np.full(16, 4096, np.int32), hidden=2048, inter=768, kept=True)
    gather = items[items[:, F["kind"]] == KIND["gather"]]
    assert gather[:20, F["group"]].tolist() == list(range(16)) + [0, 1, 2, 3]
    assert gather[:20, F["mb"]].tolist() == [32 * e for e in range(16)] + [1, 33, 65, 97]


@pytest.mark.parametrize("sizes,rows", [([256, 256], 256), ([256, -128], 512)])
def test_a_bad_table_has_no_rows_to_gather(sizes, rows):
    """Group sizes past the rows, or a negative one (the kernel's status says so): the table is zeros, no GATHER, no
    row tiles."""
    items = item_list(np.array(sizes, np.int32), rows=rows, hidden=256, inter=256)
    kinds = items[:, 0]
    for kind in ("gather", "gate/up recompute", "down dgrad + SwiGLU bwd", "gate/up dgrad", "router-weight sum"):
        assert not (kinds == KIND[kind]).any(), kind


def test_too_many_experts_is_an_error():
    with pytest.raises(ValueError, match="group_sizes: 1025 experts"):
        item_list(np.zeros(1025, np.int32), rows=0, hidden=256, inter=256)
