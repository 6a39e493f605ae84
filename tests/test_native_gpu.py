"""The native library's routing-count op is exact on the GPU (its CPU checks: tests/test_native.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import _native
from mok_jax.ops import expert_counts


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,k,experts", [(1, 1, 1), (4097, 8, 384), (2048, 10, 512), (333, 6, 7)])
def test_expert_counts_exact_on_gpu(tokens, k, experts, seed):
    assert _native.library() is not None, _native.native_status()
    rng = np.random.default_rng(seed(tokens))
    idx = rng.integers(0, experts, size=(tokens, k), dtype=np.int32)
    idx[0, 0] = experts + 3  # one invalid index, counted apart
    if tokens > 1:
        idx[1, 0] = -1
    counts, invalid = jax.jit(expert_counts, static_argnums=1)(jnp.asarray(idx), experts)
    valid = idx[(idx >= 0) & (idx < experts)]
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(valid, minlength=experts))
    assert int(invalid) == idx.size - valid.size


@pytest.mark.gpu
def test_expert_counts_bitwise_repeatable_and_skewed():
    idx = jnp.zeros((100_000, 8), jnp.int32)  # everything to expert 0: worst-case contention
    f = jax.jit(expert_counts, static_argnums=1)
    a, _ = f(idx, 16)
    b, _ = f(idx, 16)
    assert int(a[0]) == 800_000 and int(jnp.sum(a)) == 800_000
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
