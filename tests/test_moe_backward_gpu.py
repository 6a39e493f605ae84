"""GPU tests of the backward of implementation="mok" at EP size 1 (mok_jax.ops.experts_backward and the layer's
gradients) against mok_jax.reference.

The op: fresh random bf16 tokens and the padded layout of a random routing (the seed is printed) against
experts_backward_reference, which gathers the same rows, rounds at the same points and sums each token's bf16
slot rows in f32 in the same order, so they differ by the outputs' roundings turned the other way by fp32 sum
order; dx per token, dw per slot, the weights' gradients row by row. Out-of-range pos and src_slot values (which
the op must skip, not read through) are compared with the reference too.
The layer: jax.grad of mok in bf16 against jax.grad of the f32 reference on upcast inputs (matmul precision
"highest"), row by row, within 2x the error of the reference's own bf16 gradient on that row plus a few bf16
roundings of the row and of a typical row; the awkward cases (masked slots, one expert, empty experts, one
token, k = 10, no shared expert) and I not a multiple of the kernel's 256-column tiles. Determinism: two runs
and three SM counts give the same bits; jax.checkpoint around the layer gives the bits of the plain gradient.
Before the op gathered its rows itself, the file ran in ~41 s on one H200 (XLA_FLAGS=--xla_gpu_autotune_level=0),
the worst case at 0.4 of its bound. Set MOK_TEST_METRICS=path to append one JSON line of errors per case.
MOK_TEST_SEED=<seed> draws a run's inputs again: a failing test's report names its seed.
"""

from __future__ import annotations

import functools
import importlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GRAD_NAMES, module_seed, record_metrics, seeded_key, used_kept_blocks

import mok_jax as mj
from mok_jax import ops
from mok_jax.bench.routing import make_routing
from mok_jax.config import ModelShape
from mok_jax.expert_layout import padded_layout
from mok_jax.ops.moe_backward import (
    EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP,
    EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW,
    EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP,
)
from mok_jax.reference import experts_backward_reference
from mok_jax.weights import MoEWeights
from mok_jax.workspace import CommTimeoutError, Workspace

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_kernels")]

# The op against its reference: both keep g, u in fp32 and round dgu, w h and the outputs to bf16 at the same
# points, so a row differs by its own rounding turned the other way by fp32 sum order (an ulp, at most 2^-7, on a
# rare element) and by a rare dgu or w h value rounded the other way upstream (a 2^-7 change of one of 2I
# terms): 2 x 2^-8 of
# the row is far above that and far below a wrong row (O(1)). A token's dx is the f32 sum, in the same slot
# order on both sides, of its k such bf16 rows: their errors add as the (independent) rows do, so the sum's
# relative error is a row's, and the same bound holds per token.
OP_ROW_TOL = 2 * 2.0**-8
# Added to the bound of a weight-gradient row in the op test, times its rms row norm: rows that cancel.
OP_FLOOR = 2.0**-8
# dw (f32, not rounded) against its reference, times the sum of |dh'_i h_i| of the slot's row: g, u and dh' are fp32
# on both sides and differ only by sum order (~2^-20 of a term); the bound was first set for bf16 g, u (a value
# rounded the other way, at most 2^-7 of it, through silu' <= 1.1, moves one term by < 2^-6.8 of it, one term is
# ~1/100 of that sum at I >= 384) and is kept: a wrong row's dw (~ 1/20 of the sum) is still 50x out.
OP_DW_TOL = 2.0**-10
# The layer's gradients against the f32 reference: mok rounds dgu, each slot's dx row, w h and the outputs
# to bf16 (the shared expert's too: dgu, h and the outputs); the reference's own bf16 gradient (the xla
# path) rounds h, every cotangent and the outputs; mok sits near it: 2x it ...
ERR_VS_NAIVE_BF16 = 2.0
# ... plus, times the row's norm: up to four roundings on a row's way (x and dy come in bf16, then dgu or w h,
# then the output), each at most 2^-8, for rows whose naive gradient happens to be closer ...
ERR_ROW = 4 * 2.0**-8
# ... plus, times the rms row norm of that gradient: the weight gradients are dot products that cancel (dw over I,
# the weights' over the tokens), so their error follows the size of their terms (~ the rms), not their own size.
# With the op's reference in its place, the worst of 60 random cases (these shapes and routings) reached half of
# the whole bound; a wrong slot or row is O(1) of the rms.
ERR_FLOOR = 4 * 2.0**-8

_SEED = module_seed(__name__)  # MOK_TEST_SEED, else fresh (helpers.py: seeds)
_F32 = jnp.float32
_BF16 = jnp.bfloat16


def _record(case: str, **metrics):
    record_metrics(case, _SEED, **metrics)


def _key(tag: str):
    return seeded_key(_SEED, tag)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _rows(a) -> np.ndarray:
    a = np.asarray(a, np.float64)
    return a.reshape(-1, a.shape[-1]) if a.ndim > 1 else a[:, None]


# ----------------------------------------------------------------------------- the op against its reference


