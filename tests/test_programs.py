"""The layer inside real JAX programs, on the CPU (implementation="xla"); tests/test_programs_gpu.py runs
the same programs with implementation="mok" on the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mok_jax as mj
from mok_jax.flax import MoELayer


def test_nnx_scan_over_four_layers_equals_the_loop():
    shape = mj.load_model("ci")

    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return MoELayer(shape, implementation="xla", dtype=jnp.float32, rngs=rngs)

    stack = make(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (64, shape.hidden_size), jnp.float32)
    y = nnx.scan(lambda h, layer: (layer(h), None), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x, stack)[0]
    graphdef, state = nnx.split(stack)
    h = x
    for i in range(4):
        h = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))(h)
    # f32 throughout; the scanned program fuses differently: a few f32 ulps of the O(1) outputs
    np.testing.assert_allclose(np.asarray(y), np.asarray(h), rtol=1e-4, atol=1e-4)
    assert float(jnp.std(y)) > 1e-3  # four layers deep, still a live signal
