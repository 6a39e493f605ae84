"""The expert-parallel reference under shard_map equals the single-device layer (8 CPU devices)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import mok_jax as mj
from helpers import TOL_BF16_REORDER, TOL_F32_REORDER, random_problem, rel_err


def _mesh(dp, ep, auto=False):
    types = (AxisType.Auto,) * 2 if auto else None
    kw = {"axis_types": types} if types else {}
    return jax.make_mesh((dp, ep), ("dp", "ep"), devices=jax.devices("cpu")[: dp * ep], **kw)


@pytest.mark.parametrize("dp,ep", [(1, 1), (1, 2), (2, 4), (1, 8)])
def test_forward_equals_single_device_f32(cpu_devices, dp, ep):
    shape = mj.load_model("ci")
    x, idx, w, W = random_problem(shape, 64, seed=10 + ep)
    want = mj.moe(x, idx, w, W)
    got = jax.jit(lambda *a: mj.expert_parallel_moe(*a, mesh=_mesh(dp, ep)))(x, idx, w, W)
    assert rel_err(got, want) < TOL_F32_REORDER


def test_forward_equals_single_device_bf16(cpu_devices):
    shape = mj.load_model("ci")
    x, idx, w, W = random_problem(shape, 64, dtype=jnp.bfloat16, seed=11)
    want = mj.moe(x, idx, w, W)
    got = mj.expert_parallel_moe(x, idx, w, W, mesh=_mesh(2, 4, auto=True))
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, want) < TOL_BF16_REORDER


def test_skewed_routing_and_idle_ranks(cpu_devices):
    # every token picks experts 0..k-1, all owned by rank 0: the other ranks hold idle experts
    shape = mj.load_model("ci")
    x, _, w, W = random_problem(shape, 32, seed=12)
    idx = jnp.tile(jnp.arange(shape.top_k, dtype=jnp.int32)[None], (32, 1))
    want = mj.moe(x, idx, w, W)
    got = mj.expert_parallel_moe(x, idx, w, W, mesh=_mesh(1, 4))
    assert rel_err(got, want) < TOL_F32_REORDER


def test_gradients_equal_single_device(cpu_devices):
    shape = mj.load_model("ci")
    x, idx, w, W = random_problem(shape, 32, seed=13)
    dy = jax.random.normal(jax.random.key(14), x.shape)
    mesh = _mesh(2, 4)
    loss_ep = lambda x, w, W: jnp.sum(mj.expert_parallel_moe(x, idx, w, W, mesh=mesh) * dy)
    loss_1 = lambda x, w, W: jnp.sum(mj.reference.moe(x, idx, w, W) * dy)
    got = jax.jit(jax.grad(loss_ep, argnums=(0, 1, 2)))(x, w, W)
    want = jax.grad(loss_1, argnums=(0, 1, 2))(x, w, W)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(g, r) < TOL_F32_REORDER


def test_router_weight_gradient_is_expert_output_dot_dy():
    # docs/design.md: d topk_weight[t, j] = <dy_t, expert_{topk_idx[t, j]}(x_t)>
    shape = mj.load_model("ci")
    x, idx, w, W = random_problem(shape, 8, seed=15)
    dy = jax.random.normal(jax.random.key(16), x.shape)
    dw = jax.grad(lambda w: jnp.sum(mj.moe(x, idx, w, W) * dy))(w)
    from mok_jax.reference.experts import swiglu_ffn

    for t in range(8):
        for j in range(shape.top_k):
            e = int(idx[t, j])
            want = float(jnp.dot(dy[t], swiglu_ffn(x[t], W.gate_up[e], W.down[e])))
            assert abs(float(dw[t, j]) - want) <= 1e-4 * max(1.0, abs(want))


def test_one_axis_mesh(cpu_devices):
    shape = mj.load_model("ci")
    x, idx, w, W = random_problem(shape, 16, seed=17)
    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices("cpu")[:2])
    assert rel_err(mj.expert_parallel_moe(x, idx, w, W, mesh=mesh), mj.moe(x, idx, w, W)) < TOL_F32_REORDER


@pytest.mark.parametrize("auto", [False, True])
@pytest.mark.parametrize("tokens", [("dp",), ("dp", "ep")])
def test_moe_without_an_ep_axis_on_sharded_arguments(cpu_devices, auto, tokens):
    """mok_jax.moe with no EP axis, under jit, on data-parallel x (its tokens over ``tokens``) and routed weights
    sharded over "ep", on an Explicit or an Auto mesh: the single-device forward and gradients, y in x's sharding on
    Explicit axes (where it raised ShardingTypeError: the gather of a slot's row, or experts and tokens both split
    over "ep")."""
    shape = mj.load_model("ci")
    x, idx, w, W = random_problem(shape, 32, seed=18)
    dy = jax.random.normal(jax.random.key(19), x.shape)
    mesh = _mesh(2, 4, auto=auto)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    tok = P(tokens)
    args = (put(x, tok), put(idx, tok), put(w, tok), mj.MoEWeights(*map(put, W, (P("ep"), P("ep"), P(), P()))))
    run = jax.jit(jax.value_and_grad(lambda x, i, w, W: jnp.sum(mj.moe(x, i, w, W) * dy), argnums=(0, 2, 3)))
    got, want = run(*args), run(x, idx, w, W)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(g, r) < TOL_F32_REORDER
    y = jax.jit(mj.moe)(*args)
    assert auto or y.sharding.is_equivalent_to(args[0].sharding, y.ndim)  # Explicit: x's sharding, by type