def _op_problem(tag: str, T: int, E: int, k: int, H: int, I: int, routing: str = "uniform"):
    """bf16 tokens, dy and weights, f32 router weights, and the padded layout of a random routing: ``uniform``
    (k distinct experts of all E per token), ``masked_empty`` (experts from a random half only, so some get
    nothing; 30% of the slots masked and the first tokens with every slot masked), ``skewed`` (expert e drawn with
    weight 1 / (e + 1)). Returns the op's args and topk_idx."""
    ks = jax.random.split(_key(tag), 5)
    rng = np.random.default_rng(zlib.crc32(f"{_SEED}{tag}".encode()))
    pool = np.arange(E) if routing in ("uniform", "skewed") else rng.permutation(E)[:max(k, E // 2)]
    if routing == "skewed":  # expert e with weight 1 / (e + 1): every expert has rows, few or many m-blocks
        odds = 1.0 / np.arange(1, E + 1)
        idx = np.stack([rng.choice(pool, k, replace=False, p=odds / odds.sum()) for _ in range(T)]).astype(np.int32)
    else:
        idx = np.stack([rng.permutation(pool)[:k] for _ in range(T)]).astype(np.int32)
    if routing == "masked_empty":
        idx[rng.random(idx.shape) < 0.3] = -1
        idx[: min(4, T)] = -1
    x = jax.random.normal(ks[0], (T, H)).astype(_BF16)
    dy = jax.random.normal(ks[1], (T, H)).astype(_BF16)
    w = jax.random.uniform(ks[2], (T, k), minval=0.1, maxval=1.0)
    gate_up = (jax.random.normal(ks[3], (E, H, 2 * I)) * H**-0.5).astype(_BF16)
    down = (jax.random.normal(ks[4], (E, I, H)) * I**-0.5).astype(_BF16)
    lay = padded_layout(jnp.asarray(idx), E)
    return (x, dy, w, lay.pos, lay.src_slot, lay.group_sizes, gate_up, down), idx


@jax.jit
def _dw_scale(x, dy, gate_up, down, idx):
    """sum_i |dh'_i h_i| per slot [T, k], in f32 (the size of the terms of dw, whatever they cancel to)."""
    I = down.shape[1]
    out = jnp.zeros(idx.shape, _F32)
    with jax.default_matmul_precision("highest"):
        for e in range(gate_up.shape[0]):
            gu = (x.astype(_F32) @ gate_up[e].astype(_F32)).astype(_BF16).astype(_F32)
            h = jax.nn.silu(gu[:, :I]) * gu[:, I:]
            dh = dy.astype(_F32) @ down[e].astype(_F32).T
            out = jnp.where(idx == e, jnp.sum(jnp.abs(dh * h), axis=1)[:, None], out)
    return out


def _check_rows(case, got, want, tol, floor):
    """||got_r - want_r|| <= tol * ||want_r|| + floor * rms row norm, row by row; returns the worst ratio."""
    got, want = _rows(got), _rows(want)
    assert np.isfinite(got).all(), f"{case}: NaN/Inf in rows {np.where(~np.isfinite(got).all(1))[0][:8].tolist()}"
    norm = np.linalg.norm(want, axis=1)
    bound = tol * norm + floor * np.sqrt(np.mean(norm**2))
    err = np.linalg.norm(got - want, axis=1)
    bad = np.where(err > bound)[0]
    assert bad.size == 0, (f"{case}: {bad.size} of {len(err)} rows over the bound, e.g. rows {bad[:6].tolist()}: "
                           f"err {err[bad[:6]].tolist()} > bound {bound[bad[:6]].tolist()}")
    return float((err / np.maximum(bound, 1e-30)).max(initial=0))


def _check_op(case, args, got, want, idx, no_row=None):
    """The op's outputs ``got`` against the reference's ``want`` on ``args``; idx: the routing (-1: the slot has
    no row); no_row: bool[T, k], further slots with no row or a padding row (exact zeros of dw). With a shared
    expert (got.d_shared_gate_up set) every token's dx has its part, and its weight gradients are checked too."""
    x, dy, _, _, _, _, gate_up, down = args
    E = gate_up.shape[0]
    assert int(got.status) == 0, f"{case}: status {int(got.status)}"
    no_row = (idx < 0) if no_row is None else (idx < 0) | no_row
    assert not _bits(got.dw)[no_row].any(), f"{case}: a slot without a row has dw != 0"
    shared = got.d_shared_gate_up is not None
    assert shared == (want.d_shared_gate_up is not None), case
    rowless = no_row.all(axis=1) & (not shared)  # tokens none of whose slots adds a row: exact zeros
    assert not _bits(got.dx)[rowless].any(), f"{case}: a token without rows has dx != 0"
    worst = {"dx": _check_rows(f"{case}: dx", np.asarray(got.dx)[~rowless], np.asarray(want.dx)[~rowless],
                               OP_ROW_TOL, 0.0)}
    scale = np.asarray(_dw_scale(x, dy, gate_up, down, jnp.asarray(np.where(no_row, -1, idx))))[~no_row]
    dw_err = np.abs(np.asarray(got.dw) - np.asarray(want.dw))[~no_row]
    over = ~(dw_err <= OP_DW_TOL * scale)  # NaN is over
    assert not over.any(), (f"{case}: dw over the bound at {over.sum()} slots, e.g. "
                            f"{np.flatnonzero(over)[:6].tolist()}: err {dw_err[over][:6].tolist()} > bound "
                            f"{(OP_DW_TOL * scale)[over][:6].tolist()}")
    worst["dw"] = float((dw_err / np.maximum(OP_DW_TOL * scale, 1e-30)).max(initial=0))
    reached = set(idx[idx >= 0].tolist())
    for e in range(E):
        if e not in reached:  # an empty expert: exact zeros
            assert not _bits(got.d_gate_up[e]).any() and not _bits(got.d_down[e]).any(), f"{case}: expert {e}"
            continue
        for name in ("d_gate_up", "d_down"):
            worst[f"{name}[{e}]"] = _check_rows(f"{case}: {name}[{e}]", np.asarray(getattr(got, name)[e], np.float32),
                                                np.asarray(getattr(want, name)[e], np.float32), OP_ROW_TOL,
                                                OP_FLOOR)
    if shared:  # the same roundings as a routed expert's (weight 1), K = the T tokens
        for name in ("d_shared_gate_up", "d_shared_down"):
            worst[name] = _check_rows(f"{case}: {name}", np.asarray(getattr(got, name), np.float32),
                                      np.asarray(getattr(want, name), np.float32), OP_ROW_TOL, OP_FLOOR)
    _record(case, worst_err_over_bound=max(worst.values()))


@pytest.mark.parametrize("T,E,k,H,I,routing", [
    (300, 8, 4, 256, 512, "uniform"),  # rows past the sum (M = T k + 128 E)
    (200, 8, 2, 320, 384, "masked_empty"),  # empty experts, masked slots; I not a multiple of 256; H = 2.5 x 128
    (1000, 1, 1, 256, 512, "uniform"),  # one expert: one group of 1024 rows, 24 of them padding
    (64, 16, 10, 256, 256, "uniform"),  # k = 10
    (1000, 4, 2, 256, 256, "skewed"),  # GATHER's rounds over every expert's first m-blocks, then the rest
])
def test_op_matches_reference(T, E, k, H, I, routing):
    case = f"op:{T}x{E}x{k}x{H}x{I}:{routing}"
    args, idx = _op_problem(case, T, E, k, H, I, routing)
    got = jax.jit(ops.experts_backward)(*args)
    want = jax.jit(experts_backward_reference)(*args)
    _check_op(case, args, got, want, idx)


def _shared_weights(tag: str, H: int, Is: int):
    ka, kb = jax.random.split(_key(tag))
    return dict(shared_gate_up=(jax.random.normal(ka, (H, 2 * Is)) * H**-0.5).astype(_BF16),
                shared_down=(jax.random.normal(kb, (Is, H)) * Is**-0.5).astype(_BF16))


@pytest.mark.parametrize("T,E,k,H,I,Is,routing", [
    (300, 8, 4, 256, 512, 256, "uniform"),
    (200, 8, 2, 320, 384, 192, "masked_empty"),  # T, Is and 2Is no multiples of the tiles; tokens without rows
    (1, 4, 2, 256, 256, 128, "uniform"),  # T = 1: one row of the shared expert, K = 1 in its weight gradients
    (130, 16, 10, 256, 256, 384, "uniform"),  # k = 10, Is > I
])
def test_op_with_the_shared_expert_matches_reference(T, E, k, H, I, Is, routing):
    """The shared expert's backward in the same kernel (its own tiles, weight 1, K = T in its weight gradients,
    its f32 dx added after each token's slot sum) against the reference; the routed outputs as without it."""
    case = f"op+shared:{T}x{E}x{k}x{H}x{I}x{Is}:{routing}"
    args, idx = _op_problem(case, T, E, k, H, I, routing)
    sw = _shared_weights(case, H, Is)
    got = jax.jit(ops.experts_backward)(*args, **sw)
    want = jax.jit(experts_backward_reference)(*args, **sw)
    _check_op(case, args, got, want, idx)
    alone = jax.jit(ops.experts_backward)(*args)  # the routed gradients do not see the shared tiles
    for name in ("dw", "d_gate_up", "d_down", "dx_rows"):
        np.testing.assert_array_equal(_bits(getattr(got, name)), _bits(getattr(alone, name)), f"{case}: {name}")


def test_op_skips_out_of_range_pos_and_src_slot():
    """pos outside [0, M) adds nothing and gets dw = 0, and so does a pos at a row past sum(group_sizes) (that
    row's dx and dw are 0); src_slot outside [-1, T k) is a padding row: the op agrees with the reference (which
    defines this) and reads nothing out of bounds (no fault, finite results)."""
    T, E, k = 200, 4, 2
    args, idx = _op_problem("op:out of range", T, E, k, 256, 256)
    x, dy, w, pos, src_slot, gs, gate_up, down = args
    M = src_slot.shape[0]
    pos, src_slot = np.array(pos), np.array(src_slot)
    no_row = np.zeros((T, k), bool)
    assert int(np.sum(gs)) <= M - 1  # so pos = M - 1 is a row past the sum, whose dx and dw rows are 0
    for (t, j), bad in zip([(0, 0), (3, 1), (8, 0), (9, 1), (20, 0), (21, 1), (22, 0)],
                           [M, M + 7, -1, -5, 2**31 - 1, -(2**31), M - 1]):
        pos[t, j] = bad
        no_row[t, j] = True
    for (t, j), bad in zip([(30, 0), (31, 1), (40, 0), (41, 1)], [-2, T * k, 2**31 - 1, -(2**31)]):
        src_slot[pos[t, j]] = bad
        no_row[t, j] = True  # its row is padding: dw = 0, dx adds a zero row
    args = (x, dy, w, jnp.asarray(pos), jnp.asarray(src_slot), gs, gate_up, down)
    got = jax.jit(ops.experts_backward)(*args)
    want = jax.jit(experts_backward_reference)(*args)
    _check_op("op:out of range", args, got, want, idx, no_row)


def test_op_status_bits():
    args, _ = _op_problem("status", 128, 2, 1, 256, 256)  # M = 128 + 2 * 128 = 384
    x, dy, w, pos, src_slot, _, gate_up, down = args
    f = jax.jit(ops.experts_backward)
    for sizes, bits in (([128, -128], EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP),
                        ([256, 256], EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW),
                        ([128, 100], EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP),
                        ([128, 128], 0)):
        out = f(x, dy, w, pos, src_slot, jnp.asarray(sizes, jnp.int32), gate_up, down)
        status = int(out.status)
        assert status == bits, f"group sizes {sizes} (M = 384): status {status}, want {bits}"
        for name in ("d_gate_up", "d_down"):  # bad sizes: NaN weight gradients, never a gradient-looking value
            g = np.asarray(getattr(out, name), np.float32)
            assert np.all(np.isnan(g)) if bits else np.all(np.isfinite(g)), f"group sizes {sizes}: {name}"


def test_op_bitwise_repeatable_whatever_the_sm_count():
    args, _ = _op_problem("sms", 400, 4, 2, 256, 384, "masked_empty")
    sw = _shared_weights("sms", 256, 192)
    outs = [jax.jit(functools.partial(ops.experts_backward, num_sms=n))(*args, **sw) for n in (None, None, 20, 3)]
    for n, out in zip((None, 20, 3), outs[1:]):
        for name, a, b in zip(out._fields, out, outs[0]):
            np.testing.assert_array_equal(_bits(a), _bits(b), f"num_sms={n}: {name} changed bits")


# ----------------------------------------------------------------------------- the layer's gradients


def _shape(E, H, I, k, Is=None) -> ModelShape:
    Is = I if Is is None else Is
    return ModelShape(name="t", num_experts=E, top_k=k, hidden_size=H, intermediate_size=I,
                      num_shared_experts=1 if Is else 0, shared_intermediate_size=Is)


def _problem(tag: str, shape: ModelShape, tokens: int, case: str = "uniform"):
    """Fresh random bf16 inputs (scaled so every step is O(1)), routing for ``case``, and a bf16 dy."""
    kx, kg, kd, ksg, ksd, ky = jax.random.split(_key(tag), 6)
    E, H, I, Is, k = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.shared_size, shape.top_k
    x = jax.random.normal(kx, (tokens, H), _F32).astype(_BF16)
    W = MoEWeights(
        (jax.random.normal(kg, (E, H, 2 * I)) * H**-0.5).astype(_BF16),
        (jax.random.normal(kd, (E, I, H)) * I**-0.5).astype(_BF16),
        (jax.random.normal(ksg, (H, 2 * Is)) * H**-0.5).astype(_BF16) if Is else None,
        (jax.random.normal(ksd, (Is, H)) * Is**-0.5).astype(_BF16) if Is else None,
    )
    seed = zlib.crc32(f"{_SEED}{tag}".encode())
    rng = np.random.default_rng(seed)
    idx, w = make_routing("uniform", num_ranks=1, tokens_per_rank=tokens, num_experts=E, top_k=k, seed=seed)
    idx = np.asarray(idx, np.int32)
    w = np.asarray(w, np.float32) * rng.uniform(0.5, 1.5, w.shape)
    if case == "masked":
        idx[rng.random(idx.shape) < 0.3] = -1
        idx[: min(4, tokens)] = -1  # tokens with every slot masked
    elif case == "one_expert":
        idx[:, 0], idx[:, 1:] = 5, -1
    elif case == "empty_experts":  # experts k.. get nothing
        idx = np.stack([rng.permutation(k)[:k] for _ in range(tokens)]).astype(np.int32)
    dy = jax.random.normal(ky, x.shape).astype(_BF16)
    return x, jnp.asarray(idx), jnp.asarray(w, _F32), W, dy


def _grad_fn(config):
    """(dx, d topk_weight, d weights) of <moe(x), dy>: a function of (x, w, W, idx, dy)."""
    def loss(x, w, W, idx, dy):
        return jnp.sum(mj.moe(x, idx, w, W, config=config).astype(_F32) * dy.astype(_F32))

    return jax.grad(loss, argnums=(0, 1, 2))


_MOK = mj.MoEConfig(implementation="mok")
_mok_grads = jax.jit(_grad_fn(_MOK))
_xla_grads = jax.jit(_grad_fn(mj.MoEConfig()))  # the reference's own bf16 gradient: the naive error


@jax.jit
def _reference_grads_f32(x, w, W, idx, dy):
    with jax.default_matmul_precision("highest"):
        return _grad_fn(mj.MoEConfig())(x.astype(_F32), w, jax.tree.map(lambda a: a.astype(_F32), W), idx, dy)


def _check_layer(case, x, idx, w, W, dy, got=None):
    got = _mok_grads(x, w, W, idx, dy) if got is None else got
    ref = _reference_grads_f32(x, w, W, idx, dy)
    naive = _xla_grads(x, w, W, idx, dy)
    leaves = [jax.tree.leaves(t) for t in (got, ref, naive)]
    worst = {}
    for name, g, r, n in zip(GRAD_NAMES, *leaves):
        g, r, n = _rows(np.asarray(g, np.float32)), _rows(r), _rows(np.asarray(n, np.float32))
        assert np.isfinite(g).all(), f"{case}: {name} has NaN/Inf"
        err, err_nv = np.linalg.norm(g - r, axis=1), np.linalg.norm(n - r, axis=1)
        norm = np.linalg.norm(r, axis=1)
        bound = ERR_VS_NAIVE_BF16 * err_nv + ERR_ROW * norm + ERR_FLOOR * np.sqrt(np.mean(norm**2))
        bad = np.where(err > bound)[0]
        assert bad.size == 0, (f"{case}: {name}: {bad.size} of {len(err)} rows over the bound, e.g. rows "
                               f"{bad[:6].tolist()}: err {err[bad[:6]].tolist()} > bound {bound[bad[:6]].tolist()}")
        # err / bound, 0 where both are 0 (a row whose reference, bf16 gradient and result are all exact zeros)
        worst[name] = float(np.divide(err, bound, out=np.zeros_like(err), where=bound > 0).max(initial=0))
    idx_np = np.asarray(idx)
    assert not np.asarray(got[1])[idx_np < 0].any(), f"{case}: a masked slot's weight gradient must be 0"
    for e in sorted(set(range(W.num_local_experts)) - set(idx_np[idx_np >= 0].tolist())):
        assert not _bits(got[2].gate_up[e]).any() and not _bits(got[2].down[e]).any(), f"{case}: empty expert {e}"
    _record(case, tokens=int(x.shape[0]), worst_err_over_bound=max(worst.values()), **worst)
    return got


# One shape for the routings (one compilation of each gradient), then the shapes and cases that change it.
_SMALL = dict(E=8, H=256, I=512, k=4, Is=256, T=256)


@pytest.mark.parametrize("case", ["uniform", "masked", "one_expert", "empty_experts"])
def test_layer_gradients_routings(case):
    E, H, I, k, Is, T = _SMALL.values()
    _check_layer(f"grad:{case}", *_problem(f"grad:{case}", _shape(E, H, I, k, Is), T, case))


@pytest.mark.parametrize("T,Is", [(300, 256), (130, 192), (1, 128)])
def test_layer_gradients_with_the_shared_expert_in_the_op(T, Is, monkeypatch):
    """moe._SHARED_IN_OP: the shared expert's backward in the experts' op (its tiles in the same kernel) rather
    than XLA; the layer's gradients against the f32 reference as with it in XLA, the routed ones the same bits."""
    moe_mod = importlib.import_module("mok_jax.layer")
    E, H, I, k = 8, 256, 512, 4
    x, idx, w, W, dy = _problem(f"grad:shared in op:{T}:{Is}", _shape(E, H, I, k, Is), T, "masked")
    monkeypatch.setattr(moe_mod, "_SHARED_IN_OP", True)
    got = jax.jit(_grad_fn(_MOK))(x, w, W, idx, dy)  # traced now, with the flag
    _check_layer(f"grad:shared in op:{T}:{Is}", x, idx, w, W, dy, got=got)
    monkeypatch.setattr(moe_mod, "_SHARED_IN_OP", False)
    xla = jax.jit(_grad_fn(_MOK))(x, w, W, idx, dy)
    for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(xla)):
        if name in ("d topk_weight", "d gate_up", "d down"):
            np.testing.assert_array_equal(_bits(a), _bits(b), f"T={T}, Is={Is}: {name}")


@pytest.mark.parametrize("case,E,H,I,k,Is,T", [
    ("I384", 8, 320, 384, 2, 128, 300),  # I not a multiple of the kernel's 256 columns; H of 2.5 x 128
    ("one_token", 8, 256, 512, 4, 256, 1),
    ("k10", 16, 256, 512, 10, 256, 64),
    ("no_shared", 8, 256, 512, 2, 0, 130),
])
def test_layer_gradients_shapes(case, E, H, I, k, Is, T):
    _check_layer(f"grad:{case}", *_problem(f"grad:{case}", _shape(E, H, I, k, Is), T))


# ----------------------------------------------------------------------------- determinism and programs


def test_layer_gradients_bitwise_repeatable_and_under_checkpoint():
    E, H, I, k, Is, T = _SMALL.values()
    x, idx, w, W, dy = _problem("remat", _shape(E, H, I, k, Is), T, "masked")
    first = _mok_grads(x, w, W, idx, dy)
    second = _mok_grads(x, w, W, idx, dy)

    def loss(layer):
        return lambda x, w, W: jnp.sum(layer(x, idx, w, W).astype(_F32) * dy.astype(_F32))

    plain_layer = functools.partial(mj.moe, config=_MOK)
    remat = jax.jit(jax.grad(loss(jax.checkpoint(plain_layer)), argnums=(0, 1, 2)))(x, w, W)
    for name, a, b, c in zip(GRAD_NAMES, *(jax.tree.leaves(t) for t in (first, second, remat))):
        np.testing.assert_array_equal(_bits(b), _bits(a), f"a second run changed {name}")
        np.testing.assert_array_equal(_bits(c), _bits(a), f"jax.checkpoint changed {name}")
    _check_layer("grad:remat", x, idx, w, W, dy, got=first)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("ep", [2, 4, 8])
@pytest.mark.parametrize("Is", [0, 192])
def test_emulated_ep_backward_gives_the_bits_of_ep_one(ep, Is, fused):
    """The expert-parallel backward at EP 2/4/8, every rank on this GPU (mok_jax.emulation.emulated_moe_backward:
    each rank's op on its experts' slots of every rank's tokens, the collectives replaced by what they compute; or
    fused: every rank's part in one launch of the fused op, the rows moving between the ranks' workspace regions),
    against jax.grad of mok at EP 1. Without a shared expert every gradient is the bits of EP 1 (each slot has one
    owner; the layouts keep global slot order, so the weight gradients' K order is EP 1's); with one, the shared
    expert's backward runs per rank on T rows in XLA (at EP 1: in the op), so dx and its weight gradients are compared
    with the f32 reference instead (as the EP-1 layer is), and the routed weights' gradients still bit for bit."""
    from mok_jax.emulation import emulated_moe_backward

    E, H, I, k, T = 16, 256, 384, 4, 96 * ep
    x, idx, w, W, dy = _problem(f"ep{ep}:{Is}", _shape(E, H, I, k, Is), T, "masked")
    one = _mok_grads(x, w, W, idx, dy)
    got = jax.jit(functools.partial(emulated_moe_backward, ep=ep, fused=fused))(x, idx, w, W, dy)
    exact = GRAD_NAMES if not Is else ("d topk_weight", "d gate_up", "d down")
    for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(one)):
        if name in exact:
            np.testing.assert_array_equal(np.asarray(a, _F32), np.asarray(b, _F32), f"EP {ep}: {name}")
    if Is:
        _check_layer(f"grad:emulated_ep{ep}", x, idx, w, W, dy, got=got)


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_masked_slot_weight_reaches_no_gradient(poison):
    """A masked slot (-1) whose weight is NaN or inf (a top-k over -inf logits can give one; issue 35): on the mok
    path, y (EP 1 and emulated EP 2) and every gradient (EP 1, and the fused emulated EP 2 and 4 backward) are finite
    and the bits of the same routing with 0 in those slots, and a masked slot's weight gradient is 0."""
    from mok_jax.emulation import emulated_moe, emulated_moe_backward

    E, H, I, k, Is, T = 16, 256, 384, 4, 192, 192
    x, idx, w, W, dy = _problem(f"poison:{poison}", _shape(E, H, I, k, Is), T, "masked")
    masked = np.asarray(idx) < 0
    assert masked.any() and (~masked).any()
    poisoned, zeroed = jnp.where(masked, poison, w), jnp.where(masked, 0.0, w)
    forwards = {"EP 1": jax.jit(lambda x, w: mj.moe(x, idx, w, W, config=_MOK)),
                "EP 2": jax.jit(lambda x, w: emulated_moe(x, idx, w, W, ep=2)[0])}  # (y, status)
    for label, f in forwards.items():
        got, want = f(x, poisoned), f(x, zeroed)
        assert np.isfinite(np.asarray(got, _F32)).all(), f"{label}: y"
        np.testing.assert_array_equal(_bits(got), _bits(want), f"{label}: y")
    backwards = {"EP 1": _mok_grads}
    for ep in (2, 4):
        backwards[f"EP {ep}"] = jax.jit(functools.partial(
            lambda x, w, W, idx, dy, ep: emulated_moe_backward(x, idx, w, W, dy, ep=ep, fused=True), ep=ep))
    for label, f in backwards.items():
        got, want = jax.tree.leaves(f(x, poisoned, W, idx, dy)), jax.tree.leaves(f(x, zeroed, W, idx, dy))
        assert len(got) == len(GRAD_NAMES)
        for name, a, b in zip(GRAD_NAMES, got, want):
            assert np.isfinite(np.asarray(a, _F32)).all(), f"{label}: {name} has NaN/Inf"
            np.testing.assert_array_equal(_bits(a), _bits(b), f"{label}: {name}")
        assert not np.asarray(got[1])[masked].any(), f"{label}: a masked slot's weight gradient must be 0"


