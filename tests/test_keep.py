"""MoEConfig(keep="everything" | "ring") on CPU: the forward of implementation="mok" keeps its fp32 g, u (of every
slot in its backward's padded layout, or of the slots of the tokens still in its ring, in a buffer of their own)
and the backward skips the gate/up recompute of what was kept (issue 10, the memory knob).

The kernels need a GPU; here the megakernel is replaced by the xla forward plus g, u computed exactly as the
experts' backward reference recomputes them, and the native op by that reference: so the glue (the layouts, the
residuals, the EP > 1 gathers) is checked, bit for bit against keep="nothing". The lowering of the real ops
with keep shows the forward's keep_pos operand and keep_gu result and the backward's gu operand.
(tests/test_moe_backward_gpu.py checks the kernels' bits on the H200.)
"""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_problem, use_fused_ep_backward, used_kept_blocks

import mok_jax as mj
import mok_jax.ops
from mok_jax.config import ModelShape, MoEConfig
from mok_jax.expert_layout import gather_rows
from mok_jax.reference import experts_backward_reference
from mok_jax.weights import MoEWeights

moe_mod = importlib.import_module("mok_jax.layer")
HI = lambda: jax.default_matmul_precision("highest")  # noqa: E731


def test_keep_values():
    assert MoEConfig(keep="everything").keep == "everything" and MoEConfig(keep="nothing").keep == "nothing"
    assert MoEConfig(keep="ring").keep == "ring"
    with pytest.raises(ValueError, match="MoEConfig.keep must be one of 'nothing', 'ring', 'balanced', 'everything', "
                                         "got 'all'"):
        MoEConfig(keep="all")


def test_keep_default_is_balanced_in_bf16_and_nothing_in_fp8():
    """The default keeps what a balanced routing fills (measured: 11.7-13.8% off the fwd+bwd of the five benchmark
    problems); the FP8 forward's accumulators are not the bf16 backward's values, so it keeps nothing."""
    assert MoEConfig().keep == "balanced" and MoEConfig(implementation="mok").keep == "balanced"
    assert MoEConfig() == MoEConfig(keep="balanced") and hash(MoEConfig()) == hash(MoEConfig(keep="balanced"))
    assert MoEConfig(implementation="mok", precision="fp8").keep == "nothing"
    with pytest.raises(ValueError, match="needs keep='nothing', got keep='balanced'"):
        MoEConfig(implementation="mok", precision="fp8", keep="balanced")


