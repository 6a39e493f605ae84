"""The backward of implementation="mok" on CPU: the padded expert layout, the experts' backward reference, and
the layer's backward glue (mok_jax.layer._backward_mok) with the reference standing in for the native op, in f32
against autodiff of mok_jax.reference; at EP 2/4/8 under shard_map on host devices (and its one-device
emulation) against EP 1, bit for bit for the routed gradients. Also: the op's trace-time argument errors.
"""

from __future__ import annotations

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GRAD_NAMES, ffi_calls, random_problem, use_fused_ep_backward

import mok_jax as mj
from mok_jax import _native, reference
from mok_jax.config import ModelShape
from mok_jax.expert_layout import gather_rows, padded_layout
from mok_jax.ops import experts_backward, experts_backward_ep
from mok_jax.ops.moe_backward import (
    EXPERTS_BACKWARD_GROUP_ALIGN,
    EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP,
    EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW,
    EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP,
)
from mok_jax.reference import experts_backward_reference
from mok_jax.weights import MoEWeights

moe_mod = importlib.import_module("mok_jax.layer")

# Both sides are fp32 math on the same inputs at matmul precision "highest"; they differ only in the order of
# the sums (per-slot rows summed after the matmul, other GEMM blockings), which a gate or up value near 0 (a
# cancelling sum) magnifies in its h: up to ~1e-5 of a row seen, 10x margin; a wrong row or slot is O(1).
TOL_F32_ROW = 1e-4
# A row (or scalar) far smaller than the array's rms row norm carries the absolute fp32 noise of its inputs, not
# a relative one: d down's row i of an h_i near 0 (a cancelling gate or up sum), a weight gradient (a dot product
# that cancels). Such rows are held to the bound of a row of 1e-2 x the rms, i.e. 1e-6 x rms; a wrong row is
# O(rms), 1e6x over that.
TOL_F32_FLOOR = 1e-2
# The bf16 layer through the real custom_vjp (forward xla, backward the glue) against the xla path's bf16
# gradients (dx and the weights'): each rounds its own intermediates to bf16 (the glue per slot row, the xla
# VJP per cotangent), so they differ by a few bf16 roundings of a row: 8 ulps of 2^-8.
TOL_BF16_ROW = 8 * 2.0**-8

# The shared expert's bf16 backward against the f32 VJP on the same inputs: it rounds dgu (before dx and d
# shared_gate_up), h (before d shared_down) and the weight gradients to bf16, at most 2^-9 of an element each; two
# roundings on a row's way, 2^-8, and 2x margin (a wrong row is O(1)). Rows far below the rms row norm (a small h
# column, a cancelling sum over tokens) carry the absolute error of their terms: floor 1/4 of the rms.
TOL_BF16_SHARED_ROW = 2 * 2.0**-8
TOL_BF16_SHARED_FLOOR = 0.25

HI = functools.partial(jax.default_matmul_precision, "highest")


def _shape(E, H, I, k, Is=None) -> ModelShape:
    Is = I if Is is None else Is
    return ModelShape(name="t", num_experts=E, top_k=k, hidden_size=H, intermediate_size=I,
                      num_shared_experts=1 if Is else 0, shared_intermediate_size=Is)


def _assert_rows_close(case, got, want, tol, floor=TOL_F32_FLOOR):
    """Row by row (leading axis): ||got_r - want_r|| <= tol * max(||want_r||, floor * rms row norm)."""
    got = np.asarray(got, np.float64).reshape(len(got), -1)
    want = np.asarray(want, np.float64).reshape(len(want), -1)
    assert got.shape == want.shape, f"{case}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{case}: NaN/Inf in rows {np.where(~np.isfinite(got).all(1))[0][:8].tolist()}"
    norm = np.linalg.norm(want, axis=1)
    rms = np.sqrt(np.mean(norm**2)) if norm.size else 0.0
    bound = tol * np.maximum(norm, floor * rms)
    err = np.linalg.norm(got - want, axis=1)
    bad = np.where(err > bound)[0]
    assert bad.size == 0, (f"{case}: {bad.size} of {len(err)} rows over the bound, e.g. rows {bad[:6].tolist()}: "
                           f"err {err[bad[:6]].tolist()} > bound {bound[bad[:6]].tolist()}")


# ----------------------------------------------------------------------------- the padded layout


def _check_layout(idx, num_experts, block=128):
    idx = np.asarray(idx)
    T, k = idx.shape
    lay = jax.jit(padded_layout, static_argnums=(1, 2))(jnp.asarray(idx), num_experts, block)
    pos, src_token, src_slot, sizes = (np.asarray(a) for a in lay)
    M = T * k + block * num_experts
    assert pos.shape == (T, k) and src_token.shape == (M,) and src_slot.shape == (M,) and lay.num_rows == M
    assert sizes.dtype == np.int32 and pos.dtype == np.int32 and src_token.dtype == np.int32
    valid = (idx >= 0) & (idx < num_experts)
    counts = np.bincount(idx[valid], minlength=num_experts)
    assert (sizes % block == 0).all() and (sizes >= counts).all() and (sizes - counts < block).all()
    assert sizes.sum() <= M
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    assert (pos[~valid] == M).all(), "masked and invalid slots get no row"
    for e in range(num_experts):  # expert e's slots, in (t, j) order, fill the head of its group
        slots = np.flatnonzero(valid.reshape(-1) & (idx.reshape(-1) == e))
        np.testing.assert_array_equal(pos.reshape(-1)[slots], starts[e] + np.arange(len(slots)))
    t, j = np.nonzero(valid)
    rows = pos[t, j]
    assert len(np.unique(rows)) == len(rows)
    np.testing.assert_array_equal(src_token[rows], t)  # src is the inverse of pos
    np.testing.assert_array_equal(src_slot[rows], t * k + j)
    unused = np.ones(M, bool)
    unused[rows] = False
    assert (src_token[unused] == -1).all() and (src_slot[unused] == -1).all()
    return lay


@pytest.mark.parametrize("case", ["random", "masked_invalid", "one_expert", "empty_experts", "one_token", "k10"])
def test_padded_layout(case):
    rng = np.random.default_rng(len(case))
    E, T, k = 8, 300, 4
    if case == "k10":
        E, k = 16, 10
    if case == "one_token":
        T = 1
    idx = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    if case == "masked_invalid":
        idx[rng.random(idx.shape) < 0.3] = -1
        idx[:5] = -1
        idx[7, 1], idx[9, 0], idx[11, 3] = E, E + 40, -7
    elif case == "one_expert":
        idx[:, 0], idx[:, 1:] = 3, -1
    elif case == "empty_experts":
        idx = idx % 3  # experts 3.. get nothing (ids may repeat in a row: the layout does not care)
    lay = _check_layout(idx, E)
    if case == "one_expert":
        assert np.asarray(lay.group_sizes).tolist() == [0, 0, 0, 384, 0, 0, 0, 0]
    if case == "empty_experts":
        assert not np.asarray(lay.group_sizes)[3:].any()


def test_padded_layout_small_blocks_and_errors():
    _check_layout(np.array([[0, 2], [2, -1], [5, 0], [1, 3]], np.int32), 4, block=4)
    _check_layout(np.full((3, 2), -1, np.int32), 4, block=8)
    with pytest.raises(ValueError, match="topk_idx must be rank 2"):
        padded_layout(jnp.zeros((4,), jnp.int32), 4)
    with pytest.raises(TypeError, match="topk_idx must be an integer array"):
        padded_layout(jnp.zeros((4, 2), jnp.float32), 4)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        padded_layout(jnp.zeros((4, 2), jnp.int32), 0)
    with pytest.raises(ValueError, match="block must be a positive int"):
        padded_layout(jnp.zeros((4, 2), jnp.int32), 4, block=True)


def test_padded_layout_lowers_without_a_loop():
    """No while loop in the layout (its binary searches unrolled): on the GPU each step of a loop is a few launches
    of tiny kernels, about 130 for the bench shapes, and the device idles between them."""
    text = jax.jit(lambda i: padded_layout(i, 12)).lower(jax.ShapeDtypeStruct((2048, 8), jnp.int32)).as_text()
    assert "stablehlo.while" not in text


def _ffi_targets(jaxpr) -> list[str]:
    """The target of every ffi_call in ``jaxpr``, nested jaxprs included."""
    return [eqn.params["target_name"] for _, eqn in ffi_calls(jaxpr)]


def test_op_layout_is_rank_layout_when_the_native_layout_is_switched_off(monkeypatch):
    """MOK_JAX_NATIVE_LAYOUT=0: op_layout is rank_layout itself, no ffi_call traced; unset (the default) or 1, the
    native op's branch is traced wherever the library is loaded."""
    idx = jnp.asarray(np.random.default_rng(12).integers(-1, 9, size=(64, 2)), jnp.int32)
    want = ["mok_expert_layout"] if _native.loaded() else []
    for value, targets in ((None, want), ("1", want), ("0", [])):
        if value is None:
            monkeypatch.delenv(moe_mod.NATIVE_LAYOUT_ENV, raising=False)
        else:
            monkeypatch.setenv(moe_mod.NATIVE_LAYOUT_ENV, value)
        jaxpr = jax.make_jaxpr(lambda i, r: moe_mod.op_layout(i, 3, r))(idx, jnp.int32(1)).jaxpr
        assert _ffi_targets(jaxpr) == targets, value