@pytest.mark.parametrize("ep,case,per_rank", [(2, "one_expert", 64), (4, "empty_experts", 40), (8, "uniform", 1),
                                               (2, "masked", 130)])
def test_fused_ep_backward_routing_knobs_and_calls(ep, case, per_rank):
    """The fused expert-parallel backward (mok_jax.ops.experts_backward_ep: every rank in one launch on an emulated
    workspace, the token rows and the slots' dx rows moving between the ranks' regions inside the kernel) on awkward
    routings: every token to one expert (the other ranks own no rows and send nothing), empty experts, one token
    per rank, masked slots. Every gradient is the bits of EP 1, with a zero status; comm_items_bwd 1 and 24 and an SM
    count that splits unevenly over the ranks give the same bits; and a call with other inputs in between leaves
    nothing behind in the workspace's buffers, which every call reuses."""
    from mok_jax.emulation import emulated_moe_backward

    E, H, I, k, T = 16, 256, 256, 4, ep * per_rank
    args = _problem(f"fused{ep}:{case}:{T}", _shape(E, H, I, k, 0), T, case)
    other = _problem(f"fused{ep}:{case}:{T}:other", _shape(E, H, I, k, 0), T, case)
    x, idx, w, W, dy = args
    one = _mok_grads(x, w, W, idx, dy)

    def run(inputs, comm_items=24, num_sms=None):
        kernel = mj.KernelConfig(comm_items_bwd=comm_items)
        *grads, status = jax.jit(functools.partial(emulated_moe_backward, ep=ep, kernel=kernel, num_sms=num_sms,
                                                   return_status=True, fused=True))(*inputs)
        assert not np.asarray(status).any(), f"EP {ep} {case}: status {np.asarray(status)}"
        return grads

    first = run(args)
    for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(first), jax.tree.leaves(one)):
        np.testing.assert_array_equal(_bits(a), _bits(b), f"EP {ep} {case}: {name} differs from EP 1")
    run(other)
    for label, got in (("after another call", run(args)), ("comm_items_bwd=1", run(args, comm_items=1)),
                       ("num_sms uneven", run(args, num_sms=4 * ep + 3))):
        for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(first)):
            np.testing.assert_array_equal(_bits(a), _bits(b), f"EP {ep} {case}, {label}: {name} changed")