def _recomputed_gu(x, gate_up, layout, k):
    """g | u of every row of ``layout`` as experts_backward_reference recomputes them (f32 accumulation rounded to
    x's dtype, as the kernels store them; expert by expert over every row, zeros in rows without a slot), so that
    keeping them changes no bit."""
    m = layout.num_rows
    slot_ok = (layout.src_slot >= 0) & (layout.src_slot < x.shape[0] * k)
    x32 = gather_rows(x, jnp.where(slot_ok, layout.src_slot // k, -1)).astype(jnp.float32)
    expert_of_row = jnp.searchsorted(jnp.cumsum(layout.group_sizes), jnp.arange(m), side="right")
    gu = jnp.zeros((m, gate_up.shape[2]), jnp.float32)
    for e in range(gate_up.shape[0]):
        gu = jnp.where(((expert_of_row == e) & slot_ok)[:, None], x32 @ gate_up[e].astype(jnp.float32), gu)
    return gu.astype(x.dtype)


def _fake_forward_mok(x, topk_idx, topk_weight, weights, config, keep=None, fp8_weights=None, workspace=None):
    """The megakernel's outputs on CPU: the xla forward, and with ``keep`` = (keep_pos, rows) the kept g, u: each
    slot's row of the rank's layout (at EP > 1 over every rank's tokens, as the kernel sees them) written to its
    keep_pos row of bf16[rows, 2I] (slots outside it are not kept), and the shared expert's g | u of the rank's
    tokens (None without one)."""
    y = moe_mod._forward_xla(x, topk_idx, topk_weight, weights, config)
    if keep is None:
        return y
    keep_pos, rows = keep
    k, L = topk_idx.shape[1], weights.num_local_experts
    xs, ids, rank = x, topk_idx, 0
    if config.ep_axis is not None:
        gather = lambda a: jax.lax.all_gather(a, config.ep_axis, tiled=True)  # noqa: E731
        xs, ids, rank = gather(x), gather(topk_idx), jax.lax.axis_index(config.ep_axis)
    layout = moe_mod.rank_layout(ids, L, rank)
    with HI():
        gu = _recomputed_gu(xs, weights.gate_up, layout, k)
    pos = layout.pos.reshape(-1)
    mine = (pos < layout.num_rows) & (keep_pos >= 0) & (keep_pos < rows)
    picked = jnp.concatenate([gu, jnp.zeros((1, gu.shape[1]), gu.dtype)])[pos]
    kept = jnp.zeros((rows + 1, gu.shape[1]), gu.dtype).at[jnp.where(mine, keep_pos, rows)].set(picked)
    shared_gu = moe_mod.shared_gate_up_product(x, weights.shared_gate_up) if weights.has_shared else None
    return y, kept[:rows], shared_gu


@pytest.fixture
def fake_kernels(monkeypatch):
    monkeypatch.setattr(moe_mod, "require_native", lambda what: None)
    monkeypatch.setattr(moe_mod, "_forward_mok", _fake_forward_mok)
    monkeypatch.setattr(mok_jax.ops, "experts_backward", experts_backward_reference)


def _problem(T, E=8, H=32, I=24, k=3, Is=16, seed=0):
    shape = ModelShape(name="t", num_experts=E, top_k=k, hidden_size=H, intermediate_size=I,
                       num_shared_experts=1, shared_intermediate_size=Is)
    x, _, w, W = random_problem(shape, T, seed=seed)
    x, W = x.astype(jnp.bfloat16), jax.tree.map(lambda a: a.astype(jnp.bfloat16), W)
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.25] = -1  # masked slots
    dy = jax.random.normal(jax.random.key(seed + 1), x.shape).astype(jnp.bfloat16)
    return x, jnp.asarray(idx), w, W, dy


def _grads(keep, x, idx, w, W, dy, mesh=None, kernel=None):
    if mesh is None:
        cfg = MoEConfig(implementation="mok", keep=keep, kernel=kernel)
        layer = lambda x, i, w, W: mj.moe(x, i, w, W, config=cfg)  # noqa: E731
        args = (x, idx, w, W, dy)
    else:
        spec = jax.sharding.PartitionSpec
        cfg = MoEConfig(implementation="mok", ep_axis="ep", keep=keep, kernel=kernel)
        specs = (spec("ep"), spec("ep"), spec("ep"), MoEWeights(spec("ep"), spec("ep"), spec(), spec()))
        layer = jax.shard_map(lambda x, i, w, W: mj.moe(x, i, w, W, config=cfg), mesh=mesh, in_specs=specs,
                              out_specs=spec("ep"))
        args = jax.tree.map(lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s)), (x, idx, w, W, dy),
                            (*specs, spec("ep")))
    loss = lambda x, w, W, i, dy: jnp.sum(layer(x, i, w, W).astype(jnp.float32) * dy)  # noqa: E731
    with HI():
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(args[0], args[2], args[3], args[1], args[4])


def _assert_same(got, want, what):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=f"{what}: {i}")


@pytest.mark.parametrize("T", [1, 40])
def test_keep_everything_gives_the_gradients_of_recompute(fake_kernels, T):
    x, idx, w, W, dy = _problem(T, seed=T)
    _assert_same(_grads("everything", x, idx, w, W, dy), _grads("nothing", x, idx, w, W, dy), f"T={T}")


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("ep", [2, 4])
def test_keep_everything_at_ep_sizes_above_one(fake_kernels, monkeypatch, cpu_devices, ep, fused):
    """Under shard_map the kept rows are the owner's layout over the all-gathered tokens: keep and recompute give
    the same bits, and both the bits of EP 1 for the routed experts' gradients (the collectives path, or the fused
    op's)."""
    use_fused_ep_backward(monkeypatch, ep, fused)
    x, idx, w, W, dy = _problem(16 * ep, seed=ep)
    mesh = jax.make_mesh((ep,), ("ep",), devices=cpu_devices[:ep])
    keep = _grads("everything", x, idx, w, W, dy, mesh)
    _assert_same(keep, _grads("nothing", x, idx, w, W, dy, mesh), f"EP {ep}")
    one = _grads("nothing", x, idx, w, W, dy)
    _assert_same((keep[0], keep[1], keep[2].gate_up, keep[2].down), (one[0], one[1], one[2].gate_up, one[2].down),
                 f"EP {ep} against EP 1")


