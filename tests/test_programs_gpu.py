"""GPU tests of the forward megakernel inside real JAX programs (issue 11, the parts that need no gradient).

Every case compares ``implementation="mok"`` under a transformation with the same calls made plainly, bit
for bit (the math is the same, so the bits must be): ``jax.checkpoint`` with the default and a names-based
policy, ``lax.scan`` over a stack of 4 layers, two layers of different shapes in one program, donated
arguments, and ``jax.jit`` callers on meshes of Auto and of Explicit axes. Gradients (EP 1) under
``jax.checkpoint``: tests/test_moe_backward_gpu.py. XLA command buffers: tests/test_command_buffers_gpu.py.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import module_seed, program_problem, seeded_key

import mok_jax as mj
from mok_jax.config import KernelConfig, ModelShape, MoEConfig

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_kernels")]

_SEED = module_seed(__name__)  # MOK_TEST_SEED, else fresh (helpers.py: seeds)
MOK = MoEConfig(implementation="mok", kernel=KernelConfig(granularity=512, comm_items_fwd=8))


def _problem(tag: str, **shape):
    """x, topk_idx, topk_weight, weights of tests/helpers.py's program_problem (a routing per layer when
    ``layers`` is given)."""
    return program_problem(_SEED, tag, **shape)[:4]


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def _layer(x, idx, w, W):
    return mj.moe(x, idx, w, W, config=MOK)


def test_checkpoint_policies_give_the_same_bits():
    x, idx, w, W = _problem("remat")
    plain = jax.jit(_layer)(x, idx, w, W)
    names = jax.checkpoint_policies.save_only_these_names("moe_out")
    for f in (jax.checkpoint(_layer), jax.checkpoint(_layer, policy=names)):
        np.testing.assert_array_equal(_bits(jax.jit(f)(x, idx, w, W)), _bits(plain))


def test_scan_over_four_layers_equals_the_loop():
    x, idx, w, Ws = _problem("scan", layers=4)

    def body(h, layer):
        i, w, W = layer
        return (_layer(h, i, w, W).astype(jnp.float32) * 0.5).astype(jnp.bfloat16), None

    scanned = jax.jit(lambda x, layers: jax.lax.scan(body, x, layers)[0])(x, (idx, w, Ws))
    h = x
    for layer in range(4):
        h = jax.jit(body)(h, jax.tree.map(lambda a: a[layer], (idx, w, Ws)))[0]
    assert np.isfinite(np.asarray(h, np.float32)).all()
    np.testing.assert_array_equal(_bits(scanned), _bits(h))


def test_two_shapes_in_one_program():
    a = _problem("shape_a", E=16, H=512, I=256, k=4, T=600)
    b = _problem("shape_b", E=8, H=768, I=384, k=2, Is=128, T=300)
    both = jax.jit(lambda a, b: (_layer(*a), _layer(*b)))(a, b)
    np.testing.assert_array_equal(_bits(both[0]), _bits(jax.jit(_layer)(*a)))
    np.testing.assert_array_equal(_bits(both[1]), _bits(jax.jit(_layer)(*b)))


def test_donated_arguments():
    x, idx, w, W = _problem("donate")
    want = jax.jit(_layer)(x, idx, w, W)
    donated = jax.jit(_layer, donate_argnums=(0, 1, 2))(jnp.copy(x), jnp.copy(idx), jnp.copy(w), W)
    np.testing.assert_array_equal(_bits(donated), _bits(want))


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_jit_callers_on_auto_and_explicit_meshes(axis_type):
    x, idx, w, W = _problem(f"mesh_{axis_type}")
    want = jax.jit(_layer)(x, idx, w, W)
    gpus = [d for d in jax.devices() if d.platform == "gpu"][:1]
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(getattr(jax.sharding.AxisType, axis_type),), devices=gpus)
    cfg = MoEConfig(implementation="mok", ep_axis="ep", kernel=MOK.kernel)
    f = jax.jit(lambda x, i, w, W: mj.expert_parallel_moe(x, i, w, W, mesh=mesh, config=cfg))
    np.testing.assert_array_equal(_bits(f(x, idx, w, W)), _bits(want))


def test_nnx_scan_over_four_layers_equals_the_loop():
    """nnx.scan over 4 stacked MoELayer modules (their own router, weights and one shared workspace) against
    the layers applied one by one. The routers run inside different XLA programs, so the comparison is per
    row at the bf16 layer's error, not bitwise."""
    from flax import nnx

    from mok_jax.flax import MoELayer

    shape = ModelShape(name="scan4", num_experts=16, top_k=4, hidden_size=512, intermediate_size=256,
                       num_shared_experts=1, shared_intermediate_size=256)

    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return MoELayer(shape, implementation="mok", kernel=MOK.kernel, max_tokens=600, rngs=rngs)

    stack = make(nnx.Rngs(_SEED % 1000))
    x = jax.random.normal(seeded_key(_SEED, "nnx_scan"), (600, shape.hidden_size)).astype(jnp.bfloat16)

    @nnx.jit
    def scanned(stack, x):
        return nnx.scan(lambda h, layer: (layer(h), None), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x, stack)[0]

    y = np.asarray(scanned(stack, x), np.float32)
    graphdef, state = nnx.split(stack)
    h = x
    for i in range(4):
        h = nnx.jit(lambda layer, h: layer(h))(nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state)), h)
    h = np.asarray(h, np.float32)
    assert np.isfinite(y).all()
    rel = np.linalg.norm(y - h, axis=1) / np.maximum(np.linalg.norm(h, axis=1), 1e-6)
    assert rel.max() < 3e-2, f"rows {np.argsort(rel)[-5:].tolist()} differ by {np.sort(rel)[-5:].tolist()}"