def test_fused_ep_backward_rank_that_skips_a_call_times_out():
    """One emulated rank makes no call: the other's waits for its shared rows time out (bounded; nothing hangs), its
    status says so (EXPERTS_BACKWARD_STATUS_COMM), its gradients are NaN, the workspace is poisoned (check() names
    the rank) and the next call on it refuses to run; on a new workspace, as the error says, it runs again and gives
    EP 1's bits."""
    from mok_jax.emulation import emulated_moe_backward
    from mok_jax.ops.moe_backward import EXPERTS_BACKWARD_STATUS_COMM

    E, H, I, k, T = 8, 256, 128, 2, 128
    x, idx, w, W, dy = _problem("fused_skip", _shape(E, H, I, k, 0), T, "uniform")
    new_ws = functools.partial(Workspace.create_emulated, jax.devices("gpu")[0], 2, max_tokens=T // 2, hidden_size=H,
                               top_k=k, num_experts=E, timeout_s=0.5)
    ws = new_ws()
    try:
        dx, _, _, status = emulated_moe_backward(x, idx, w, W, dy, ep=2, workspace=ws, skip_rank=1,
                                                 return_status=True, fused=True)
        status = np.asarray(jax.block_until_ready(status))
        assert status[0] & EXPERTS_BACKWARD_STATUS_COMM, f"status {status}"
        assert np.isnan(np.asarray(dx, _F32)[: T // 2]).all(), "rank 0's dx must be NaN after the timeout"
        with pytest.raises(CommTimeoutError, match="EP rank 0.*timed out"):
            ws.check()
        with pytest.raises(Exception, match="poisoned"):
            jax.block_until_ready(emulated_moe_backward(x, idx, w, W, dy, ep=2, workspace=ws, fused=True)[0])
        ws.close()
        # The recovery the error prescribes; it also leaves JAX's runtime token of the device on a call that
        # succeeded (the refused call's error is printed again at the process's exit otherwise).
        ws = new_ws()
        got = emulated_moe_backward(x, idx, w, W, dy, ep=2, workspace=ws, return_status=True, fused=True)
        assert not np.asarray(got[-1]).any(), f"status {np.asarray(got[-1])} on a new workspace"
        for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(got[:3]), jax.tree.leaves(_mok_grads(x, w, W, idx, dy))):
            np.testing.assert_array_equal(np.asarray(a, _F32), np.asarray(b, _F32), f"EP 2, new workspace: {name}")
    finally:
        ws.close()


# ----------------------------------------------------------------------------- MoEConfig(keep="everything")

_MOK_KEEP = mj.MoEConfig(implementation="mok", keep="everything")
_mok_keep_grads = jax.jit(_grad_fn(_MOK_KEEP))


@pytest.mark.parametrize("case,I,T", [("uniform", 256, 300), ("masked", 384, 300), ("empty_experts", 256, 200),
                                      ("one_expert", 256, 130), ("uniform", 256, 1)])
def test_keep_everything_gives_the_bits_of_recompute(case, I, T):
    """The forward keeps its fp32 g, u (the megakernel writes them into the backward's rows) and the backward
    skips the gate/up recompute: every gradient and the layer's output are the bits of keep="nothing" (the
    forward's gate/up tile and the recompute run the same wgmma chain over the same K order)."""
    E, H, k, Is = 16, 512, 4, 256
    x, idx, w, W, dy = _problem(f"keep:{case}:{T}", _shape(E, H, I, k, Is), T, case)
    want = _mok_grads(x, w, W, idx, dy)
    got = _mok_keep_grads(x, w, W, idx, dy)
    for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(_bits(a), _bits(b), f"{case}: keep='everything' changed {name}")
    y_keep = jax.jit(lambda x: jax.vjp(lambda x: mj.moe(x, idx, w, W, config=_MOK_KEEP), x)[0])(x)
    y = jax.jit(lambda x: mj.moe(x, idx, w, W, config=_MOK))(x)
    np.testing.assert_array_equal(_bits(y_keep), _bits(y), f"{case}: keep='everything' changed the output")


@pytest.mark.parametrize("case,T,granularity,ring_slots", [("uniform", 1200, 512, 2), ("masked", 1500, 512, 2),
                                                           ("uniform", 2048, 1024, 1)])
def test_keep_ring_gives_the_bits_of_recompute(case, T, granularity, ring_slots):
    """keep="ring" with more tokens than the ring holds: the forward keeps the g, u of the slots of the tokens
    still in its ring (the last ring_slots microbatches) in a buffer of their own, the backward copies them into
    the 128-row blocks they cover and recomputes the others (the routing has blocks of both kinds): every
    gradient and the output are the bits of keep="nothing" (at the default knobs: the knobs change no bit either)."""
    E, H, I, k, Is = 16, 512, 256, 4, 256
    cfg = mj.MoEConfig(implementation="mok", keep="ring",
                       kernel=mj.KernelConfig(granularity=granularity, ring_slots=ring_slots))
    x, idx, w, W, dy = _problem(f"ring:{case}:{T}:{ring_slots}", _shape(E, H, I, k, Is), T, case)
    moe_mod = importlib.import_module("mok_jax.layer")
    lay = moe_mod.rank_layout(idx, E, 0)
    _, rows, row = moe_mod._keep_plan(cfg, x, idx, W, lay)
    blocks = used_kept_blocks(lay.src_slot, row, rows, T * k, lay.group_sizes)
    assert 0 < blocks.sum() < blocks.size, f"{case}: want copied and recomputed blocks, got {blocks}"
    want = _mok_grads(x, w, W, idx, dy)
    got = jax.jit(_grad_fn(cfg))(x, w, W, idx, dy)
    for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(_bits(a), _bits(b), f"{case}: keep='ring' changed {name}")
    y_ring = jax.jit(lambda x: jax.vjp(lambda x: mj.moe(x, idx, w, W, config=cfg), x)[0])(x)
    y = jax.jit(lambda x: mj.moe(x, idx, w, W, config=_MOK))(x)
    np.testing.assert_array_equal(_bits(y_ring), _bits(y), f"{case}: keep='ring' changed the output")


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("ep", [2, 4])
def test_emulated_ep_keep_everything_gives_the_bits_of_ep_one(ep, fused):
    """At EP 2/4 on this GPU: the emulated forward keeps each rank's g, u in that rank's layout over every rank's
    tokens (mok_jax.emulation.emulated_moe(keep=True)), the emulated backward uses them: every gradient (no
    shared expert) the bits of EP 1's."""
    from mok_jax.emulation import emulated_moe, emulated_moe_backward

    E, H, I, k, T = 16, 256, 384, 4, 96 * ep
    x, idx, w, W, dy = _problem(f"keep_ep{ep}", _shape(E, H, I, k, 0), T, "masked")
    one = _mok_grads(x, w, W, idx, dy)

    def grads(x, idx, w, W, dy):
        _, _, kept = emulated_moe(x, idx, w, W, ep=ep, keep=True)
        return emulated_moe_backward(x, idx, w, W, dy, ep=ep, kept=kept, fused=fused)

    got = jax.jit(grads)(x, idx, w, W, dy)
    for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(one)):
        np.testing.assert_array_equal(np.asarray(a, _F32), np.asarray(b, _F32), f"EP {ep} with keep: {name}")


