"""The pure-JAX reference against independent float64 NumPy loops, and its awkward cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_problem, rel_err
from mok_jax import load_model, reference
from mok_jax.weights import MoEWeights

# float32 reference vs float64 loop: accumulation over H <= 64 terms, a few ulps of f32.
TOL_F32_VS_F64 = 1e-5
# bf16 inputs/weights with f32 accumulation vs the same numbers in float64: the only extra error is
# the bf16 rounding of h and of the output (2^-8 relative each), so a few times 2^-8 in norm.
TOL_BF16_VS_F64 = 3 * 2.0**-8


def _silu(v):
    return v / (1 + np.exp(-v))


def _np_moe(x, idx, w, W: MoEWeights):
    """Token by token, slot by slot, in float64."""
    x = np.asarray(x, np.float64)
    gu, dn = np.asarray(W.gate_up, np.float64), np.asarray(W.down, np.float64)
    inter = dn.shape[1]
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            g = x[t] @ gu[e]
            y[t] += float(w[t, j]) * ((_silu(g[:inter]) * g[inter:]) @ dn[e])
        if W.shared_gate_up is not None:
            sg = x[t] @ np.asarray(W.shared_gate_up, np.float64)
            si = sg.shape[0] // 2
            y[t] += (_silu(sg[:si]) * sg[si:]) @ np.asarray(W.shared_down, np.float64)
    return y


@pytest.mark.parametrize("model", ["ci", "qwen3-30b-a3b"])
def test_moe_matches_float64_loop(model):
    shape = load_model(model)
    if model != "ci":  # keep the loop small: same routing features, tiny sizes
        shape = shape.replace(hidden_size=32, intermediate_size=16, num_experts=16)
    x, idx, w, W = random_problem(shape, 13, seed=1)
    y = reference.moe(x, idx, w, W)
    assert y.dtype == jnp.float32
    assert rel_err(y, _np_moe(x, idx, w, W)) < TOL_F32_VS_F64


def test_moe_bf16_path():
    shape = load_model("ci")
    x, idx, w, W = random_problem(shape, 24, dtype=jnp.bfloat16, seed=2)
    y = reference.moe(x, idx, w, W)
    assert y.dtype == jnp.bfloat16
    assert rel_err(y, _np_moe(x, idx, w, W)) < TOL_BF16_VS_F64


def test_awkward_cases():
    shape = load_model("ci")
    # one token
    x, idx, w, W = random_problem(shape, 1, seed=3)
    assert rel_err(reference.moe(x, idx, w, W), _np_moe(x, idx, w, W)) < TOL_F32_VS_F64
    # every token to the same k experts; the other experts get nothing
    x, _, w, W = random_problem(shape, 9, seed=4)
    idx = jnp.tile(jnp.arange(shape.top_k, dtype=jnp.int32)[None], (9, 1))
    assert rel_err(reference.moe(x, idx, w, W), _np_moe(x, idx, w, W)) < TOL_F32_VS_F64
    # no shared expert
    W0 = W._replace(shared_gate_up=None, shared_down=None)
    assert rel_err(reference.moe(x, idx, w, W0), _np_moe(x, idx, w, W0)) < TOL_F32_VS_F64


def test_grouped_ffn_matches_per_row_loop():
    rng = np.random.default_rng(5)
    E, H, I, M = 4, 16, 8, 23
    sizes = np.array([5, 0, 1, 11], np.int32)  # an empty and a one-row group; 6 padding rows
    x = rng.standard_normal((M, H)).astype(np.float32)
    gu = (rng.standard_normal((E, H, 2 * I)) * H**-0.5).astype(np.float32)
    dn = (rng.standard_normal((E, I, H)) * I**-0.5).astype(np.float32)
    y = np.asarray(reference.grouped_ffn(jnp.asarray(x), jnp.asarray(sizes), jnp.asarray(gu), jnp.asarray(dn)))
    row = 0
    for e, n in enumerate(sizes):
        for _ in range(n):
            g = x[row].astype(np.float64) @ gu[e]
            want = (_silu(g[:I]) * g[I:]) @ dn[e]
            assert rel_err(y[row], want) < TOL_F32_VS_F64
            row += 1
    assert np.all(y[row:] == 0), "padding rows must be exactly zero"


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router(score_func):
    logits = jax.random.normal(jax.random.key(6), (10, 12))
    idx, w = reference.route(logits, top_k=3, score_func=score_func, norm_topk_prob=True, routed_scaling_factor=2.0)
    assert idx.dtype == jnp.int32 and w.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(w).sum(-1), 2.0, rtol=1e-6)
    scores = np.asarray(jax.nn.softmax(logits) if score_func == "softmax" else jax.nn.sigmoid(logits))
    want = np.argsort(-scores, axis=1)[:, :3]
    np.testing.assert_array_equal(np.sort(np.asarray(idx), 1), np.sort(want, 1))
    # unnormalised weights are the raw scores of the chosen experts
    _, w_raw = reference.route(logits, top_k=3, score_func=score_func, norm_topk_prob=False)
    np.testing.assert_allclose(np.asarray(w_raw), np.take_along_axis(scores, np.asarray(idx), 1), rtol=1e-6)


def test_router_selection_bias_changes_choice_not_weights():
    logits = jnp.zeros((4, 8)).at[:, 0].set(5.0)
    bias = jnp.zeros((8,)).at[7].set(100.0)
    idx, w = reference.route(logits, top_k=1, score_func="sigmoid", norm_topk_prob=False, selection_bias=bias)
    assert np.all(np.asarray(idx) == 7), "the bias must steer selection"
    np.testing.assert_allclose(np.asarray(w), 0.5, rtol=1e-6)  # sigmoid(0): unbiased score of expert 7


def test_router_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        reference.route(jnp.zeros((2, 4)), top_k=5)
    with pytest.raises(ValueError, match="score_func"):
        reference.route(jnp.zeros((2, 4)), top_k=1, score_func="relu")
    with pytest.raises(ValueError, match="logits"):
        reference.route(jnp.zeros((4,)), top_k=1)


def test_moe_gradients_finite_differences():
    from jax.test_util import check_grads

    shape = load_model("ci").replace(hidden_size=8, intermediate_size=4, shared_intermediate_size=4, num_experts=4,
                                     top_k=2)
    x, idx, w, W = random_problem(shape, 5, seed=7)
    f = lambda x, w, W: reference.moe(x, idx, w, W)
    with jax.enable_x64(False):
        check_grads(f, (x, w, W), order=1, modes=["rev"], atol=5e-2, rtol=5e-2, eps=1e-2)



@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_masked_slot_weight_reaches_no_gradient(cpu_devices, poison):
    """A masked slot (-1) with a NaN or inf weight, as a top-k over -inf logits gives: the forward and every
    gradient of reference.moe and of reference.ep_moe (EP 2 under shard_map) are the bits of the same routing with
    0 in that slot, finite, and the slot's weight gradient is 0 (the slot selects no expert's row: it reads none)."""
    from jax.sharding import AxisType, PartitionSpec as P

    x, idx, w, W = random_problem(load_model("ci"), 8, seed=11)
    idx = idx.at[1, 2].set(-1).at[4, 0].set(-1)
    masked = np.asarray(idx) < 0
    mesh = jax.make_mesh((2,), ("ep",), axis_types=(AxisType.Auto,), devices=cpu_devices[:2])
    specs = (P("ep"), P("ep"), P("ep"), MoEWeights(P("ep"), P("ep"), P(), P()))
    ep = jax.shard_map(lambda x, i, w, W: reference.ep_moe(x, i, w, W, axis_name="ep"), mesh=mesh, in_specs=specs,
                       out_specs=P("ep"))
    for name, f in (("moe", reference.moe), ("ep_moe", ep)):
        run = jax.jit(jax.value_and_grad(lambda x, w, W: jnp.sum(f(x, idx, w, W) ** 2), argnums=(0, 1, 2)))
        got = run(x, jnp.where(masked, poison, w), W)
        want = run(x, jnp.where(masked, 0.0, w), W)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.isfinite(np.asarray(a)).all(), name
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        assert not np.asarray(got[1][1])[masked].any(), name