def _skewed_problem(T, ep, E=8, k=3, seed=0):
    """_problem's tensors with every token routed to the first k experts (rank 0's at EP 2 and 4), so that rank 0
    receives ep T k slots: more than the T k + 128 L rows of keep="balanced" (with T k well above 128 L)."""
    x, idx, w, W, dy = _problem(T * ep, E=E, k=k, seed=seed)
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(k) for _ in range(T * ep)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    return x, jnp.asarray(idx), w, W, dy


def test_keep_balanced_at_ep_one_is_everything():
    x, idx, w, W, dy = _problem(300)
    layout = moe_mod.rank_layout(idx, W.num_local_experts, 0)
    keep_pos, rows, row = moe_mod._keep_plan(MoEConfig(implementation="mok"), x, idx, W, layout)
    assert row is None and rows == layout.num_rows == 300 * 3 + 128 * W.num_local_experts
    np.testing.assert_array_equal(np.asarray(keep_pos), np.asarray(layout.pos).reshape(-1))
    assert moe_mod.kept_rows("balanced", None, tokens=300, top_k=3, local_experts=8) == layout.num_rows


@pytest.mark.parametrize("ep", [2, 4])
def test_keep_balanced_plan_is_bounded_by_the_ep_one_rows(cpu_devices, ep):
    """At EP > 1 the kept rows are the owner's first T k + 128 L layout rows, whatever the EP size: under a routing
    that sends every token to rank 0 its rows past them are recomputed (128-row blocks of both kinds)."""
    T, k, E = 600, 3, 8
    L = E // ep
    x, idx, w, W, dy = _skewed_problem(T, ep, E=E, k=k)
    mesh = jax.make_mesh((ep,), ("ep",), devices=cpu_devices[:ep])
    spec = jax.sharding.PartitionSpec
    cfg = MoEConfig(implementation="mok", ep_axis="ep")
    bound = T * k + 128 * L
    assert moe_mod.kept_rows("balanced", None, tokens=T, top_k=k, local_experts=L, ep=ep) == bound
    local = W._replace(gate_up=W.gate_up[:L], down=W.down[:L])  # a rank's experts (only their count is read)

    def plan(x, idx):
        ids = jax.lax.all_gather(idx, "ep", tiled=True)
        layout = moe_mod.rank_layout(ids, L, jax.lax.axis_index("ep"))
        keep_pos, rows, row = moe_mod._keep_plan(cfg, x, idx, local, layout)
        assert rows == bound
        return keep_pos[None], layout.pos.reshape(1, -1), row[None], layout.src_slot[None], layout.group_sizes[None]

    put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec("ep")))  # noqa: E731
    keep_pos, pos, row, src, sizes = (np.asarray(a) for a in jax.jit(jax.shard_map(
        plan, mesh=mesh, in_specs=(spec("ep"), spec("ep")), out_specs=spec("ep")))(put(x), put(idx)))
    m = row.shape[1]
    for r in range(ep):
        np.testing.assert_array_equal(keep_pos[r], pos[r], f"owner {r}: each slot keeps its layout row")
        np.testing.assert_array_equal(row[r], np.where(np.arange(m) < bound, np.arange(m), -1), f"owner {r}")
    blocks = used_kept_blocks(jnp.asarray(src[0]), jnp.asarray(row[0]), bound, ep * T * k, jnp.asarray(sizes[0]))
    assert 0 < int(blocks.sum()) < blocks.size, blocks


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("ep", [2, 4])
def test_keep_balanced_gives_the_gradients_of_recompute_under_skew(fake_kernels, monkeypatch, cpu_devices, ep,
                                                                     fused):
    """The default keep at EP > 1, with rank 0 past its kept rows: the bits of keep="nothing" (the collectives
    path, or the fused op's). (Against EP 1 the CPU reference's weight gradients can differ in an ulp here: XLA:CPU
    blocks its sum over an expert's ~1000 rows by the layout's size, which EP changes; the kernels sum over the
    group's rows, and tests/test_moe_backward_gpu.py checks their EP bits.)"""
    use_fused_ep_backward(monkeypatch, ep, fused)
    x, idx, w, W, dy = _skewed_problem(600, ep)
    mesh = jax.make_mesh((ep,), ("ep",), devices=cpu_devices[:ep])
    _assert_same(_grads("balanced", x, idx, w, W, dy, mesh), _grads("nothing", x, idx, w, W, dy, mesh), f"EP {ep}")