def test_op_layout_on_cpu_is_rank_layout(monkeypatch):
    """The layer's layout (op_layout, the default: the native op on CUDA, rank_layout elsewhere) gives
    rank_layout's arrays on this CPU, with the rank given as an int or traced; where the native library is loaded the
    op's branch is traced too, but only rank_layout is lowered for the CPU (no custom call), so nothing here needs the
    handler."""
    monkeypatch.setenv(moe_mod.NATIVE_LAYOUT_ENV, "1")
    rng = np.random.default_rng(11)
    ep, L = 4, 5
    idx = jnp.asarray(rng.integers(-1, ep * L + 2, size=(4 * 37, 3)), jnp.int32)
    for r in range(ep):
        want = moe_mod.rank_layout(idx, L, r)
        for got in (moe_mod.op_layout(idx, L, r), jax.jit(moe_mod.op_layout, static_argnums=1)(idx, L, jnp.int32(r))):
            for name, a, b in zip(want._fields, got, want):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"rank {r}: {name}")
    jaxpr = jax.make_jaxpr(lambda i, r: moe_mod.op_layout(i, L, r))(idx, jnp.int32(1)).jaxpr
    assert _ffi_targets(jaxpr) == (["mok_expert_layout"] if _native.loaded() else [])
    text = jax.jit(lambda i, r: moe_mod.op_layout(i, L, r)).lower(idx, jnp.int32(1)).as_text()
    assert "custom_call" not in text


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("k", [4, 0])
def test_op_layout_under_shard_map_varies_as_rank_layout(cpu_devices, check_vma, k, monkeypatch):
    """Inside shard_map over 8 ranks, each rank's op_layout of the all-gathered ids (rank = axis_index) and of its
    own ids (rank 0, a constant, as at EP 1) traces, has rank_layout's types, manual axes included (an ffi_call's
    results vary over none: the op's branch marks them as rank_layout's, and its operands varying alike), and gives
    rank_layout's arrays; with no slots too (k = 0: rank_layout's arrays are then constants, varying over none)."""
    monkeypatch.setenv(moe_mod.NATIVE_LAYOUT_ENV, "1")
    from jax.sharding import NamedSharding, PartitionSpec as P

    ep, L, tokens = 8, 3, 16
    mesh = jax.make_mesh((ep,), ("ep",), devices=cpu_devices[:ep])
    rng = np.random.default_rng(k + 5)
    idx = jax.device_put(jnp.asarray(rng.integers(-1, ep * L + 1, size=(ep * tokens, k)), jnp.int32),
                         NamedSharding(mesh, P("ep")))

    def body(i):
        gathered, me = jax.lax.all_gather(i, "ep", tiled=True), jax.lax.axis_index("ep")
        pairs = ((moe_mod.op_layout(gathered, L, me), moe_mod.rank_layout(gathered, L, me)),
                 (moe_mod.op_layout(i, L, 0), moe_mod.rank_layout(i, L, 0)))
        for got, want in pairs:
            assert [jax.typeof(a) for a in got] == [jax.typeof(a) for a in want]
        return tuple(a[None] for got, want in pairs for a in (*got, *want))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"), check_vma=check_vma))
    assert _ffi_targets(jax.make_jaxpr(f)(idx).jaxpr) == (["mok_expert_layout"] * 2 if _native.loaded() else [])
    out = [np.asarray(a) for a in f(idx)]
    for got, want in ((out[0:4], out[4:8]), (out[8:12], out[12:16])):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_gather_rows_zero_fills():
    vals = jnp.arange(12.0).reshape(4, 3)
    out = gather_rows(vals, jnp.array([2, -1, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), [[6, 7, 8], [0, 0, 0], [0, 1, 2]])


# ----------------------------------------------------------------------------- the experts' backward reference


def _layout_problem(seed, T, E, k, H, I, case="random", dtype=jnp.float32):
    """Random tokens and weights, routing for ``case`` and its padded layout; returns the op's args (x, dy,
    topk_weight, pos, src_slot, group_sizes, gate_up, down) and topk_idx."""
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, H))
    dy = jax.random.normal(ks[1], (T, H))
    w = jax.random.uniform(ks[2], (T, k), minval=0.2, maxval=1.5)
    gate_up = jax.random.normal(ks[3], (E, H, 2 * I)) * H**-0.5
    down = jax.random.normal(ks[4], (E, I, H)) * I**-0.5
    idx = _routing_case(case, T, E, k, seed)
    lay = padded_layout(idx, E)
    args = (x.astype(dtype), dy.astype(dtype), w, lay.pos, lay.src_slot, lay.group_sizes, gate_up.astype(dtype),
            down.astype(dtype))
    return args, idx


def _autodiff_experts(x, dy, w, gate_up, down, idx, no_grad=None):
    """jax.vjp of y_t = sum_j w_tj swiglu_ffn(x_t; expert idx_tj) (slots with idx outside [0, E) add nothing)
    against dy, in f32: (dx, dw, d_gate_up, d_down). Slots where ``no_grad`` (bool[T, k]) is set still add to y
    and to the weights' gradients but pass nothing to dx and dw (a slot whose pos points nowhere)."""
    E = gate_up.shape[0]
    idx = jnp.asarray(idx)
    no_grad = jnp.zeros(idx.shape, bool) if no_grad is None else jnp.asarray(no_grad)

    def f(x, w, gate_up, down):
        y = jnp.zeros(x.shape, jnp.float32)
        for j in range(idx.shape[1]):
            xj = jnp.where(no_grad[:, j, None], jax.lax.stop_gradient(x), x)
            wj = jnp.where(no_grad[:, j], jax.lax.stop_gradient(w[:, j]), w[:, j])
            for e in range(E):
                ye = wj[:, None] * reference.swiglu_ffn(xj, gate_up[e], down[e])
                y = y + jnp.where((idx[:, j] == e)[:, None], ye, 0.0)
        return y

    with HI():
        _, vjp = jax.vjp(f, x, w, gate_up, down)
        return vjp(dy)


def _check_experts_backward(case, out, want, idx, E):
    dx, dw, dgu, ddn = want
    assert out.dx.dtype == jnp.float32 and out.dw.dtype == jnp.float32
    assert out.dx.shape == dx.shape and out.dw.shape == idx.shape
    _assert_rows_close(f"{case}: dx", out.dx, dx, TOL_F32_ROW)
    _assert_rows_close(f"{case}: dw", out.dw.reshape(-1, 1), dw.reshape(-1, 1), TOL_F32_ROW)
    used = np.zeros(E, bool)
    idx = np.asarray(idx)
    used[idx[(idx >= 0) & (idx < E)]] = True
    for e in range(E):
        if not used[e]:  # an empty expert: exact zeros
            assert not np.asarray(out.d_gate_up[e]).any() and not np.asarray(out.d_down[e]).any(), f"{case}: {e}"
            continue
        _assert_rows_close(f"{case}: d_gate_up[{e}]", out.d_gate_up[e], dgu[e], TOL_F32_ROW)
        _assert_rows_close(f"{case}: d_down[{e}]", out.d_down[e], ddn[e], TOL_F32_ROW)


@pytest.mark.parametrize("case,T,E,k,H,I", [
    ("random", 150, 4, 2, 64, 48),
    ("masked", 90, 8, 3, 32, 40),  # masked slots (pos = M), tokens with every slot masked
    ("empty_experts", 70, 8, 2, 24, 16),
    ("one_expert", 130, 8, 4, 16, 24),  # all tokens to expert 2: one group of 256 rows
    ("one_token", 1, 8, 3, 16, 8),
])
def test_experts_backward_reference_matches_autodiff(case, T, E, k, H, I):
    args, idx = _layout_problem(T + E, T, E, k, H, I, case)
    x, dy, w, pos, src_slot, gs, gate_up, down = args
    out = jax.jit(experts_backward_reference)(*args)
    assert int(out.status) == 0
    _check_experts_backward(case, out, _autodiff_experts(x, dy, w, gate_up, down, idx), idx, E)
    masked = np.asarray(idx) < 0
    assert not np.asarray(out.dw)[masked].any(), f"{case}: a slot without a row has dw = 0"
    assert not np.asarray(out.dx)[masked.all(1)].any(), f"{case}: a token without rows has dx = 0"