@pytest.mark.parametrize("fused", [False, True])
def test_emulated_ep_keeps_the_shared_experts_g_u(fused):
    """The shared expert's kept g | u (emulated EP 2, keep=True): each rank's bf16[T, 2Is] is its tokens' x Wsgu as
    XLA computes it rounded to bf16, to within one bf16 rounding per element plus the bound on two f32 sums of H
    products in other orders (the megakernel's accumulators and XLA's GEMM), and the same bits for almost every
    element, so a row or column stored in the wrong place shows; the backward from them: the routed gradients the
    bits of EP 1, dx and the shared gradients within the layer's bounds (_check_layer)."""
    from mok_jax.emulation import emulated_moe, emulated_moe_backward

    moe_mod = importlib.import_module("mok_jax.layer")
    ep, E, H, I, k, Is, T = 2, 16, 256, 384, 4, 192, 192
    x, idx, w, W, dy = _problem("keep_shared", _shape(E, H, I, k, Is), T, "masked")
    _, status, kept = jax.jit(functools.partial(emulated_moe, ep=ep, keep=True))(x, idx, w, W)
    assert not np.asarray(status).any(), status
    per = T // ep
    for r, c in enumerate(kept):
        assert c.shared_gu is not None and c.shared_gu.shape == (per, 2 * Is) and c.shared_gu.dtype == _BF16
        want = jax.jit(moe_mod.shared_gate_up_product)(x[r * per:(r + 1) * per], W.shared_gate_up)
        got_b, want_b = np.asarray(c.shared_gu, _F32), np.asarray(want, _F32)
        # Each side rounds its own f32 sum of H products once to bf16. The two sums differ by at most
        # 2 gamma_H sum|x||Wsgu| (gamma_H = H 2^-24), and the two roundings by one bf16 step of the larger value
        # (2^-7 |v|). The first term matters only where the products cancel (seed 662381098 had a value of 3.7e-6
        # from products of magnitude 10, where even XLA on the CPU and the exact value differ by two steps).
        xs, wsgu = np.asarray(x[r * per:(r + 1) * per], np.float64), np.asarray(W.shared_gate_up, np.float64)
        mag = np.abs(xs) @ np.abs(wsgu)
        tol = 2.0**-7 * np.maximum(np.abs(got_b), np.abs(want_b)) + 2 * H * 2.0**-24 * mag
        off = np.abs(got_b - want_b) > tol
        assert not off.any(), (f"rank {r}: {off.sum()} elements beyond one bf16 step and the f32 sums' difference, "
                               f"(row, column) {list(zip(*np.where(off)))[:8]}")
        assert np.mean(got_b != want_b) < 0.02, f"rank {r}: {np.mean(got_b != want_b):.3f} of the elements differ"
    got = jax.jit(functools.partial(emulated_moe_backward, ep=ep, fused=fused))(x, idx, w, W, dy, kept=kept)
    one = _mok_grads(x, w, W, idx, dy)
    for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(one)):
        if name in ("d topk_weight", "d gate_up", "d down"):
            np.testing.assert_array_equal(np.asarray(a, _F32), np.asarray(b, _F32), f"EP {ep} with keep: {name}")
    _check_layer("grad:keep_shared", x, idx, w, W, dy, got=got)


