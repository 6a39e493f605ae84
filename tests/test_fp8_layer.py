"""The layer with FP8 routed experts on the CPU (mok_jax.fp8.moe_reference, the oracle of the FP8 layer forward):
per token against the unquantised f32 layer within the E4M3 error its slots' derived sigmas combine to
(mok_jax.fp8.ffn_error_sigma), masked slots adding nothing whatever their weight, each slot the grouped FFN
pipeline on its token's row, and the shared expert and the rounding of the bf16 layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import fp8, reference
from mok_jax.weights import MoEWeights

_F32 = jnp.float32

# A token's error norm against the root of its summed variances: as for the FFN alone (tests/test_fp8_grouped_ffn.py,
# measured 0.31-0.53 there; 0.31-0.59 on these layers), 1.0 bounds it with about 2x margin: a token sums H >= 128
# near-independent terms of k independent slots. Below 0.15 the variances would be > 6x too large: the model would test nothing.
ROW_SIGMA_FACTOR = 1.0
ROW_SIGMA_FLOOR = 0.15


def _layer(seed, T, E, k, H, I, Is, routing):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (T, H), _F32).astype(jnp.bfloat16)
    W = MoEWeights(
        (jax.random.normal(ks[1], (E, H, 2 * I)) * H**-0.5).astype(jnp.bfloat16),
        (jax.random.normal(ks[2], (E, I, H)) * I**-0.5).astype(jnp.bfloat16),
        (jax.random.normal(ks[3], (H, 2 * Is)) * H**-0.5).astype(jnp.bfloat16) if Is else None,
        (jax.random.normal(ks[4], (Is, H)) * Is**-0.5).astype(jnp.bfloat16) if Is else None)
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    if routing == "masked":  # a fifth of the slots masked, both ways (-1 and >= E), and one token wholly
        idx[rng.random(idx.shape) < 0.2] = -1
        idx[rng.random(idx.shape) < 0.05] = E + 3
        idx[0] = -1
    elif routing == "one_expert":
        idx[:, 0] = 2
        idx[:, 1:] = -1
    w = jax.random.uniform(ks[5], (T, k), _F32, 0.05, 1.0)
    return x, jnp.asarray(idx), w, W


@pytest.mark.parametrize("T,E,k,H,I,Is,routing", [
    (48, 8, 4, 256, 256, 128, "uniform"),
    (40, 16, 10, 128, 384, 0, "masked"),
    (1, 16, 10, 256, 128, 0, "uniform"),
    (30, 4, 2, 128, 128, 128, "one_expert"),
])
def test_layer_within_the_derived_e4m3_error_per_token(T, E, k, H, I, Is, routing):
    x, idx, w, W = _layer(T + k, T, E, k, H, I, Is, routing)
    w8 = fp8.quantize_expert_weights(W.gate_up, W.down)
    ref = fp8.moe_reference(x, idx, w, W, w8)
    f32 = jax.tree.map(lambda a: a.astype(_F32), W)
    with jax.default_matmul_precision("highest"):
        routed32 = reference.moe(x.astype(_F32), idx, w, f32._replace(shared_gate_up=None, shared_down=None))
    has_slot = np.asarray(((idx >= 0) & (idx < E)).any(axis=1))
    err = np.linalg.norm(np.asarray(ref.routed) - np.asarray(routed32), axis=1)
    sigma = np.linalg.norm(np.asarray(ref.sigma), axis=1)
    ratio = err[has_slot] / sigma[has_slot]
    assert ratio.max() <= ROW_SIGMA_FACTOR, f"worst token err / sigma {ratio.max():.3f}"
    assert ratio.min() >= ROW_SIGMA_FLOOR, f"the error model is too loose: best token err / sigma {ratio.min():.3f}"
    # a token without a routed slot gets exactly nothing from the routed experts
    assert not np.asarray(ref.routed)[~has_slot].any() and not np.asarray(ref.sigma)[~has_slot].any()
    # the shared expert and the rounding are the bf16 layer's
    np.testing.assert_array_equal(np.asarray(ref.shared), np.asarray(reference.shared_expert(x, W)))
    np.testing.assert_array_equal(np.asarray(ref.y).view(np.uint16),
                                  np.asarray((ref.routed + ref.shared).astype(jnp.bfloat16)).view(np.uint16))


def test_masked_slots_add_nothing_whatever_their_weight():
    x, idx, w, W = _layer(5, 24, 8, 4, 128, 128, 0, "masked")
    w8 = fp8.quantize_expert_weights(W.gate_up, W.down)
    masked = (idx < 0) | (idx >= 8)
    got = fp8.moe_reference(x, idx, jnp.where(masked, jnp.nan, w), W, w8)
    want = fp8.moe_reference(x, idx, jnp.where(masked, 0.0, w), W, w8)
    assert np.isfinite(np.asarray(got.routed)).all()
    np.testing.assert_array_equal(np.asarray(got.routed), np.asarray(want.routed))
    everything_masked = fp8.moe_reference(x, jnp.full_like(idx, -1), w, W, w8)
    assert not np.asarray(everything_masked.routed).any()


def test_each_slot_is_the_grouped_pipeline_on_its_tokens_row():
    """A token's routed output is sum_j w_j * grouped_ffn_reference of its row alone under expert idx[t, j], in
    slot order (the pipeline quantises each row on its own, so batching rows changes nothing but the f32 matmul's
    summation order)."""
    E, k = 4, 3
    x, idx, w, W = _layer(9, 6, E, k, 256, 128, 0, "uniform")
    w8 = fp8.quantize_expert_weights(W.gate_up, W.down)
    ref = fp8.moe_reference(x, idx, w, W, w8)
    for t in range(x.shape[0]):
        want = jnp.zeros((x.shape[1],), _F32)
        for j in range(k):
            sizes = np.eye(E, dtype=np.int32)[int(idx[t, j])]
            want = want + w[t, j] * fp8.grouped_ffn_reference(x[t:t + 1], sizes, w8).y[0]
        np.testing.assert_allclose(np.asarray(ref.routed[t]), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_bad_arguments_name_themselves():
    x, idx, w, W = _layer(1, 4, 4, 2, 128, 128, 0, "uniform")
    w8 = fp8.quantize_expert_weights(W.gate_up, W.down)
    with pytest.raises(ValueError, match="topk_idx"):
        fp8.moe_reference(x, idx[:3], w, W, w8)
    with pytest.raises(ValueError, match="topk_weight must be"):
        fp8.moe_reference(x, idx, w[:, :1], W, w8)