def test_experts_backward_reference_out_of_range_pos_and_src_slot():
    """pos outside [0, M), or at a row past sum(group_sizes): the slot adds nothing to dx and gets dw = 0 (its
    own row still counts for the weights); src_slot outside [-1, T k): the row is padding (as if the slot were
    masked)."""
    T, E, k = 60, 4, 2
    args, idx = _layout_problem(11, T, E, k, 32, 24)
    x, dy, w, pos, src_slot, gs, gate_up, down = args
    M = src_slot.shape[0]
    pos_np, src_np, idx_np = np.array(pos), np.array(src_slot), np.array(idx)
    no_grad = np.zeros((T, k), bool)
    assert int(np.sum(gs)) <= M - 1  # so pos = M - 1 is a row past the sum (dx_r = 0, dw_r = 0)
    for (t, j), bad in zip([(0, 0), (3, 1), (8, 0), (9, 1), (20, 0), (21, 1), (22, 0)],
                           [M, M + 7, -1, -5, 2**31 - 1, -(2**31), M - 1]):
        pos_np[t, j] = bad
        no_grad[t, j] = True
    for (t, j), bad in zip([(30, 0), (31, 1), (40, 0)], [-2, T * k, 2**31 - 1]):
        src_np[pos_np[t, j]] = bad
        idx_np[t, j] = -1  # its row is padding: as a masked slot
    out = experts_backward_reference(x, dy, w, jnp.asarray(pos_np), jnp.asarray(src_np), gs, gate_up, down)
    assert int(out.status) == 0
    want = _autodiff_experts(x, dy, w, gate_up, down, idx_np, no_grad)
    _check_experts_backward("out of range", out, want, idx_np, E)
    assert not np.asarray(out.dw)[no_grad | (idx_np < 0)].any()


def test_experts_backward_reference_bf16_roundings_and_status():
    args, idx = _layout_problem(3, 100, 2, 1, 16, 24, dtype=jnp.bfloat16)
    out = experts_backward_reference(*args)
    assert (out.dx.dtype, out.dw.dtype, out.d_gate_up.dtype, out.d_down.dtype) == (jnp.float32, jnp.float32,
                                                                                  jnp.bfloat16, jnp.bfloat16)
    # k = 1: each token's dx is its one slot's row, rounded to bf16 before the f32 sum
    dx = np.asarray(out.dx)
    np.testing.assert_array_equal(dx, np.asarray(out.dx.astype(jnp.bfloat16).astype(jnp.float32)))
    assert np.abs(dx).max() > 0
    x, dy, w, pos, src_slot, gs, gu, dn = args
    M = src_slot.shape[0]  # 100 + 2 * 128 = 356
    for sizes, bits in (([128, -128], EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP),
                        ([256, 128], EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW),
                        ([128, 100], EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP),
                        ([-28, M + 100], EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP | EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW
                         | EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP)):
        bad = experts_backward_reference(x, dy, w, pos, src_slot, jnp.asarray(sizes, jnp.int32), gu, dn)
        assert int(bad.status) == bits, sizes
        assert not np.asarray(bad.dx).any() and not np.asarray(bad.dw).any()
        assert np.isnan(np.asarray(bad.d_gate_up, np.float32)).all()  # as the kernel: NaN weight gradients
        assert np.isnan(np.asarray(bad.d_down, np.float32)).all()


# ----------------------------------------------------------------------------- the op's argument checks


E_, T_, K_, H_, I_ = 3, 100, 2, 64, 32
M_ = T_ * K_ + 128 * E_


def _op_args(**over):
    bf = jnp.bfloat16
    a = dict(x=jnp.ones((T_, H_), bf), dy=jnp.ones((T_, H_), bf), topk_weight=jnp.ones((T_, K_), jnp.float32),
             pos=jnp.zeros((T_, K_), jnp.int32), src_slot=jnp.full((M_,), -1, jnp.int32),
             group_sizes=jnp.array([128, 128, 128], jnp.int32), gate_up=jnp.ones((E_, H_, 2 * I_), bf),
             down=jnp.ones((E_, I_, H_), bf))
    a.update(over)
    return a


@pytest.mark.parametrize("over,exc,match", [
    (dict(x=jnp.ones((T_, H_, 1), jnp.bfloat16)), ValueError, "x must be rank 2"),
    (dict(dy=jnp.ones((T_,), jnp.bfloat16)), ValueError, "dy must be rank 2"),
    (dict(topk_weight=jnp.ones((T_ * K_,), jnp.float32)), ValueError, "topk_weight must be rank 2"),
    (dict(pos=jnp.ones((T_ * K_,), jnp.int32)), ValueError, "pos must be rank 2"),
    (dict(src_slot=jnp.ones((M_, 1), jnp.int32)), ValueError, "src_slot must be rank 1"),
    (dict(group_sizes=jnp.ones((E_, 1), jnp.int32)), ValueError, "group_sizes must be rank 1"),
    (dict(gate_up=jnp.ones((H_, 2 * I_), jnp.bfloat16)), ValueError, "gate_up must be rank 3"),
    (dict(down=jnp.ones((I_, H_), jnp.bfloat16)), ValueError, "down must be rank 3"),
    (dict(x=jnp.ones((T_, H_), jnp.float32)), TypeError, "x must be bfloat16"),
    (dict(dy=jnp.ones((T_, H_), jnp.float32)), TypeError, "dy must be bfloat16"),
    (dict(topk_weight=jnp.ones((T_, K_), jnp.bfloat16)), TypeError, "topk_weight must be float32"),
    (dict(pos=jnp.ones((T_, K_), jnp.int16)), TypeError, "pos must be int32"),
    (dict(src_slot=jnp.ones((M_,), jnp.uint32)), TypeError, "src_slot must be int32"),
    (dict(group_sizes=jnp.ones((E_,), jnp.uint32)), TypeError, "group_sizes must be int32"),
    (dict(gate_up=jnp.ones((E_, H_, 2 * I_), jnp.float32)), TypeError, "gate_up must be bfloat16"),
    (dict(down=jnp.ones((E_, I_, H_), jnp.float16)), TypeError, "down must be bfloat16"),
    (dict(dy=jnp.ones((T_ - 1, H_), jnp.bfloat16)), ValueError, "dy must be"),
    (dict(topk_weight=jnp.ones((T_ + 1, K_), jnp.float32)), ValueError, "topk_weight must be"),
    (dict(pos=jnp.ones((T_, K_ + 1), jnp.int32)), ValueError, "pos must be"),
    (dict(src_slot=jnp.ones((0,), jnp.int32)), ValueError, "src_slot: the number of rows M must be at least 1"),
    (dict(topk_weight=jnp.ones((T_, 0), jnp.float32), pos=jnp.ones((T_, 0), jnp.int32)), ValueError,
     "at least 1"),
    (dict(topk_weight=jnp.ones((T_, 33), jnp.float32), pos=jnp.ones((T_, 33), jnp.int32)), ValueError,
     "k must be at most 32"),
    (dict(gate_up=jnp.ones((E_ + 1, H_, 2 * I_), jnp.bfloat16)), ValueError, "gate_up must be"),
    (dict(gate_up=jnp.ones((E_, H_ + 8, 2 * I_), jnp.bfloat16)), ValueError, "gate_up must be"),
    (dict(gate_up=jnp.ones((E_, H_, 2 * I_ + 1), jnp.bfloat16)), ValueError, "gate_up must be"),
    (dict(down=jnp.ones((E_, I_ + 8, H_), jnp.bfloat16)), ValueError, "down must be"),
    (dict(x=jnp.ones((T_, 60), jnp.bfloat16), dy=jnp.ones((T_, 60), jnp.bfloat16),
          gate_up=jnp.ones((E_, 60, 2 * I_), jnp.bfloat16), down=jnp.ones((E_, I_, 60), jnp.bfloat16)),
     ValueError, "multiple of 8"),
    (dict(gate_up=jnp.ones((E_, H_, 24), jnp.bfloat16), down=jnp.ones((E_, 12, H_), jnp.bfloat16)),
     ValueError, "multiple of 8"),
    (dict(group_sizes=jnp.ones((1025,), jnp.int32), gate_up=jnp.ones((1025, H_, 16), jnp.bfloat16),
          down=jnp.ones((1025, 8, H_), jnp.bfloat16)), ValueError, "1024"),
    (dict(shared_gate_up=jnp.ones((H_, 32), jnp.bfloat16)), ValueError, "shared_gate_up and shared_down come together"),
    (dict(shared_down=jnp.ones((16, H_), jnp.bfloat16)), ValueError, "shared_gate_up and shared_down come together"),
    (dict(shared_gate_up=jnp.ones((H_, 32), jnp.float32), shared_down=jnp.ones((16, H_), jnp.bfloat16)), TypeError,
     "shared_gate_up must be bfloat16"),
    (dict(shared_gate_up=jnp.ones((H_ + 8, 32), jnp.bfloat16), shared_down=jnp.ones((16, H_), jnp.bfloat16)),
     ValueError, "shared_gate_up must be"),
    (dict(shared_gate_up=jnp.ones((H_, 32), jnp.bfloat16), shared_down=jnp.ones((24, H_), jnp.bfloat16)),
     ValueError, "shared_down must be"),
    (dict(shared_gate_up=jnp.ones((H_, 24), jnp.bfloat16), shared_down=jnp.ones((12, H_), jnp.bfloat16)),
     ValueError, "multiple of 8"),
])
def test_op_rejects_bad_arguments_naming_them(over, exc, match):
    with pytest.raises(exc, match=match):
        experts_backward(**_op_args(**over))
    with pytest.raises(exc, match=match):  # at trace time under jit too
        jax.jit(lambda a: experts_backward(**a))(_op_args(**over))


