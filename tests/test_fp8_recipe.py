"""The FP8 recipe's arithmetic in pure JAX (mok_jax.bench.fp8_recipe), on the CPU: its 128 x 1 tiles against
mok_jax.fp8.quantize_rows, its forward against the FP8 FFN's oracle, the bf16 backward against the bf16 layer's
gradient, the FP8 backwards' distance from it, and the training-curve names that run it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mok_jax import fp8
from mok_jax.bench import fp8_recipe, train_curve
from mok_jax.layer import moe
from mok_jax.reference.experts import grouped_ffn

H, I = 256, 256


def _problem(sizes, seed=0, rows_past=0):
    k = jax.random.split(jax.random.key(seed), 4)
    m = int(sum(sizes)) + rows_past
    E = len(sizes)
    x = jax.random.normal(k[0], (m, H), jnp.float32).astype(jnp.bfloat16)
    gate_up = (jax.random.normal(k[1], (E, H, 2 * I)) * H**-0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(k[2], (E, I, H)) * I**-0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(k[3], (m, H), jnp.float32)
    return x, jnp.asarray(sizes, jnp.int32), gate_up, down, dy


def test_column_tiles_are_quantize_rows_of_each_experts_128_rows():
    """Each 128 x 1 tile starts at its expert's first row or 128 rows after it: quantize_rows of the transposed tile,
    bit for bit; rows past the groups are never read."""
    rng = np.random.default_rng(0)
    sizes = [300, 0, 128, 5]
    a = (rng.standard_normal((sum(sizes) + 7, 3 * 128)) * np.exp(rng.uniform(-4, 4, (1, 3 * 128)))).astype(np.float32)
    got = np.asarray(fp8_recipe.fake_quantize_columns(jnp.asarray(a), jnp.asarray(sizes, jnp.int32)))
    start = 0
    for s in sizes:
        for r0 in range(start, start + s, 128):
            tile = a[r0:min(r0 + 128, start + s)]  # [rows, N]: one tile per column
            want = np.asarray(fp8.dequantize_rows(*fp8.quantize_rows(jnp.asarray(tile.T)))).T
            np.testing.assert_array_equal(got[r0:r0 + len(tile)].view(np.uint32), want.view(np.uint32))
        start += s


@pytest.mark.parametrize("backward", fp8_recipe.BACKWARDS)
def test_forward_is_the_fp8_ffn_oracle(backward):
    x, sizes, gate_up, down, _ = _problem([200, 0, 77, 130])
    y = fp8_recipe.routed_experts(x, sizes, gate_up, down, backward)
    want = fp8.grouped_ffn_reference(x, list(np.asarray(sizes)), fp8.quantize_expert_weights(gate_up, down)).y
    # the oracle sums each 128-long K block before its scales; here the dequantised values are summed in f32
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))


def _grads(backward, x, sizes, gate_up, down, dy):
    if backward is None:  # the bf16 grouped FFN (the layer's arithmetic), differentiated by JAX
        f = lambda x, g, d: jnp.sum(grouped_ffn(x, sizes, g, d).astype(jnp.float32) * dy)  # noqa: E731
    else:
        f = lambda x, g, d: jnp.sum(fp8_recipe.routed_experts(x, sizes, g, d, backward) * dy)  # noqa: E731
    return jax.grad(f, argnums=(0, 1, 2))(x, gate_up, down)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_bf16_backward_is_the_bf16_layers_gradient():
    """Straight-through: the FP8 forward's backward is the bf16 FFN's gradient, to its bf16 roundings."""
    args = _problem([200, 0, 77, 130])
    got, want = _grads("bf16", *args), _grads(None, *args)
    for name, g, w in zip(("dx", "d_gate_up", "d_down"), got, want):
        assert g.dtype == w.dtype
        assert _rel(g, w) < 1e-2, (name, _rel(g, w))


def test_fp8_backwards_quantise_what_they_say():
    """fp8-dgrad: dx and the weight gradients move by E4M3's error (dh and dgu come from quantised dy, dgu); fp8:
    the weight gradients move further (their operands quantised in 128 x 1 tiles), dx stays fp8-dgrad's bit for bit.
    Rows past the groups get a zero gradient in every form."""
    x, sizes, gate_up, down, dy = _problem([200, 0, 77, 130], rows_past=9)
    ref = _grads(None, x, sizes, gate_up, down, dy)
    st, dg, full = (_grads(b, x, sizes, gate_up, down, dy) for b in fp8_recipe.BACKWARDS)
    for g in (st, dg, full):
        assert not np.asarray(g[0][-9:], np.float32).any()
    for i in range(3):
        assert 0.01 < _rel(dg[i], ref[i]) < 0.1, (i, _rel(dg[i], ref[i]))  # E4M3: 2^-4 relative per value at most
    np.testing.assert_array_equal(np.asarray(full[0]).view(np.uint16), np.asarray(dg[0]).view(np.uint16))
    for i in (1, 2):
        assert _rel(full[i], ref[i]) > _rel(dg[i], ref[i]) and _rel(full[i], ref[i]) < 0.15


def test_recipe_layer_and_curve_names():
    assert {n: train_curve.IMPLEMENTATIONS[n]["fp8_backward"] for n in ("xla-fp8-st", "xla-fp8-dgrad", "xla-fp8")} \
        == {"xla-fp8-st": "bf16", "xla-fp8-dgrad": "fp8-dgrad", "xla-fp8": "fp8"}
    with pytest.raises(ValueError, match="backward must be one of"):
        fp8_recipe.Fp8RecipeLayer(train_curve.SHAPE, backward="fp16", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mesh must be None"):
        fp8_recipe.Fp8RecipeLayer(train_curve.SHAPE, backward="fp8", mesh=jax.make_mesh((1,), ("ep",)),
                                  rngs=nnx.Rngs(0))
    layer = fp8_recipe.Fp8RecipeLayer(train_curve.SHAPE, backward="fp8", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 128, train_curve.SHAPE.hidden_size), jnp.bfloat16)
    y, aux = layer(x, return_aux_loss=True)
    assert y.shape == x.shape and y.dtype == jnp.bfloat16 and bool(jnp.isfinite(y.astype(jnp.float32)).all())
    tokens = x.reshape(-1, x.shape[-1])  # the same routing and parameters through the bf16 xla layer
    idx, w, _ = layer.route(tokens)
    want = moe(tokens, idx, w, layer.weights(), config=layer.config).reshape(x.shape)
    assert 0.005 < _rel(y, want) < 0.1  # the FP8 forward: E4M3's error, not another layer's output
    assert train_curve.main(["--steps", "3", "--layers", "1", "--tokens", "256", "--vocab", "64",
                             "--impl", "xla,xla-fp8"]) == 0
