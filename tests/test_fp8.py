"""mok_jax.fp8 on the CPU: E4M3 block quantisation (1 x 128 rows, 128 x 128 weight blocks) and the block-scaled
GEMM reference, per element against bounds derived from E4M3's rounding (mok_jax/fp8.py's docstring):

    |q * scale - w| <= max(2^-4 |w|, 2^-10 scale)        per element (3 mantissa bits; subnormal spacing 2^-9)

and, for the GEMM, with B(v) that bound and products summed over K,

    |y - x @ w| <= B(x) @ |w| + |x| @ B(w) + B(x) @ B(w)  (+ f32 summation, 2^-20 of |x^| @ |w^|)

per output element: the quantisation errors of the two factors, nothing statistical.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import fp8

# f32 summation over K <= 512 terms in any order: (K - 1) 2^-24 relative to the sum of magnitudes < 2^-15; 2^-20
# is the slack used, far below the quantisation bound (~2^-4 of the same sum).
F32_SUM_SLACK = 2.0**-15


def _scale_per_element_w(scale, k, n):
    return np.repeat(np.repeat(np.asarray(scale), 128, axis=-2), 128, axis=-1)[..., :k, :n]


def _scale_per_element_x(scale, k):
    return np.repeat(np.asarray(scale), 128, axis=-1)[..., :k]


def _weights(key, shape, spread=True):
    w = jax.random.normal(key, shape, jnp.float32)
    if spread:  # magnitudes over ~2^-12..2^4 so that subnormal E4M3 values occur inside a block
        w = w * jnp.exp2(jax.random.uniform(jax.random.fold_in(key, 1), shape, minval=-12.0, maxval=4.0))
    return w


@pytest.mark.parametrize("shape", [(2, 256, 384), (3, 200, 300), (1, 128, 128), (5, 7)])
def test_weight_blocks_round_trip_within_the_e4m3_bound(shape):
    w = _weights(jax.random.key(0), shape)
    q, scale = fp8.quantize_weight_blocks(w)
    k, n = shape[-2:]
    assert q.dtype == jnp.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == jnp.float32 and scale.shape == (*shape[:-2], -(-k // 128), -(-n // 128))
    back = np.asarray(fp8.dequantize_weight_blocks(q, scale))
    s = _scale_per_element_w(scale, k, n)
    bound = np.asarray(fp8.quantization_error_bound(w, s))
    err = np.abs(back - np.asarray(w))
    assert (err <= bound).all(), f"worst err/bound {np.max(err / bound):.3f}"
    assert np.max(err / bound) > 0.5  # the bound is tight: some value sits near half an E4M3 ulp from both sides
    # the block's largest magnitude maps to +-448 exactly: the scale uses the whole E4M3 range
    qf = np.abs(np.asarray(q, np.float32))
    kb, nb = scale.shape[-2:]
    for b in range(kb):
        for c in range(nb):
            blk = (..., slice(128 * b, 128 * b + 128), slice(128 * c, 128 * c + 128))
            assert qf[blk].max() == fp8.E4M3_MAX


def test_zero_block_and_bad_inputs():
    w = jnp.zeros((256, 256)).at[:128, :128].set(1.0)
    q, scale = fp8.quantize_weight_blocks(w)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray([[1.0 / 448.0, 1.0], [1.0, 1.0]], np.float32))
    assert not np.asarray(q, np.float32)[128:].any() and not np.asarray(q, np.float32)[:, 128:].any()
    with pytest.raises(ValueError, match="w must have at least 2 dimensions"):
        fp8.quantize_weight_blocks(jnp.ones((4,)))
    with pytest.raises(TypeError, match="x must be a bf16/f16/f32 array"):
        fp8.quantize_rows(jnp.ones((4, 128), jnp.int32))


def test_nonfinite_weight_block_quantises_to_nan():
    """A 128 x 128 block holding a NaN, an inf or a -inf comes out all NaN (scale and values); every other block has
    the bits of the same weights without the bad ones. (Before, a NaN block got scale 1 and an inf block its finite
    values flushed to 0.)"""
    w = _weights(jax.random.key(7), (256, 384))
    bad = {(0, 0): jnp.nan, (1, 2): jnp.inf, (1, 0): -jnp.inf}  # block -> the value put at one element of it
    w_bad = w
    for (bk, bn), v in bad.items():
        w_bad = w_bad.at[128 * bk + 3, 128 * bn + 5].set(v)
    q, scale = fp8.quantize_weight_blocks(w_bad)
    q_ref, scale_ref = fp8.quantize_weight_blocks(w)
    q, q_ref = np.asarray(q, np.float32), np.asarray(q_ref, np.float32)
    scale, scale_ref = np.asarray(scale), np.asarray(scale_ref)
    for bk in range(2):
        for bn in range(3):
            blk = (slice(128 * bk, 128 * bk + 128), slice(128 * bn, 128 * bn + 128))
            if (bk, bn) in bad:
                assert np.isnan(scale[bk, bn]) and np.isnan(q[blk]).all(), (bk, bn)
            else:
                assert scale[bk, bn].tobytes() == scale_ref[bk, bn].tobytes(), (bk, bn)
                np.testing.assert_array_equal(q[blk], q_ref[blk])


def test_nonfinite_expert_weight_gives_nan_rows_of_that_expert_only():
    """Through the FP8 grouped FFN's reference: an inf in expert 1's down makes expert 1's rows NaN and leaves
    expert 0's rows the bits of the clean weights."""
    e, hidden, inter = 2, 128, 128
    keys = jax.random.split(jax.random.key(8), 3)
    gate_up = jax.random.normal(keys[0], (e, hidden, 2 * inter), jnp.float32) * hidden**-0.5
    down = jax.random.normal(keys[1], (e, inter, hidden), jnp.float32) * inter**-0.5
    x = jax.random.normal(keys[2], (5, hidden), jnp.float32).astype(jnp.bfloat16)
    clean = fp8.grouped_ffn_reference(x, [2, 3], fp8.quantize_expert_weights(gate_up, down)).y
    poisoned = fp8.grouped_ffn_reference(x, [2, 3], fp8.quantize_expert_weights(gate_up, down.at[1, 7, 9].set(jnp.inf))).y
    clean, poisoned = np.asarray(clean), np.asarray(poisoned)
    assert np.isnan(poisoned[2:]).all()
    assert np.isfinite(clean).all()
    np.testing.assert_array_equal(poisoned[:2], clean[:2])