def _lowered_calls(monkeypatch, keep, T, kernel, H=64, I=32, E=4, k=2, Is=0, text=False):
    """The forward and backward custom-call lines of jax.grad of the real ops with ``keep`` (no GPU: the native
    library's checks are switched off and the workspace is a stand-in), and with ``text`` the whole lowering too;
    Is > 0: with a shared expert of that size."""
    from mok_jax.workspace import CommConfig, Workspace

    mf = importlib.import_module("mok_jax.ops.moe_forward")
    mb = importlib.import_module("mok_jax.ops.moe_backward")
    ws = Workspace(ws_id=7, config=CommConfig(ep=1, max_tokens=T, hidden_size=H, top_k=k, num_experts=E), mesh=None,
                   axis_name=None, local=[])
    for mod in (moe_mod, mf, mb):
        monkeypatch.setattr(mod, "require_native", lambda what: None)
    monkeypatch.setattr(mf, "scratch_bytes", lambda **kw: 4096)
    cfg = MoEConfig(implementation="mok", keep=keep, kernel=kernel)
    x = jax.ShapeDtypeStruct((T, H), jnp.bfloat16)
    idx = jnp.zeros((T, k), jnp.int32).at[:, 1].set(1)
    w = jnp.ones((T, k), jnp.float32)
    shared = (jnp.ones((H, 2 * Is), jnp.bfloat16), jnp.ones((Is, H), jnp.bfloat16)) if Is else (None, None)
    W = MoEWeights(jnp.ones((E, H, 2 * I), jnp.bfloat16), jnp.ones((E, I, H), jnp.bfloat16), *shared)
    f = jax.jit(jax.grad(lambda x, w, W: jnp.sum(mj.moe(x, idx, w, W, config=cfg, workspace=ws).astype(jnp.float32)),
                         argnums=(0, 1, 2)))
    whole = f.lower(x, w, W).as_text()
    lines = whole.splitlines()
    [fwd] = [line for line in lines if "custom_call @mok_moe_forward(" in line]
    [bwd] = [line for line in lines if "custom_call @mok_experts_backward(" in line]
    return (fwd, bwd, whole) if text else (fwd, bwd)


@pytest.mark.parametrize("keep", ["nothing", "balanced", "ring"])
def test_the_shared_experts_g_u_are_kept_with_the_routed_ones(monkeypatch, keep):
    """With a shared expert and any keep but "nothing", the forward call also returns the shared expert's g | u,
    bf16[1, T, 2Is] (its last result), and the backward (the shared expert's in XLA) has no matmul that makes them
    (f32[T, 2Is]); with "nothing" the result is bf16[1, 0, 2Is] and the backward recomputes them, once."""
    T, H, I, Is = 40, 64, 32, 48
    fwd, _, text = _lowered_calls(monkeypatch, keep, T, _RING, H=H, I=I, Is=Is, text=True)
    kept = keep != "nothing"
    assert f"tensor<1x{T if kept else 0}x{2 * Is}xbf16>)" in fwd.split("->")[1], fwd
    recompute = [line for line in text.splitlines()
                 if "stablehlo.dot_general" in line and line.rstrip().endswith(f"-> tensor<{T}x{2 * Is}xf32>")]
    assert len(recompute) == (0 if kept else 1), recompute