def test_op_rejects_sizes_past_32_bit_offsets():
    """M * H (or M * 2I) and T * H must be below 2^31: traced through ShapeDtypeStructs, never allocated."""
    bf, sds = jnp.bfloat16, jax.ShapeDtypeStruct
    wide = dict(gate_up=sds((E_, 1024, 2 * I_), bf), down=sds((E_, I_, 1024), bf))
    rows = dict(_op_args(**wide), x=sds((T_, 1024), bf), dy=sds((T_, 1024), bf),
                src_slot=sds((2**21,), jnp.int32))  # M * H = 2^31
    tokens = dict(_op_args(**wide), x=sds((2**21, 1024), bf), dy=sds((2**21, 1024), bf),
                  topk_weight=sds((2**21, K_), jnp.float32), pos=sds((2**21, K_), jnp.int32))  # T * H = 2^31
    for a, match in ((rows, "M times H and times 2I must be below 2"), (tokens, "T times H must be below 2")):
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(lambda a: experts_backward(**a), a)


@pytest.mark.parametrize("num_sms", [0, -3, True, 2.0, "all"])
def test_op_rejects_bad_num_sms(num_sms):
    with pytest.raises(ValueError, match="num_sms"):
        experts_backward(**_op_args(), num_sms=num_sms)


def test_op_without_gpu_raises_not_falls_back():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("this machine has a GPU: the op runs (tests/test_moe_backward_gpu.py)")
    with pytest.raises(_native.NativeLibraryUnavailable, match="experts_backward"):
        experts_backward(**_op_args())


# ----------------------------------------------------------------------------- the layer's backward glue


MOK = mj.MoEConfig(implementation="mok", keep="nothing")  # the recompute's glue (tests/test_keep.py: the kept paths)


def _glue_grads(x, idx, w, W, dy, config=MOK):
    res = moe_mod.MoEResiduals(x, idx, w, W)
    with HI():
        return jax.jit(lambda r, dy: moe_mod._backward_mok(config, r, dy, experts_fn=experts_backward_reference))(
            res, dy)


def _reference_grads(x, idx, w, W, dy):
    with HI():
        _, vjp = jax.vjp(lambda x, w, W: reference.moe(x, idx, w, W), x, w, W)
        return vjp(dy)


def _routing_case(case, T, E, k, seed):
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    if case == "masked":
        idx[rng.random(idx.shape) < 0.3] = -1
        idx[: min(3, T)] = -1  # tokens with every slot masked
    elif case == "one_expert":
        idx[:, 0], idx[:, 1:] = 2, -1
    elif case == "empty_experts":  # experts 4.. get nothing
        idx = np.stack([rng.permutation(4)[:k] for _ in range(T)]).astype(np.int32)
    return jnp.asarray(idx)


def _check_glue(case, x, idx, w, W, dy):
    dx, d_idx, dw, dW = _glue_grads(x, idx, w, W, dy)
    rdx, rdw, rdW = _reference_grads(x, idx, w, W, dy)
    assert d_idx.dtype == jax.dtypes.float0 and d_idx.shape == idx.shape
    assert dx.dtype == x.dtype and dw.dtype == jnp.float32
    _assert_rows_close(f"{case}: dx", dx, rdx, TOL_F32_ROW)
    _assert_rows_close(f"{case}: d topk_weight", dw, rdw, TOL_F32_ROW)
    masked = np.asarray(idx) < 0
    assert not np.asarray(dw)[masked].any(), f"{case}: a masked slot's weight gradient must be 0"
    used = np.zeros(W.num_local_experts, bool)
    used[np.asarray(idx)[~masked]] = True
    for e in range(W.num_local_experts):
        if not used[e]:  # exact zeros for an expert no slot reached
            assert not np.asarray(dW.gate_up[e]).any() and not np.asarray(dW.down[e]).any(), f"{case}: expert {e}"
            continue
        _assert_rows_close(f"{case}: d gate_up[{e}]", dW.gate_up[e], rdW.gate_up[e], TOL_F32_ROW)
        _assert_rows_close(f"{case}: d down[{e}]", dW.down[e], rdW.down[e], TOL_F32_ROW)
    if W.shared_gate_up is None:
        assert dW.shared_gate_up is None and dW.shared_down is None
    else:
        _assert_rows_close(f"{case}: d shared_gate_up", dW.shared_gate_up, rdW.shared_gate_up, TOL_F32_ROW)
        _assert_rows_close(f"{case}: d shared_down", dW.shared_down, rdW.shared_down, TOL_F32_ROW)
    return dx, dw, dW


@pytest.mark.parametrize("case,T,E,k,Is", [
    ("random", 200, 8, 3, 24),
    ("masked", 150, 8, 4, 16),
    ("one_expert", 130, 8, 4, 24),
    ("empty_experts", 90, 8, 2, 24),
    ("one_token", 1, 8, 3, 24),
    ("k10", 64, 16, 10, 24),
    ("no_shared", 100, 8, 2, 0),
])
@pytest.mark.parametrize("shared_in_op", [False, True])
def test_glue_matches_reference_autodiff(case, T, E, k, Is, shared_in_op, monkeypatch):
    """The glue with the shared expert's backward in XLA or in the op (moe._SHARED_IN_OP; here the op's
    reference) against jax.vjp of the reference layer."""
    monkeypatch.setattr(moe_mod, "_SHARED_IN_OP", shared_in_op)
    shape = _shape(E, 32, 40, k, Is)
    x, _, w, W = random_problem(shape, T, seed=T + E)
    idx = _routing_case(case, T, E, k, seed=T * k)
    w = w * jax.random.uniform(jax.random.key(7), w.shape, minval=0.5, maxval=1.5)
    dy = jax.random.normal(jax.random.key(T), x.shape)
    _check_glue(case, x, idx, w, W, dy)


def test_glue_masked_slot_weights_are_ignored_and_invalid_ids_match_xla():
    shape = _shape(8, 32, 24, 4)
    x, _, w, W = random_problem(shape, 40, seed=1)
    idx = _routing_case("masked", 40, 8, 4, seed=3)
    dy = jax.random.normal(jax.random.key(2), x.shape)
    masked = idx < 0
    got = _glue_grads(x, idx, jnp.where(masked, jnp.nan, w), W, dy)
    want = _glue_grads(x, idx, w, W, dy)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # invalid ids (under jit, where they cannot be checked): the token's output is NaN and its gradient dropped,
    # as on the xla path
    bad = idx.at[5, 1].set(8).at[9, 0].set(-4)
    dx, _, dw, dW = _glue_grads(x, bad, w, W, dy)
    with HI():
        xla = jax.jit(lambda r, dy: moe_mod._moe_bwd(mj.MoEConfig(), None, r, dy))(
            moe_mod.MoEResiduals(x, bad, w, W), dy)
    _assert_rows_close("invalid ids: dx", dx, xla[0], TOL_F32_ROW)
    _assert_rows_close("invalid ids: d topk_weight", dw, xla[2], TOL_F32_ROW)
    for e in range(8):
        _assert_rows_close("invalid ids: d gate_up", dW.gate_up[e], xla[3].gate_up[e], TOL_F32_ROW)
    assert not np.asarray(dx)[[5, 9]].any() and not np.asarray(dw)[[5, 9]].any()