@pytest.mark.parametrize("shape", [(64, 512), (33, 200), (1, 7)])
def test_rows_round_trip_within_the_e4m3_bound(shape):
    x = _weights(jax.random.key(1), shape).astype(jnp.bfloat16)
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (shape[0], -(-shape[1] // 128))
    back = np.asarray(fp8.dequantize_rows(q, scale))
    s = _scale_per_element_x(scale, shape[1])
    bound = np.asarray(fp8.quantization_error_bound(x, s))
    err = np.abs(back - np.asarray(x, np.float32))
    assert (err <= bound).all(), f"worst err/bound {np.max(err / bound):.3f}"
    assert np.max(err / bound) > 0.5  # the bound is tight
    assert (np.abs(np.asarray(q, np.float32)).max(axis=1) == fp8.E4M3_MAX).all()  # each row's amax -> 448


@pytest.mark.parametrize("m,k,n", [(48, 384, 256), (17, 200, 130)])
def test_block_scaled_matmul_within_the_derived_bound_per_element(m, k, n):
    x = _weights(jax.random.key(2), (m, k))
    w = _weights(jax.random.key(3), (k, n))
    xq, xs = fp8.quantize_rows(x)
    wq, ws = fp8.quantize_weight_blocks(w)
    y = np.asarray(fp8.block_scaled_matmul(xq, xs, wq, ws), np.float64)
    xd = np.asarray(fp8.dequantize_rows(xq, xs), np.float64)
    wd = np.asarray(fp8.dequantize_weight_blocks(wq, ws), np.float64)
    # against the dequantised product: f32 summation only
    mag = np.abs(xd) @ np.abs(wd)
    assert (np.abs(y - xd @ wd) <= F32_SUM_SLACK * mag).all()
    # against the unquantised product: the two factors' quantisation errors
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    bx = np.asarray(fp8.quantization_error_bound(x, _scale_per_element_x(xs, k)), np.float64)
    bw = np.asarray(fp8.quantization_error_bound(w, _scale_per_element_w(ws, k, n)), np.float64)
    bound = bx @ np.abs(w64) + np.abs(x64) @ bw + bx @ bw + F32_SUM_SLACK * mag
    err = np.abs(y - x64 @ w64)
    assert (err <= bound).all(), f"worst err/bound {np.max(err / bound):.3f}"
    # and the bound is not vacuous: typical errors are a small part of it, and of the product's magnitude
    assert np.median(err / bound) < 0.5
    assert np.median(err / (np.abs(x64) @ np.abs(w64))) < 2.0**-5