@pytest.mark.parametrize("keep", ["everything", "balanced"])
def test_keep_lowers_to_a_kept_forward_and_a_backward_without_the_recompute(monkeypatch, keep):
    """jax.grad of the real ops with keep="everything" (and the default, "balanced", the same at EP 1): the forward
    call takes keep_pos [1, T k] and returns keep_gu bf16[1, M, 2I] (and, last, the shared expert's, here none:
    bf16[1, 0, 0]); the backward call takes that [M, 2I] buffer, aliased to its gu scratch."""
    T, H, I, E, k = 40, 64, 32, 4, 2
    M = T * k + 128 * E
    fwd, bwd = _lowered_calls(monkeypatch, keep, T, mj.KernelConfig(granularity=512, comm_items_fwd=8))
    assert f"tensor<1x{T * k}xi32>) -> (" in fwd and f"tensor<1x{M}x{2 * I}xbf16>, tensor<1x0x0xbf16>)" in fwd, fwd
    # the kept buffer: the ninth operand (then the shared expert's weights, here none: [H, 0] and [0, H])
    assert (f"tensor<{M}x{2 * I}xbf16>, tensor<0x{2 * I}xbf16>, tensor<0xi32>, tensor<0xi32>, tensor<{H}x0xbf16>, "
            f"tensor<0x{H}xbf16>)") in bwd.split("->")[0], bwd
    # ... handed to the op as its gu scratch (result 8), whose padding rows it zeroes in place
    assert re.search(r"output_operand_alias<output_tuple_indices = \[8\], operand_index = 8,", bwd), bwd


def test_first_ring_token_cuts_microbatches_as_the_kernel_plan():
    """G = min(granularity, T) rounded up to 64-token chunks; the ring holds the last ring_slots microbatches."""
    from mok_jax.ops.moe_forward import first_ring_token

    cfg = lambda g, s: mj.KernelConfig(granularity=g, ring_slots=s)  # noqa: E731
    assert first_ring_token(cfg(512, 2), 1200) == 512  # microbatches [0, 512) [512, 1024) [1024, 1200)
    assert first_ring_token(cfg(512, 1), 1200) == 1024
    assert first_ring_token(cfg(512, 3), 1200) == 0  # every microbatch in the ring
    assert first_ring_token(cfg(576, 1), 1000) == 576
    assert first_ring_token(cfg(512, 1), 100) == 0  # one microbatch of 128 (100 rounded up to a chunk)


_RING = mj.KernelConfig(granularity=512, ring_slots=2)  # 1200 tokens: microbatches 1 and 2 in the ring