def _reads_every_weight(op, weight_arg: int, out_field: str):
    """A stand-in for a kernel that reads every slot's weight, a masked slot's too (a masked slot's weight is not
    promised to be finite, so the layer must not hand it one): ``op`` (a forward or backward reference) with 0 times
    the sum of its ``weight_arg``-th argument added to its output (``out_field`` of it; None: the whole output)."""
    def run(*args, **kw):
        out = op(*args, **kw)
        poison = 0.0 * jnp.sum(args[weight_arg])
        if out_field is None:
            return out + poison.astype(out.dtype)
        field = getattr(out, out_field)
        return out._replace(**{out_field: field + poison.astype(field.dtype)})
    return run


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("poison", [jnp.nan, jnp.inf])
def test_mok_kernels_never_see_a_masked_slots_weight(monkeypatch, cpu_devices, ep, poison):
    """implementation='mok' with a NaN or inf weight in masked slots, its forward and backward ops standing in by
    references that read every slot's weight: the layer hands them 0 there, so the forward and every gradient are
    finite and the bits of the same routing with 0 in those slots (EP 1 and, through the fused op, EP 2)."""
    import mok_jax.ops
    from mok_jax.reference import experts_backward_ep_reference

    monkeypatch.setattr(moe_mod, "require_native", lambda what: None)
    monkeypatch.setattr(moe_mod, "_forward_mok", _reads_every_weight(
        lambda *a, fp8_weights=None, workspace=None: moe_mod._forward_xla(*a), 2, None))
    monkeypatch.setattr(mok_jax.ops, "experts_backward", _reads_every_weight(experts_backward_reference, 2, "dx"))
    use_fused_ep_backward(monkeypatch, ep)
    monkeypatch.setattr(mok_jax.ops, "experts_backward_ep", _reads_every_weight(
        functools.partial(experts_backward_ep_reference, axis_name="ep"), 4, "dx"))
    shape = _shape(8, 32, 24, 3, 16)
    x, _, w, W = random_problem(shape, 16, seed=ep)
    x, W = x.astype(jnp.bfloat16), jax.tree.map(lambda a: a.astype(jnp.bfloat16), W)
    idx = _routing_case("masked", 16, 8, 3, seed=ep)
    masked = np.asarray(idx) < 0
    mesh = jax.make_mesh((ep,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=cpu_devices[:ep])
    spec = jax.sharding.PartitionSpec
    cfg = mj.MoEConfig(implementation="mok", ep_axis="ep", keep="nothing")
    layer = jax.shard_map(lambda x, i, w, W: mj.moe(x, i, w, W, config=cfg), mesh=mesh, out_specs=spec("ep"),
                          in_specs=(spec("ep"), spec("ep"), spec("ep"), MoEWeights(spec("ep"), spec("ep"), spec(),
                                                                                 spec())))
    run = jax.jit(jax.value_and_grad(lambda x, w, W: jnp.sum(layer(x, idx, w, W).astype(jnp.float32) ** 2),
                                     argnums=(0, 1, 2)))
    got, want = run(x, jnp.where(masked, poison, w), W), run(x, jnp.where(masked, 0.0, w), W)
    for name, a, b in zip(("y",) + GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.isfinite(np.asarray(a, np.float32)).all(), name
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    assert not np.asarray(got[1][1])[masked].any()


def test_glue_nan_gradients_when_the_op_reports_bad_status():
    shape = _shape(4, 16, 16, 2)
    x, idx, w, W = random_problem(shape, 8, seed=0)

    def broken(*args, **kw):  # the op's contract under bad status: NaN weight gradients, dx and dw unspecified
        out = experts_backward_reference(*args, **kw)
        return out._replace(status=jnp.int32(EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW),
                            d_gate_up=jnp.full_like(out.d_gate_up, jnp.nan), d_down=jnp.full_like(out.d_down, jnp.nan))

    res = moe_mod.MoEResiduals(x, idx, w, W)
    dx, _, dw, dW = moe_mod._backward_mok(MOK, res, jnp.ones_like(x), experts_fn=broken)
    assert np.isnan(np.asarray(dx)).all() and np.isnan(np.asarray(dw)).all()
    assert np.isnan(np.asarray(dW.gate_up)).all() and np.isnan(np.asarray(dW.down)).all()


def test_through_custom_vjp_bf16(monkeypatch):
    """jax.grad of mj.moe(implementation='mok') on CPU with the xla forward and the reference experts' backward
    patched in: the custom_vjp wiring (f32 master weights get f32 gradients, a bf16 topk_weight a bf16 one, jit)
    gives the glue's own gradients bit for bit, and is near jax.grad of the xla path (both in bf16)."""
    import mok_jax.ops

    monkeypatch.setattr(moe_mod, "require_native", lambda what: None)
    monkeypatch.setattr(moe_mod, "_forward_mok", lambda *a, fp8_weights=None, workspace=None: moe_mod._forward_xla(*a))
    monkeypatch.setattr(mok_jax.ops, "experts_backward", experts_backward_reference)
    shape = _shape(8, 64, 48, 3)
    x, idx, w, W = random_problem(shape, 96, seed=5)
    x = x.astype(jnp.bfloat16)  # the weights stay f32 (master weights)
    w_bf = w.astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(9), x.shape)

    def grads(config):
        return jax.jit(jax.grad(lambda x, w, W: jnp.sum(mj.moe(x, idx, w, W, config=config).astype(jnp.float32)
                                                        * dy), argnums=(0, 1, 2)))(x, w_bf, W)

    got = grads(MOK)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16
    assert all(g.dtype == jnp.float32 for g in got[2])
    W_bf = jax.tree.map(lambda a: a.astype(jnp.bfloat16), W)
    res = moe_mod.MoEResiduals(x, idx, w_bf.astype(jnp.float32), W_bf)
    dx, _, dw, dW = jax.jit(lambda r, dy: moe_mod._backward_mok(MOK, r, dy, experts_fn=experts_backward_reference))(
        res, dy.astype(jnp.bfloat16))
    for a, b in zip(jax.tree.leaves(got), [dx, dw.astype(jnp.bfloat16), *(g.astype(jnp.float32) for g in dW)]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = grads(mj.MoEConfig())
    for name, a, b in zip(("dx", "d gate_up", "d down", "d shared_gate_up", "d shared_down"),
                          (got[0], *got[2]), (want[0], *want[2])):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        _assert_rows_close(f"bf16 {name}", a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), TOL_BF16_ROW)


def _shared_problem(T, H, Is, seed):
    """bf16 x, dy [T, H] and MoEWeights with a shared expert of Is (its routed weights unused)."""
    ks = jax.random.split(jax.random.key(seed), 4)
    bf = jnp.bfloat16
    x = jax.random.normal(ks[0], (T, H)).astype(bf)
    sgu = (jax.random.normal(ks[1], (H, 2 * Is)) * H**-0.5).astype(bf)
    sdn = (jax.random.normal(ks[2], (Is, H)) * Is**-0.5).astype(bf)
    dy = jax.random.normal(ks[3], (T, H)).astype(bf)
    return x, dy, MoEWeights(jnp.zeros((1, H, 16), bf), jnp.zeros((1, 8, H), bf), sgu, sdn)


def test_shared_backward_bf16_matches_f32_autodiff():
    """The shared expert's bf16 backward (bf16 x bf16 matmuls, f32 accumulation) against jax.vjp of
    reference.swiglu_ffn in f32 on the same (bf16-valued) inputs, row by row."""
    bf = jnp.bfloat16
    x, dy, W = _shared_problem(200, 128, 96, seed=21)
    sgu, sdn = W.shared_gate_up, W.shared_down
    dx, d_sgu, d_sdn = jax.jit(moe_mod._shared_backward)(x, W, dy)
    assert (dx.dtype, d_sgu.dtype, d_sdn.dtype) == (jnp.float32, bf, bf)
    f32 = [a.astype(jnp.float32) for a in (x, sgu, sdn, dy)]
    with HI():
        _, vjp = jax.vjp(reference.swiglu_ffn, *f32[:3])
        want = vjp(f32[3])
    for name, a, b in zip(("dx", "d shared_gate_up", "d shared_down"), (dx, d_sgu, d_sdn), want):
        _assert_rows_close(f"bf16 shared {name}", np.asarray(a, np.float32), b, TOL_BF16_SHARED_ROW,
                           floor=TOL_BF16_SHARED_FLOOR)
    jaxpr = jax.make_jaxpr(moe_mod._shared_backward)(x, W, dy)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 5 and all(v.aval.dtype == bf for e in dots for v in e.invars), dots
    assert all(e.outvars[0].aval.dtype == jnp.float32 for e in dots)
    assert moe_mod._shared_backward(x, W._replace(shared_gate_up=None, shared_down=None), dy) == (None, None, None)


def test_shared_backward_from_kept_gu_gives_the_bits_of_recompute():
    """Given the forward's kept g | u (KeptGateUp.shared_gu, as shared_gate_up_product rounds them), the shared
    expert's backward runs four matmuls instead of five and gives the bits of its recompute; a wrong kept g | u
    changes them (the kept buffer is read, not ignored)."""
    T, Is = 70, 48
    bf = jnp.bfloat16
    x, dy, W = _shared_problem(T, 64, Is, seed=22)
    gu = moe_mod.shared_gate_up_product(x, W.shared_gate_up)
    assert gu.shape == (T, 2 * Is) and gu.dtype == bf
    want = jax.jit(moe_mod._shared_backward)(x, W, dy)
    got = jax.jit(moe_mod._shared_backward)(x, W, dy, gu)
    for name, a, b in zip(("dx", "d shared_gate_up", "d shared_down"), got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    other = jax.jit(moe_mod._shared_backward)(x, W, dy, gu.at[3].multiply(2))
    assert not np.array_equal(np.asarray(other[0][3]), np.asarray(want[0][3])), "the kept g, u were not read"
    dots = [e for e in jax.make_jaxpr(moe_mod._shared_backward)(x, W, dy, gu).jaxpr.eqns
            if e.primitive.name == "dot_general"]
    assert len(dots) == 4 and all(v.aval.dtype == bf for e in dots for v in e.invars), dots


# ----------------------------------------------------------------------------- EP sizes


def _ep_grads(monkeypatch, mesh, x, idx, w, W, dy, check_vma=True, fused=False):
    """jax.grad of mj.moe(implementation='mok') inside shard_map over mesh axis 'ep' (tokens and experts split
    over it, the shared expert replicated), with the xla forward and the reference experts' backward patched in
    (this machine has no GPU): the expert-parallel backward's collectives and layouts, as on the GPU. At EP > 1 the
    fused op's reference stands in for it (experts_backward_ep_reference: collectives over the mesh axis where the
    kernel moves rows over NVLink)."""
    import mok_jax.ops

    monkeypatch.setattr(moe_mod, "require_native", lambda what: None)
    monkeypatch.setattr(moe_mod, "_forward_mok", lambda *a, fp8_weights=None, workspace=None: moe_mod._forward_xla(*a))
    monkeypatch.setattr(mok_jax.ops, "experts_backward", experts_backward_reference)
    use_fused_ep_backward(monkeypatch, mesh.shape["ep"], fused)
    spec = jax.sharding.PartitionSpec
    cfg = mj.MoEConfig(implementation="mok", ep_axis="ep", keep="nothing")
    wspec = MoEWeights(spec("ep"), spec("ep"), spec(), spec())
    specs = (spec("ep"), spec("ep"), spec("ep"), wspec, spec("ep"))

    def loss(x, idx, w, W, dy):
        y = jax.shard_map(lambda x, i, w, W: mj.moe(x, i, w, W, config=cfg), mesh=mesh, in_specs=specs[:4],
                          out_specs=spec("ep"), check_vma=check_vma)(x, idx, w, W)
        return jnp.sum(y.astype(jnp.float32) * dy)

    args = jax.tree.map(lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s)), (x, idx, w, W, dy),
                        specs)
    with HI():
        return jax.jit(jax.grad(loss, argnums=(0, 2, 3)))(*args)