@pytest.mark.parametrize("ep", [2, 4])
def test_fused_ep_backward_with_part_kept_gu_gives_the_bits_of_ep_one(ep):
    """The fused expert-parallel backward fed, per rank, only the g, u of the slots of each rank's second half of
    tokens (gu_part: the form keep="ring" gives it once a rank's tokens outrun the ring; rows indexed by the kept
    tokens' slots, every rank's, as the layer keeps them): a 128-row block whose slot rows all have kept rows copies
    them, the others recompute (each rank has blocks of both kinds), and every gradient is the bits of EP 1. The
    kept buffer's rows that no row of the rank's layout names hold NaN, so reading one would show."""
    from mok_jax.emulation import emulated_moe, emulated_moe_backward
    from mok_jax.layer import KeptGateUp

    E, H, I, k, per_rank = 8, 256, 256, 4, 1024
    first = per_rank // 2  # kept: the tokens [first, per_rank) of each rank
    x, idx, w, W, dy = _problem(f"part_ep{ep}", _shape(E, H, I, k, 0), ep * per_rank, "masked")
    one = _mok_grads(x, w, W, idx, dy)
    _, status, kept = jax.jit(functools.partial(emulated_moe, ep=ep, keep=True))(x, idx, w, W)
    assert not np.asarray(status).any(), f"EP {ep}: forward status {np.asarray(status)}"
    ring_slots = ep * (per_rank - first) * k
    parts = []
    for r, c in enumerate(kept):
        src = np.asarray(c.layout.src_slot)
        tok = np.where(src >= 0, src // k, -1)
        mine = (src >= 0) & (tok % per_rank >= first)
        # the kept row of slot (token t of rank q, j): ((q (per_rank - first) + t - first) k + j
        row = np.where(mine, ((tok // per_rank) * (per_rank - first) + tok % per_rank - first) * k + src % k, -1)
        gu_part = jnp.full((ring_slots, 2 * I), jnp.nan, c.gu.dtype).at[row[mine]].set(c.gu[np.nonzero(mine)[0]])
        blocks = used_kept_blocks(src, row, ring_slots, ep * per_rank * k, c.layout.group_sizes)
        assert 0 < blocks.sum() < blocks.size, f"EP {ep} rank {r}: want copied and recomputed blocks, got {blocks}"
        parts.append(KeptGateUp(gu_part, c.layout, jnp.asarray(row, jnp.int32)))
    *got, status = jax.jit(functools.partial(emulated_moe_backward, ep=ep, fused=True, return_status=True))(
        x, idx, w, W, dy, kept=parts)
    assert not np.asarray(status).any(), f"EP {ep}: backward status {np.asarray(status)}"
    for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(one)):
        np.testing.assert_array_equal(_bits(a), _bits(b), f"EP {ep} with part-kept g, u: {name} differs from EP 1")