def test_keep_ring_plan_keeps_the_ring_tokens_slots():
    """keep="ring": the slots of tokens >= the first ring token, numbered in layout order, and nothing else; the
    layout has 128-row blocks of both kinds (copied, recomputed), so the tests below exercise both."""
    T, k, E = 1200, 3, 8
    x, idx, w, W, dy = _problem(T, E=E, k=k)
    layout = moe_mod.rank_layout(idx, E, 0)
    cfg = MoEConfig(implementation="mok", keep="ring", kernel=_RING)
    keep_pos, rows, row = moe_mod._keep_plan(cfg, x, idx, W, layout)
    assert rows == (T - 512) * k < layout.num_rows
    pos, keep_pos, row = np.asarray(layout.pos).reshape(-1), np.asarray(keep_pos), np.asarray(row)
    src = np.asarray(layout.src_slot)
    want = (src >= 0) & (src // k >= 512)
    np.testing.assert_array_equal(row >= 0, want)
    np.testing.assert_array_equal(row[want], np.arange(want.sum()))  # layout order, no gaps
    has_row = pos < layout.num_rows
    np.testing.assert_array_equal(keep_pos[has_row], row[pos[has_row]])
    assert (keep_pos[~has_row] == -1).all()
    blocks = used_kept_blocks(layout.src_slot, jnp.asarray(row), rows, T * k, layout.group_sizes)
    assert 0 < blocks.sum() < blocks.size, blocks
    # every token in the ring: what "everything" keeps
    every = MoEConfig(implementation="mok", keep="ring", kernel=mj.KernelConfig(granularity=512, ring_slots=3))
    keep_pos, rows, row = moe_mod._keep_plan(every, x, idx, W, layout)
    assert row is None and rows == layout.num_rows
    np.testing.assert_array_equal(np.asarray(keep_pos), pos)


def _copied_and_recomputed(config, x, idx, W, layout):
    """(copied, recomputed) 128-row blocks of the layout's used rows under keep="ring"."""
    _, rows, row = moe_mod._keep_plan(config, x, idx, W, layout)
    blocks = used_kept_blocks(layout.src_slot, row, rows, idx.size, layout.group_sizes)
    return int(blocks.sum()), int(blocks.size - blocks.sum())


@pytest.mark.parametrize("T,granularity,ring_slots", [(1200, 512, 2), (2048, 1024, 1)])
def test_keep_ring_gives_the_gradients_of_recompute(fake_kernels, T, granularity, ring_slots):
    x, idx, w, W, dy = _problem(T, seed=ring_slots)
    kernel = mj.KernelConfig(granularity=granularity, ring_slots=ring_slots)
    copied, recomputed = _copied_and_recomputed(MoEConfig(implementation="mok", keep="ring", kernel=kernel), x, idx,
                                                W, moe_mod.rank_layout(idx, W.num_local_experts, 0))
    assert copied and recomputed, (copied, recomputed)
    _assert_same(_grads("ring", x, idx, w, W, dy, kernel=kernel), _grads("nothing", x, idx, w, W, dy, kernel=kernel),
                 f"ring_slots={ring_slots}")


@pytest.mark.parametrize("fused", [False, True])
def test_keep_ring_at_ep_size_two(fake_kernels, monkeypatch, cpu_devices, fused):
    """At EP 2 each source rank's ring tokens are kept (its local tokens >= the first ring token, 512 of 1200):
    each owner's plan keeps exactly the slots of those tokens of both ranks, and the gradients are the bits of
    keep="nothing" (the collectives path, or the fused op's)."""
    use_fused_ep_backward(monkeypatch, 2, fused)
    x, idx, w, W, dy = _problem(2400, seed=5)
    mesh = jax.make_mesh((2,), ("ep",), devices=cpu_devices[:2])
    spec = jax.sharding.PartitionSpec
    cfg = MoEConfig(implementation="mok", ep_axis="ep", keep="ring", kernel=_RING)

    def plan(x, idx):
        ids = jax.lax.all_gather(idx, "ep", tiled=True)
        layout = moe_mod.rank_layout(ids, W.num_local_experts // 2, jax.lax.axis_index("ep"))
        keep_pos, _, row = moe_mod._keep_plan(cfg, x, idx, W, layout)
        return keep_pos[None], layout.src_slot[None], row[None]

    put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec("ep")))  # noqa: E731
    keep_pos, src, row = jax.jit(jax.shard_map(plan, mesh=mesh, in_specs=(spec("ep"), spec("ep")),
                                               out_specs=spec("ep")))(put(x), put(idx))
    keep_pos, src, row = (np.asarray(a) for a in (keep_pos, src, row))
    ids = np.asarray(idx).reshape(-1)
    for r in range(2):  # owner r: its experts' slots of the tokens t >= 512 of either source rank
        mine = (ids >= r * 4) & (ids < (r + 1) * 4) & ((np.arange(ids.size) // 3) % 1200 >= 512)
        np.testing.assert_array_equal(keep_pos[r] >= 0, mine, f"owner {r}")
        src_r, row_r = src[r], row[r]
        assert set(src_r[row_r >= 0] // 3 // 1200) == {0, 1}, f"owner {r} keeps rows of both source ranks"
    ring = _grads("ring", x, idx, w, W, dy, mesh, kernel=_RING)
    _assert_same(ring, _grads("nothing", x, idx, w, W, dy, mesh, kernel=_RING), "EP 2")


def test_keep_ring_lowers_to_a_part_kept_forward_and_backward(monkeypatch):
    """jax.grad of the real ops with keep="ring" and tokens past the ring: the forward returns keep_gu bf16[1, (T -
    t0) k, 2I]; the backward takes it as gu_part with gu_part_row [M] and the kept blocks [ceil(M / 128)], and its gu
    scratch is its own (no alias)."""
    T, H, I, E, k = 1200, 64, 32, 4, 2
    M, rows = T * k + 128 * E, (T - 512) * k
    fwd, bwd = _lowered_calls(monkeypatch, "ring", T, _RING)
    assert f"tensor<1x{T * k}xi32>) -> (" in fwd and f"tensor<1x{rows}x{2 * I}xbf16>, tensor<1x0x0xbf16>)" in fwd, fwd
    assert (f"tensor<0x{2 * I}xbf16>, tensor<{rows}x{2 * I}xbf16>, tensor<{M}xi32>, tensor<{-(-M // 128)}xi32>, "
            f"tensor<{H}x0xbf16>") in bwd.split("->")[0], bwd
    assert "output_operand_alias" not in bwd, bwd