@pytest.mark.parametrize("ep,check_vma,fused", [(1, True, False), (2, True, False), (4, False, False), (8, True, False),
                                               (2, True, True), (4, False, True), (8, True, True)])
def test_ep_backward_gives_the_routed_bits_of_ep_one(monkeypatch, cpu_devices, ep, check_vma, fused):
    """The expert-parallel backward (all-gather, each rank's op on its experts' slots, reduce-scatter home, slot
    sum there; or fused: the routing all-gathered, the fused op's reference per rank) against EP size 1 in bf16:
    dx, the router-weight and the routed weights' gradients bit for bit (every slot has one owner, the layouts keep
    global slot order); the shared expert's weight gradients are sums of per-rank bf16 gradients, within a few
    bf16 roundings of the one-rank gradient."""
    shape = _shape(8, 32, 24, 3, 16)
    x, _, w, W = random_problem(shape, 64, seed=ep)
    x, W = x.astype(jnp.bfloat16), jax.tree.map(lambda a: a.astype(jnp.bfloat16), W)
    idx = _routing_case("masked", 64, 8, 3, seed=ep + 1)
    dy = jax.random.normal(jax.random.key(ep), x.shape).astype(jnp.bfloat16)
    one = _ep_grads(monkeypatch, jax.make_mesh((1,), ("ep",), devices=cpu_devices[:1]), x, idx, w, W, dy)
    got = _ep_grads(monkeypatch, jax.make_mesh((ep,), ("ep",), devices=cpu_devices[:ep]), x, idx, w, W, dy,
                    check_vma=check_vma, fused=fused)
    (dx, dw, dW), (dx1, dw1, dW1) = got, one
    for name, a, b in (("dx", dx, dx1), ("d topk_weight", dw, dw1), ("d gate_up", dW.gate_up, dW1.gate_up),
                       ("d down", dW.down, dW1.down)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=f"EP {ep}: {name}")
    assert not np.asarray(dw)[np.asarray(idx) < 0].any()
    for name, a, b in (("d shared_gate_up", dW.shared_gate_up, dW1.shared_gate_up),
                       ("d shared_down", dW.shared_down, dW1.shared_down)):
        # ep per-rank roundings to bf16 and one more of their sum: at most (ep + 1) half-ulps of the sum, and
        # 2^-8 relative per half-ulp; per row
        _assert_rows_close(f"EP {ep}: {name}", a, b, (ep + 1) * 2.0**-8)


@pytest.mark.parametrize("ep", [2, 8])
def test_emulated_ep_backward_equals_shard_map(monkeypatch, cpu_devices, ep):
    """mok_jax.emulation.emulated_moe_backward (every rank on one device) with the reference op gives the bits of
    the shard_map backward over ep devices for the routed gradients, and its shared ones within the same bound."""
    from mok_jax.emulation import emulated_moe_backward

    shape = _shape(8, 32, 24, 3, 16)
    x, _, w, W = random_problem(shape, 48, seed=ep + 3)
    x, W = x.astype(jnp.bfloat16), jax.tree.map(lambda a: a.astype(jnp.bfloat16), W)
    idx = _routing_case("masked", 48, 8, 3, seed=ep)
    dy = jax.random.normal(jax.random.key(ep), x.shape).astype(jnp.bfloat16)
    want = _ep_grads(monkeypatch, jax.make_mesh((ep,), ("ep",), devices=cpu_devices[:ep]), x, idx, w, W, dy)
    with HI():
        got = jax.jit(functools.partial(emulated_moe_backward, ep=ep, experts_fn=experts_backward_reference))(
            x, idx, w, W, dy)
    (dx, dw, dW), (dx1, dw1, dW1) = got, want
    for name, a, b in (("dx", dx, dx1), ("d topk_weight", dw, dw1), ("d gate_up", dW.gate_up, dW1.gate_up),
                       ("d down", dW.down, dW1.down)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    for name, a, b in (("d shared_gate_up", dW.shared_gate_up, dW1.shared_gate_up),
                       ("d shared_down", dW.shared_down, dW1.shared_down)):
        _assert_rows_close(f"EP {ep}: {name}", a, b, (ep + 1) * 2.0**-8)


@pytest.mark.parametrize("ep", [2, 4])
def test_emulated_fused_ep_backward_glue(monkeypatch, cpu_devices, ep):
    """emulated_moe_backward(fused=True) with the fused op's reference in the op's place (no GPU here): its
    per-rank stacking of x, dy, ids, the layouts and the broadcast router weights, and its unstacking of the
    results, give the bits of the collectives path (fused=False) for every gradient; return_status gives the
    op's int32[ep] status."""
    from mok_jax.emulation import emulated_moe_backward
    from mok_jax.reference import experts_backward_ep_reference

    emu = importlib.import_module("mok_jax.emulation")
    monkeypatch.setattr(emu, "require_native", lambda what: None)
    monkeypatch.setattr(emu.ops, "experts_backward_ep", experts_backward_ep_reference)
    shape = _shape(8, 32, 24, 3, 16)
    x, _, w, W = random_problem(shape, 16 * ep, seed=ep + 7)
    x, W = x.astype(jnp.bfloat16), jax.tree.map(lambda a: a.astype(jnp.bfloat16), W)
    idx = _routing_case("masked", 16 * ep, 8, 3, seed=ep + 2)
    dy = jax.random.normal(jax.random.key(ep + 5), x.shape).astype(jnp.bfloat16)
    ws = _stand_in_workspace(ep=ep, T=16, H=32, k=3, E=8)
    with HI():
        *got, status = jax.jit(functools.partial(emulated_moe_backward, ep=ep, fused=True, workspace=ws,
                                                 device=cpu_devices[0], return_status=True))(x, idx, w, W, dy)
        want = jax.jit(functools.partial(emulated_moe_backward, ep=ep, experts_fn=experts_backward_reference))(
            x, idx, w, W, dy)
    assert np.asarray(status).shape == (ep,) and not np.asarray(status).any()
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=f"leaf {i}")
    with pytest.raises(ValueError, match="experts_fn replaces the op"):
        emulated_moe_backward(x, idx, w, W, dy, ep=ep, fused=True, experts_fn=experts_backward_reference)
    with pytest.raises(ValueError, match="pass fused=True"):
        emulated_moe_backward(x, idx, w, W, dy, ep=ep, fused=False, skip_rank=1)


def test_emulated_ep_backward_rejects_bad_arguments():
    from mok_jax.emulation import emulated_moe_backward

    x, idx, w, W = random_problem(_shape(8, 32, 24, 2), 12, seed=0)
    with pytest.raises(ValueError, match="ep must be"):
        emulated_moe_backward(x, idx, w, W, x, ep=0, experts_fn=experts_backward_reference)
    with pytest.raises(ValueError, match="divisible by ep=5"):
        emulated_moe_backward(x, idx, w, W, x, ep=5, experts_fn=experts_backward_reference)
    with pytest.raises(ValueError, match="dy must have x's shape"):
        emulated_moe_backward(x, idx, w, W, x[:4], ep=2, experts_fn=experts_backward_reference)


# ----------------------------------------------------------------------------- what reaches the handler


def _custom_call_lines(text, target):
    return [line for line in text.splitlines() if f"custom_call @{target}(" in line]


