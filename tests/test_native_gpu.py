"""The native library's routing ops on the GPU (their CPU checks: tests/test_native.py): the counts are exact, and the
padded expert-major layout (ops.expert_layout) is the bits of mok_jax.expert_layout.padded_layout and rank_layout,
all four arrays, on fresh random routings (MOK_TEST_SEED draws them again)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import _native, layer
from mok_jax.expert_layout import padded_layout, rank_layout
from mok_jax.ops import expert_counts, expert_layout
from mok_jax.ops.routing import MAX_LAYOUT_EXPERTS


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,k,experts", [(1, 1, 1), (4097, 8, 384), (2048, 10, 512), (333, 6, 7),
                                              (2048, 8, MAX_LAYOUT_EXPERTS)])
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


# ----------------------------------------------------------------------------- the padded expert-major layout

_LAYOUT_NAMES = ("pos", "src_token", "src_slot", "group_sizes")


def _assert_same_layout(got, want, what: str) -> None:
    for name, a, b in zip(_LAYOUT_NAMES, got, want):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype == np.int32, (what, name, a.shape, a.dtype, b.shape)
        bad = np.flatnonzero(a.reshape(-1) != b.reshape(-1))
        assert bad.size == 0, (f"{what}: {name} differs at {bad.size} of {a.size}, e.g. {bad[:6].tolist()}: "
                               f"{a.reshape(-1)[bad[:6]].tolist()} != {b.reshape(-1)[bad[:6]].tolist()}")


def _routing(rng, case: str, tokens: int, k: int, experts: int) -> np.ndarray:
    """int32[tokens, k] of global ids in [0, experts) with the case's oddities."""
    idx = rng.integers(0, experts, size=(tokens, k), dtype=np.int32)
    if case == "masked_invalid" and idx.size:
        idx[rng.random(idx.shape) < 0.25] = -1
        bad = rng.random(idx.shape) < 0.02
        idx[bad] = rng.choice(np.array([experts, experts + 7, -2, -(2**31), 2**31 - 1], np.int32), int(bad.sum()))
    elif case == "one_expert":  # every slot to one expert: one group holds them all, the others are empty
        idx[:] = experts // 2
    elif case == "zipf":  # skewed: a few experts take most slots
        idx = np.minimum(rng.zipf(1.3, size=(tokens, k)) - 1, experts - 1).astype(np.int32)
    elif case == "all_masked":
        idx[:] = -1
    return idx


LAYOUT_CASES = [  # (case, tokens, k, experts, block)
    ("random", 1, 1, 1, 128), ("random", 333, 6, 7, 128), ("masked_invalid", 2048, 8, 128, 128),
    ("masked_invalid", 4097, 10, 384, 16), ("one_expert", 100_000, 8, 16, 128), ("zipf", 8192, 8, 16, 128),
    ("all_masked", 1000, 4, 12, 128), ("random", 0, 8, 12, 128), ("random", 5, 0, 3, 128),
    ("random", 300, 32, 64, 1), ("masked_invalid", 4096, 8, 1024, 128),
    ("masked_invalid", 2048, 8, MAX_LAYOUT_EXPERTS, 128), ("random", 1 << 17, 32, 6, 128),
]


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_kernels")
@pytest.mark.parametrize("case,tokens,k,experts,block", LAYOUT_CASES, ids=lambda v: str(v))
def test_expert_layout_is_the_bits_of_padded_layout(case, tokens, k, experts, block, seed):
    rng = np.random.default_rng(seed(tokens * 131 + k * 7 + experts))
    idx = jnp.asarray(_routing(rng, case, tokens, k, experts))
    got = jax.jit(expert_layout, static_argnums=(1, 2))(idx, experts, block)
    want = jax.jit(padded_layout, static_argnums=(1, 2))(idx, experts, block)
    _assert_same_layout(got, want, f"{case} T={tokens} k={k} E={experts} block={block}")
    again = jax.jit(expert_layout, static_argnums=(1, 2))(idx, experts, block)
    _assert_same_layout(again, got, "a second call")  # deterministic: the same bits every time


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_kernels")
@pytest.mark.parametrize("case", ["random", "masked_invalid", "zipf", "one_expert"])
@pytest.mark.parametrize("ep,local,tokens,k", [(2, 8, 512, 4), (8, 16, 256, 8), (64, 6, 64, 8), (4, 1024, 128, 8)])
def test_expert_layout_per_rank_is_the_bits_of_rank_layout(case, ep, local, tokens, k, seed, monkeypatch):
    """first_expert = rank * L, traced (as jax.lax.axis_index gives it): every rank's layout of the EP group's slots,
    and the layer's op_layout (MOK_JAX_NATIVE_LAYOUT=1), which lowers the op for CUDA."""
    monkeypatch.setenv(layer.NATIVE_LAYOUT_ENV, "1")
    rng = np.random.default_rng(seed(ep * 1000 + local))
    idx = jnp.asarray(_routing(rng, case, ep * tokens, k, ep * local))
    native = jax.jit(lambda i, r: expert_layout(i, local, 128, first_expert=r * local))
    picked = jax.jit(lambda i, r: layer.op_layout(i, local, r))
    reference = jax.jit(lambda i, r: rank_layout(i, local, r))
    assert "custom_call @mok_expert_layout(" in picked.lower(idx, jnp.int32(0)).as_text()
    for r in sorted({0, 1, ep // 2, ep - 1}):
        want = reference(idx, jnp.int32(r))
        _assert_same_layout(native(idx, jnp.int32(r)), want, f"{case} EP {ep} rank {r}: ops.expert_layout")
        _assert_same_layout(picked(idx, jnp.int32(r)), want, f"{case} EP {ep} rank {r}: layer.op_layout")