def _call_types(T, k, M, H, I, E, gu_rows, Is=0, part_rows=None):
    """The op's custom call types "(operands) -> (results)" as the contract has them: gu_in bf16[gu_rows, 2I]
    (0: none kept), gu_part, gu_part_row and its kept blocks (part_rows: None for none, else gu_part's rows) and
    the shared expert's weights ([H, 0] and [0, H] for none: Is = 0), then dx, dw, d_gate_up,
    d_down, status and the scratch x_e, dy_e, w_e, gu, dgu, hw, the dw partials, dx_e, dw_e and the s32 counters (60
    time words, then the dependency counters: 4 per m-block of at most ceil(M / 128) + E, and of the shared
    expert's ceil(Ts / 128), 2 per expert and 2 for the shared one, 5 totals; a multiple of 4), then d_shared_gate_up,
    d_shared_down and the shared expert's scratch gus, dgus, hws, dxs (Ts = T rows with a shared expert, else 0)."""
    Ts = T if Is else 0
    part = (0, 0, 0) if part_rows is None else (part_rows, M, -(-M // 128))
    operands = (f"(tensor<{T}x{H}xbf16>, tensor<{T}x{H}xbf16>, tensor<{T}x{k}xf32>, tensor<{T}x{k}xi32>, "
                f"tensor<{M}xi32>, tensor<{E}xi32>, tensor<{E}x{H}x{2 * I}xbf16>, tensor<{E}x{I}x{H}xbf16>, "
                f"tensor<{gu_rows}x{2 * I}xbf16>, tensor<{part[0]}x{2 * I}xbf16>, tensor<{part[1]}xi32>, "
                f"tensor<{part[2]}xi32>, tensor<{H}x{2 * Is}xbf16>, tensor<{Is}x{H}xbf16>)")
    counters = -(-(60 + 4 * (-(-M // 128) + E + -(-Ts // 128)) + 2 * (E + 1) + 5) // 4) * 4  # 60 time words
    results = (f"(tensor<{T}x{H}xf32>, tensor<{T}x{k}xf32>, tensor<{E}x{H}x{2 * I}xbf16>, "
               f"tensor<{E}x{I}x{H}xbf16>, tensor<i32>, tensor<{M}x{H}xbf16>, tensor<{M}x{H}xbf16>, "
               f"tensor<{M}xf32>, tensor<{M}x{2 * I}xbf16>, tensor<{M}x{2 * I}xbf16>, tensor<{M}x{I}xbf16>, "
               f"tensor<{M}x{-(-I // 256)}xf32>, tensor<{M}x{H}xbf16>, tensor<{M}xf32>, tensor<{counters}xi32>, "
               f"tensor<{H}x{2 * Is}xbf16>, tensor<{Is}x{H}xbf16>, tensor<{Ts}x{2 * Is}xbf16>, "
               f"tensor<{Ts}x{2 * Is}xbf16>, tensor<{Ts}x{Is}xbf16>, tensor<{Ts}x{H}xf32>)")
    return operands + " -> " + results


def test_op_lowers_to_one_call_in_the_contracts_order(monkeypatch):
    """One call with the contract's operands and results (_call_types; no gu kept: gu_in bf16[0, 2I] and the
    op's scratch gu bf16[M, 2I]; ffi/src/ffi_moe_backward.cu) and num_sms as an int32 attribute (0 = every SM).
    With a kept gu: tests/test_moe_backward_kept.py."""
    mb = importlib.import_module("mok_jax.ops.moe_backward")
    monkeypatch.setattr(mb, "require_native", lambda what: None)
    T, k, M, H, I, E = 100, 3, 812, 64, 384, 4
    sds = jax.ShapeDtypeStruct
    args = (sds((T, H), jnp.bfloat16), sds((T, H), jnp.bfloat16), sds((T, k), jnp.float32), sds((T, k), jnp.int32),
            sds((M,), jnp.int32), sds((E,), jnp.int32), sds((E, H, 2 * I), jnp.bfloat16),
            sds((E, I, H), jnp.bfloat16))
    for num_sms, attr in ((None, 0), (20, 20)):
        text = jax.jit(functools.partial(mb.experts_backward, num_sms=num_sms)).lower(*args).as_text()
        [call] = _custom_call_lines(text, "mok_experts_backward")
        assert _call_types(T, k, M, H, I, E, 0) in call, call
        assert f"num_sms = {attr} : i32" in call, call


def test_grad_of_the_mok_layer_lowers_to_one_backward_call(monkeypatch):
    """jax.grad of mj.moe(implementation='mok') at EP 1: the forward megakernel and one experts' backward call
    on the tokens and a layout of T * k + 128 * E padded rows, in the contract's operand order (no gu kept here:
    gu_in is bf16[0, 2I] and the op's scratch gu bf16[M, 2I]), nothing of the xla path's dense experts, and no
    [M, H] array outside the call (the op gathers the rows and sums the slots itself). The shared expert's backward
    is five bf16 matmuls in XLA, or with moe._SHARED_IN_OP part of the same call (its weights operands too)."""
    monkeypatch.setattr(moe_mod, "require_native", lambda what: None)
    mb = importlib.import_module("mok_jax.ops.moe_backward")
    monkeypatch.setattr(mb, "require_native", lambda what: None)
    T, H, I, E, k = 40, 64, 32, 4, 2
    M = T * k + 128 * E
    monkeypatch.setattr(moe_mod, "_forward_mok", lambda x, *a, **kw: x * 2)  # the megakernel needs a workspace
    x = jax.ShapeDtypeStruct((T, H), jnp.bfloat16)
    idx = jnp.zeros((T, k), jnp.int32).at[:, 1].set(1)
    w = jnp.ones((T, k), jnp.float32)
    W = MoEWeights(jnp.ones((E, H, 2 * I), jnp.bfloat16), jnp.ones((E, I, H), jnp.bfloat16),
                   jnp.ones((H, 2 * I), jnp.bfloat16), jnp.ones((I, H), jnp.bfloat16))
    f = jax.jit(jax.grad(lambda x, w, W: jnp.sum(mj.moe(x, idx, w, W, config=MOK).astype(jnp.float32)),
                         argnums=(0, 1, 2)))
    for in_op in (False, True):  # the shared expert's backward in XLA (the default) or in the same call
        monkeypatch.setattr(moe_mod, "_SHARED_IN_OP", in_op)
        text = f.lower(x, w, W).as_text() if not in_op else jax.jit(jax.grad(
            lambda x, w, W: jnp.sum(mj.moe(x, idx, w, W, config=MOK).astype(jnp.float32)),
            argnums=(0, 1, 2))).lower(x, w, W).as_text()
        [call] = _custom_call_lines(text, "mok_experts_backward")
        assert _call_types(T, k, M, H, I, E, 0, Is=I if in_op else 0) in call, call
        elsewhere = [line for line in text.splitlines() if f"tensor<{M}x{H}x" in line and line != call]
        assert not elsewhere, "\n".join(elsewhere[:4])
        dots = [re.search(r": \((tensor<[^>]*>), (tensor<[^>]*>)\) ->", line) for line in text.splitlines()
                if "stablehlo.dot_general" in line]
        # the shared expert's XLA backward: gu, dh, dx, d shared_down, d shared_gate_up, bf16 x bf16
        assert len(dots) == (0 if in_op else 5), len(dots)
        assert all(m and m[1].endswith("xbf16>") and m[2].endswith("xbf16>") for m in dots), [m and m[0] for m in dots]


def test_cotangents_take_their_primals_manual_axes():
    """Inside shard_map (check_vma on), _vary_like gives an unvarying value (what an ffi_call returns) its
    primal's varying axis, and sums a varying gradient of a replicated primal over the axis: what a custom_vjp
    needs of the mok backward under expert_parallel_moe."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])

    def body(x, w):
        unvarying = jnp.ones((4,), jnp.float32)  # a constant: varies over no axis, like an ffi_call's output
        a = moe_mod._vary_like(unvarying, x)  # x is sharded over ep: varying
        b = moe_mod._vary_like(x * 2.0, w)  # w is replicated: the varying value is summed over ep
        assert moe_mod._manual_axes(a) == moe_mod._manual_axes(x) == frozenset({"ep"})
        assert moe_mod._manual_axes(b) == moe_mod._manual_axes(w) == frozenset()
        return a, b

    a, b = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P()), out_specs=(P("ep"), P()),
                                 check_vma=True))(jnp.arange(4.0), jnp.zeros((4,)))
    np.testing.assert_array_equal(np.asarray(a), np.ones(4))
    np.testing.assert_array_equal(np.asarray(b), 2.0 * np.arange(4.0))


# ----------------------------------------------------------------------------- the fused expert-parallel op


def _ep_op_args(R=2, T=24, H=32, I=24, L=2, k=3, seed=0):
    """Arguments of mok_jax.ops.experts_backward_ep for R = EP ranks (the emulated form), each rank's layout of
    its experts' slots over every rank's tokens (mok_jax.layer.rank_layout)."""
    rng = np.random.default_rng(seed)
    E, N = R * L, R * T
    ids = np.stack([rng.permutation(E)[:k] for _ in range(N)]).astype(np.int32)
    ids[rng.random(ids.shape) < 0.2] = -1
    ids = jnp.asarray(ids)
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (N, H)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[1], (N, H)).astype(jnp.bfloat16)
    w = jax.random.uniform(keys[2], (N, k), jnp.float32, 0.2, 1.0)
    gate_up = (jax.random.normal(keys[3], (E, H, 2 * I)) * H**-0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(keys[4], (E, I, H)) * I**-0.5).astype(jnp.bfloat16)
    layouts = [moe_mod.rank_layout(ids, L, r) for r in range(R)]
    per_rank = lambda a: a.reshape(R, a.shape[0] // R, *a.shape[1:])  # noqa: E731
    args = (per_rank(x), per_rank(dy), per_rank(ids), jnp.broadcast_to(w, (R, N, k)),
            jnp.stack([lay.src_slot for lay in layouts]), jnp.stack([lay.group_sizes for lay in layouts]),
            per_rank(gate_up), per_rank(down))
    return args, (x, dy, ids, w, gate_up, down, layouts)


def test_fused_ep_op_reference_is_the_ep_one_op_per_token(cpu_devices):
    """experts_backward_ep_reference in its emulated form (every rank at once) gives, per rank, the bits of the
    EP-1 op's reference over the same global tokens and experts: dx (each token's slot rows summed in slot order),
    dw, and each rank's experts' weight gradients; and inside shard_map (one rank, collectives over the axis) the
    same bits again."""
    from mok_jax.reference import experts_backward_ep_reference

    R, T, L = 4, 24, 2
    args, (x, dy, ids, w, gate_up, down, _) = _ep_op_args(R=R, T=T, L=L, seed=3)
    with HI():
        got = experts_backward_ep_reference(None, *args)
        lay = padded_layout(ids, R * L, EXPERTS_BACKWARD_GROUP_ALIGN)
        one = experts_backward_reference(x, dy, w, lay.pos, lay.src_slot, lay.group_sizes, gate_up, down)
    np.testing.assert_array_equal(np.asarray(got.dx).reshape(R * T, -1), np.asarray(one.dx))
    np.testing.assert_array_equal(np.asarray(got.dw).reshape(R * T, -1), np.asarray(one.dw))
    np.testing.assert_array_equal(np.asarray(got.d_gate_up, np.float32).reshape(one.d_gate_up.shape),
                                  np.asarray(one.d_gate_up, np.float32))
    np.testing.assert_array_equal(np.asarray(got.d_down, np.float32).reshape(one.d_down.shape),
                                  np.asarray(one.d_down, np.float32))
    assert not np.asarray(got.status).any()
    mesh = jax.make_mesh((R,), ("ep",), devices=cpu_devices[:R])
    spec = jax.sharding.PartitionSpec("ep")
    inner = jax.shard_map(lambda *a: tuple(experts_backward_ep_reference(None, *a, axis_name="ep")), mesh=mesh,
                          in_specs=(spec,) * 8, out_specs=(spec,) * 5, check_vma=False)
    placed = [jax.device_put(a, jax.sharding.NamedSharding(mesh, spec)) for a in args]
    with HI():
        sharded = jax.jit(inner)(*placed)
    for name, a, b in zip(("dx", "dw", "d_gate_up", "d_down", "status"), sharded, got):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


def _stand_in_workspace(ep=2, T=24, H=32, k=3, E=4, emulated=True):
    from mok_jax.workspace import CommConfig, Workspace

    return Workspace(ws_id=11, config=CommConfig(ep=ep, max_tokens=T, hidden_size=H, top_k=k, num_experts=E),
                     mesh=None, axis_name=None, local=[], emulated=emulated)


def test_fused_ep_op_lowers_to_one_call_with_the_workspace(monkeypatch):
    """ops.experts_backward_ep lowers (no GPU: the native check is off) to one side-effecting custom call with the
    workspace id and the knobs as attributes, every operand with its leading rank axis, and with kept g, u the
    buffer aliased to its gu scratch (result 8)."""
    mb = importlib.import_module("mok_jax.ops.moe_backward")
    monkeypatch.setattr(mb, "require_native", lambda what: None)
    args, _ = _ep_op_args()
    ws = _stand_in_workspace()
    M = args[4].shape[1]
    text = jax.jit(lambda *a: experts_backward_ep(ws, *a, comm_items=5, num_sms=33)).lower(
        *args).as_text()
    [call] = [line for line in text.splitlines() if "custom_call @mok_experts_backward_ep(" in line]
    assert "has_side_effect = true" in call, call
    assert "ws_id = 11 : i64" in call and "comm_items = 5 : i32" in call and "num_sms = 33 : i32" in call, call
    assert "tensor<2x24x32xbf16>, tensor<2x24x32xbf16>, tensor<2x24x3xi32>, tensor<2x48x3xf32>" in call, call
    # results: dx, dw, d_gate_up, d_down, status, then the EP-1 op's row scratch with the rank axis in front
    # (H 32, I 24, L 2; counters: 60 time words, 4 per m-block of ceil(M / 128) + L, 2 (L + 1), 5 totals, to 4s)
    counters = -(-(60 + 4 * (-(-M // 128) + 2) + 2 * 3 + 5) // 4) * 4
    assert (f"-> (tensor<2x24x32xf32>, tensor<2x24x3xf32>, tensor<2x2x32x48xbf16>, tensor<2x2x24x32xbf16>, "
            f"tensor<2xi32>, tensor<2x{M}x32xbf16>, tensor<2x{M}x32xbf16>, tensor<2x{M}xf32>, tensor<2x{M}x48xbf16>, "
            f"tensor<2x{M}x48xbf16>, tensor<2x{M}x24xbf16>, tensor<2x{M}x1xf32>, tensor<2x{M}x32xbf16>, "
            f"tensor<2x{M}xf32>, tensor<2x{counters}xi32>)") in call, call
    gu = jnp.zeros((2, M, 48), jnp.bfloat16)
    text = jax.jit(lambda *a: experts_backward_ep(ws, *a[:-1], gu=a[-1])).lower(*args, gu).as_text()
    [call] = [line for line in text.splitlines() if "custom_call @mok_experts_backward_ep(" in line]
    assert re.search(r"output_operand_alias<output_tuple_indices = \[8\], operand_index = 8,", call), call


@pytest.mark.parametrize("change,match", [
    (lambda a: {**a, "x": a["x"][:1]}, "x carries 1 ranks"),
    (lambda a: {**a, "dy": a["dy"][:, :5]}, "dy must have x's shape"),
    (lambda a: {**a, "topk_weight": a["topk_weight"][:, :24]}, "topk_weight must be every rank's"),
    (lambda a: {**a, "topk_idx": a["topk_idx"].astype(jnp.int16)}, "topk_idx must be int32"),
    (lambda a: {**a, "group_sizes": a["group_sizes"][:, :1]}, "group_sizes must be"),
    (lambda a: {**a, "down": a["down"][:, :, :5]}, "down must be"),
    (lambda a: {**a, "comm_items": 0}, "comm_items must be an int >= 1"),
    (lambda a: {**a, "skip_rank": 2}, "skip_rank must be"),
    (lambda a: {**a, "gu_part_row": a["src_slot"]}, "gu_part and gu_part_row .* both be given or both be None"),
    # the kept g, u: the EP-1 op's checks (mok_jax.validation.check_kept_gu) with the rank axis
    (lambda a: {**a, "gu": jnp.zeros((*a["src_slot"].shape, 48), jnp.float32)},
     r"gu \(the kept g, u\) must be bfloat16\[ranks, M, 2I\] = bfloat16\[2, \d+, 48\], got float32"),
    (lambda a: {**a, "gu": jnp.zeros((1, a["src_slot"].shape[1], 48), jnp.bfloat16)},
     r"gu \(the kept g, u\) must be \[ranks, M, 2I\] = \(2, \d+, 48\) .*got \(1, "),
    (lambda a: {**a, "gu": jnp.zeros((*a["src_slot"].shape, 48), jnp.bfloat16),
                "gu_part": jnp.zeros((2, 4, 48), jnp.bfloat16), "gu_part_row": a["src_slot"]},
     r"gu \(every row's kept g, u\) and gu_part .* exclusive"),
    (lambda a: {**a, "gu_part": jnp.zeros((4, 48), jnp.bfloat16), "gu_part_row": a["src_slot"]},
     r"gu_part \(some rows' kept g, u\) must be bfloat16\[ranks, R, 2I\] with ranks = 2, 2I = 48, got "
     r"bfloat16\[4, 48\]"),
    (lambda a: {**a, "gu_part": jnp.zeros((2, 4, 48), jnp.bfloat16), "gu_part_row": a["src_slot"][:, 1:]},
     r"gu_part_row \(each row's row of gu_part\) must be int32\[ranks, M\] = int32\[2, \d+\]"),
])
def test_fused_ep_op_names_the_bad_argument(monkeypatch, change, match):
    mb = importlib.import_module("mok_jax.ops.moe_backward")
    monkeypatch.setattr(mb, "require_native", lambda what: None)
    args, _ = _ep_op_args()
    names = ("x", "dy", "topk_idx", "topk_weight", "src_slot", "group_sizes", "gate_up", "down")
    kw = change(dict(zip(names, args)))
    with pytest.raises((ValueError, TypeError), match=match):
        experts_backward_ep(_stand_in_workspace(), **kw)


def test_fused_ep_op_refuses_a_one_rank_workspace_and_a_mesh_workspace_with_every_rank(monkeypatch):
    mb = importlib.import_module("mok_jax.ops.moe_backward")
    monkeypatch.setattr(mb, "require_native", lambda what: None)
    args, _ = _ep_op_args()
    with pytest.raises(ValueError, match="at EP 1 use mok_jax.ops.experts_backward"):
        experts_backward_ep(_stand_in_workspace(ep=1, E=2), *args)
    with pytest.raises(ValueError, match="x carries 2 ranks; this workspace takes 1"):
        experts_backward_ep(_stand_in_workspace(emulated=False), *args)
